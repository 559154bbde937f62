// Norms, stages of fx::Row (row_core.cuh declares them): layer norm and RMS norm over the row,
// group norm over groups of its columns (by lanes, by chunk, or staged in shared memory), batch
// norm with running statistics (eval) and with the batch statistics of the combine (training).
#pragma once

#include "row_core.cuh"

namespace fx {

// The row's mean and 1/sqrt(biased variance + eps), two passes (layer_norm and its backward)
FX_ROW_TEMPLATE
FX_DEVICE void FX_ROW::layer_moments(float eps, float& mean, float& rstd) const {
  const float n = static_cast<float>(a.n);
  mean = reduce_sum() / n;
  const float m = mean;
  const float var = reduce(0.0f, OpAdd(), [m](float x) { return (x - m) * (x - m); }) / n;
  rstd = fx_rsqrt(var + eps);
}

// 1/sqrt(mean(x^2) + eps) of the row (rms_norm and its backward)
FX_ROW_TEMPLATE
FX_DEVICE float FX_ROW::rms_scale(float eps) const {
  const float ms = reduce(0.0f, OpAdd(), [](float x) { return x * x; }) / static_cast<float>(a.n);
  return fx_rsqrt(ms + eps);
}

// F.layer_norm over the row: biased variance (two-pass), (x - mean) * rstd * w + b
FX_ROW_TEMPLATE
template <typename U, int W, int B>
FX_DEVICE void FX_ROW::layer_norm(float eps) {
  float mean, rstd;
  layer_moments(eps, mean, rstd);
  normalise_by_chunk<U, W, B>([mean, rstd](int, float& sh, float& sc) {
    sh = mean;
    sc = rstd;
  });
}

// F.rms_norm: x * rsqrt(mean(x^2) + eps) * w
FX_ROW_TEMPLATE
template <typename U, int W>
FX_DEVICE void FX_ROW::rms_norm(float eps) {
  const float r = rms_scale(eps);
  normalise_by_chunk<U, W, -1>([r](int, float& sh, float& sc) {
    sh = 0.0f;
    sc = r;
  });
}

// Group norm over groups of n/G consecutive columns of the row, two passes (mean, then the mean
// of squared deviations) in fp32 like eager's CUDA kernel, whose eps is a T and which (up to
// torch 2.11) normalises with mean and 1/std rounded to T: FX_GROUP_NORM_ROUNDS_STATS.
//  - a group of `lanes` whole chunks held by consecutive threads (lanes a power of two dividing
//    the row's threads; every suite shape): shuffle sums, no shared memory;
//  - other whole-chunk groups: per-chunk partial sums in shared memory, one thread a group;
//  - a group size that is not a multiple of 16 bytes of T: the row staged in shared memory.
FX_ROW_TEMPLATE
template <typename U, int G, int W, int B>
FX_DEVICE void FX_ROW::group_norm(float eps) {
  const float eps_t = round_to<U>(eps);
  const int gs = a.n / G;
  const int lanes = gs / VEC;
  if (group_in_lanes(a.n, G, VEC) || (gs % VEC == 0 && (lanes & (lanes - 1)) == 0 && a.rt % lanes == 0)) {
    group_norm_by_lanes<U, W, B>(eps_t, gs, lanes);
  } else if (gs % VEC == 0) {
    group_norm_by_chunk<U, G, W, B>(eps_t, gs);
  } else {
    group_norm_staged<U, G, W, B>(eps_t, gs);
  }
}

FX_ROW_TEMPLATE
template <typename U>
FX_DEVICE void FX_ROW::group_stats(float& mean, float& rstd) const {
  if (a.flags & FX_GROUP_NORM_ROUNDS_STATS) {
    mean = round_to<U>(mean);
    rstd = round_to<U>(rstd);
  }
}

// s[i] = the sum of s[i] over the `lanes` consecutive threads holding chunk i's group (lanes a
// power of two; above 32, whole warps through shared memory), in a fixed order.
FX_ROW_TEMPLATE
FX_DEVICE void FX_ROW::group_sums(float (&s)[ITEMS], int lanes) const {
  const int width = lanes < 32 ? lanes : 32;
  for (int off = width >> 1; off > 0; off >>= 1)
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) s[i] += t.shfl_xor(s[i], off);
  if (lanes <= 32) return;
  const int warps = t.bdim() >> 5;
  const int warp = t.tid() >> 5;
  if ((t.tid() & 31) == 0)
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) red[i * warps + warp] = s[i];
  t.sync();
  const int per = lanes >> 5;
  const int first = warp / per * per;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    float r = red[i * warps + first];
    for (int w = 1; w < per; ++w) r += red[i * warps + first + w];
    s[i] = r;
  }
  t.sync();
}

FX_ROW_TEMPLATE
template <typename U, int W, int B>
FX_DEVICE void FX_ROW::group_norm_by_lanes(float eps, int gs, int lanes) {
  float mean[ITEMS], rstd[ITEMS];
  group_moments_by_lanes<U>(eps, gs, lanes, mean, rstd);
  normalise_by_chunk<U, W, B>([&](int i, float& sh, float& sc) {
    sh = mean[i];
    sc = rstd[i];
  });
}

// mean[i] and rstd[i] of chunk i's group, the group's chunks held by `lanes` consecutive
// threads (group_norm and its backward): eager's Welford tree for groups of up to 32 values,
// else two shuffle-summed passes; rounded where eager rounds them (group_stats).
FX_ROW_TEMPLATE
template <typename U>
FX_DEVICE void FX_ROW::group_moments_by_lanes(float eps, int gs, int lanes, float (&mean)[ITEMS], float (&rstd)[ITEMS]) const {
  if (gs <= 32) {
    group_moments_as_eager_warp<U>(eps, gs, lanes, mean, rstd);
    return;
  }
  const float count = static_cast<float>(gs);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) s += v[i][e];
    mean[i] = col(i, 0) < a.n ? s : 0.0f;  // whole groups lie past the end (n % gs == 0)
  }
  group_sums(mean, lanes);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    mean[i] /= count;
    float s = 0.0f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) s += (v[i][e] - mean[i]) * (v[i][e] - mean[i]);
    rstd[i] = col(i, 0) < a.n ? s : 0.0f;
  }
  group_sums(rstd, lanes);
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    rstd[i] = fx_rsqrt(rstd[i] / count + eps);
    group_stats<U>(mean[i], rstd[i]);
  }
}

// Eager's own statistics for a group of at most 32 values (torch's CUDA group norm, a group of
// fewer than 512 values: one warp, value j in lane j, lanes past the group empty): Welford
// states combined by a shuffle-down tree, offsets 16 ... 1, lane 0's result. Here value j of a
// group sits in thread j / VEC, slot j % VEC: the tree's levels of offset >= VEC are butterflies
// between threads, the rest run in registers, and every thread of the group ends with lane 0's
// state bit for bit (the lower side of each pair is combined first, as lane 0 combines). Levels
// at or above the group size only meet empty lanes (no-ops). A one-ulp difference in a statistic
// rounded to bf16 can grow past 1e-2 through a bf16 chain (S04), so the order is eager's.
FX_ROW_TEMPLATE
template <typename U>
FX_DEVICE void FX_ROW::group_moments_as_eager_warp(float eps, int gs, int lanes, float (&mean)[ITEMS],
                                           float (&rstd)[ITEMS]) const {
  const int r = lt % lanes;  // this thread's place in its group
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    float m[VEC], s[VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) welford_leaf(v[i][e], m[e], s[e]);
    float count = 1.0f;  // values behind each side of the next combine (a power of two)
    for (int lx = lanes >> 1; lx >= 1; lx >>= 1, count *= 2.0f) {
      const bool lower = (r & lx) == 0;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {  // selects, not branches: the pair's halves differ
        const float om = t.shfl_xor(m[e], lx);
        const float os = t.shfl_xor(s[e], lx);
        float am = lower ? m[e] : om, as = lower ? s[e] : os;
        welford_combine(am, as, lower ? om : m[e], lower ? os : s[e], count);
        m[e] = am;
        s[e] = as;
      }
    }
#pragma unroll
    for (int off = VEC >> 1; off >= 1; off >>= 1, count *= 2.0f)
#pragma unroll
      for (int e = 0; e < off; ++e) welford_combine(m[e], s[e], m[e + off], s[e + off], count);
    mean[i] = m[0];
    rstd[i] = fx_rsqrt(s[0] / static_cast<float>(gs) + eps);
    group_stats<U>(mean[i], rstd[i]);
  }
}

// WelfordOps::reduce of one value into the empty state, as torch compiles it
FX_ROW_TEMPLATE
FX_DEVICE void FX_ROW::welford_leaf(float x, float& mean, float& m2) {
  mean = 0.0f + x;
  m2 = fx_fma(x, x - mean, 0.0f);
}

// WelfordOps::combine of (mean, m2) with (mb, m2b), both sides holding `count` values, as torch
// compiles it: nb / n is exactly 0.5 and a.nf a power of two, so the two contracted
// multiply-adds are  mean + delta * 0.5  and  (m2 + m2b) + (delta * delta * count) * 0.5.
FX_ROW_TEMPLATE
FX_DEVICE void FX_ROW::welford_combine(float& mean, float& m2, float mb, float m2b, float count) {
  const float delta = mb - mean;
  m2 = fx_fma(delta * delta * count, 0.5f, m2 + m2b);
  mean = fx_fma(delta, 0.5f, mean);
}

FX_ROW_TEMPLATE
template <typename U, int G, int W, int B>
FX_DEVICE void FX_ROW::group_norm_by_chunk(float eps, int gs) {
  const int per_group = gs / VEC;
  const float count = static_cast<float>(gs);
  float mean[ITEMS], rstd[ITEMS];
  chunk_partials([](float x, int) { return x; });
  t.sync();
  chunk_combine<G>(per_group, [count](float s) { return s / count; });
  t.sync();
  chunk_group_values(gs, per_group, mean);
  t.sync();
  chunk_partials([&mean](float x, int i) { return (x - mean[i]) * (x - mean[i]); });
  t.sync();
  chunk_combine<G>(per_group, [count, eps](float s) { return fx_rsqrt(s / count + eps); });
  t.sync();
  chunk_group_values(gs, per_group, rstd);
  t.sync();
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) group_stats<U>(mean[i], rstd[i]);
  normalise_by_chunk<U, W, B>([&](int i, float& sh, float& sc) {
    sh = mean[i];
    sc = rstd[i];
  });
}

FX_ROW_TEMPLATE
template <class F>
FX_DEVICE void FX_ROW::chunk_partials(F f) {
  if (!active) return;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c0 = col(i, 0);
    if (c0 < a.n) {
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += f(v[i][e], i);
      scratch[c0 / VEC] = s;
    }
  }
}

FX_ROW_TEMPLATE
template <int G, class F>
FX_DEVICE void FX_ROW::chunk_combine(int per_group, F finish) {
  if (!active) return;
  for (int g = lt; g < G; g += a.rt) {
    float s = 0.0f;
    for (int k = 0; k < per_group; ++k) s += scratch[g * per_group + k];
    scratch[g * per_group] = finish(s);
  }
}

// out[i] = the value chunk_combine left for chunk i's group; chunks past the end use the last
// chunk's group (n % VEC == 0 here), as map() clamps columns
FX_ROW_TEMPLATE
FX_DEVICE void FX_ROW::chunk_group_values(int gs, int per_group, float (&out)[ITEMS]) const {
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    const int c0 = col(i, 0) < a.n ? col(i, 0) : a.n - VEC;
    out[i] = scratch[(c0 / gs) * per_group];
  }
}

FX_ROW_TEMPLATE
template <typename U, int G, int W, int B>
FX_DEVICE void FX_ROW::group_norm_staged(float eps, int gs) {
  if (active) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        if (col(i, e) < a.n) scratch[col(i, e)] = v[i][e];
  }
  t.sync();
  if (active) {
    const float count = static_cast<float>(gs);
    for (int g = lt; g < G; g += a.rt) {
      float* x = scratch + g * gs;
      float s = 0.0f;
      for (int k = 0; k < gs; ++k) s += x[k];
      float mean = s / count;
      float ss = 0.0f;
      for (int k = 0; k < gs; ++k) ss += (x[k] - mean) * (x[k] - mean);
      float rstd = fx_rsqrt(ss / count + eps);
      group_stats<U>(mean, rstd);
      for (int k = 0; k < gs; ++k) x[k] = (x[k] - mean) * rstd;
    }
  }
  t.sync();
  map([this](float, int c) { return scratch[c]; });
  t.sync();
  normalise_by_chunk<U, W, B>([](int, float& sh, float& sc) {
    sh = 0.0f;
    sc = 1.0f;
  });
}

// BatchNorm with running statistics: (x - rm) / sqrt(rv + eps) * w + b
FX_ROW_TEMPLATE
template <typename U, int W, int B, int RM, int RV>
FX_DEVICE void FX_ROW::batch_norm_eval(float eps) {
  normalise<U, W, B>([this, eps](int i, auto& shift, auto& scale) {
    running_shift_scale<RM, RV>(i, eps, shift, scale);
  });
}

// An eval BatchNorm's shift and scale at chunk i: the running mean and 1 / sqrt(rv + eps)
// (the forward's, and the backward's: row_grad.cuh's norm_dv)
FX_ROW_TEMPLATE
template <int RM, int RV>
FX_DEVICE void FX_ROW::running_shift_scale(int i, float eps, float (&shift)[VEC], float (&scale)[VEC]) const {
  float rv[VEC];
  col_chunk<RM>(i, shift);
  col_chunk<RV>(i, rv);
#pragma unroll
  for (int e = 0; e < VEC; ++e) scale[e] = 1.0f / sqrtf(rv[e] + eps);
}

// BatchNorm with the batch statistics of the combine kernel: (x - mean) * scale + bias, the
// weight folded into the scale there (eager: (x - mean) * rstd * w + b, contracted)
FX_ROW_TEMPLATE
template <typename U, int W, int B>
FX_DEVICE void FX_ROW::batch_norm_train() {
  static_assert(W == Prog::kBatchWeight && B == Prog::kBatchBias, "the combine folds this stage's weight and bias");
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    float m[VEC], s[VEC], b[VEC];
    chunk_of(a.bn_mean, FX_F32, i, m);
    chunk_of(a.bn_scale, FX_F32, i, s);
    if constexpr (B >= 0) chunk_of(a.bn_bias, FX_F32, i, b);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float y = B >= 0 ? fx_fma(v[i][e] - m[e], s[e], b[e]) : (v[i][e] - m[e]) * s[e];
      v[i][e] = round_to<U>(y);
    }
  }
}

}  // namespace fx
