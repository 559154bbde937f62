// The backward kernel of a row program: pre | middle | post, pre and post pointwise and the
// middle a group, layer or RMS norm (kNormGrad) or a row reduction or row map (kReduceGrad: sum,
// mean, max, min, logsumexp -- one value a row, post a scalar function of it -- softmax,
// log_softmax) (fxfuse/cuda/codegen.py, row_split); a BatchNorm in eval mode is a norm whose
// statistics are per column (its running statistics). One pass over the saved GEMM output y and the
// output's gradient g, in the forward's row layout (Row, the apply kernel's plan): a thread
// recomputes its chunks of the row -- pre's values v, the middle's statistics by the forward's own
// code (the same bits), its output z -- then, with the gradients in float32:
//
//   gz = post'(z) g                                        (Prog::grad_post)
//   dv = the middle's backward of gz, rounded to U         (norm_dv, reduction_dv, row_map_dv)
//   dy = pre'(y) dv, rounded once to T at the store         (Prog::grad_pre)
//
// A norm computes for U (T, or float where the chain widened before it) and returns U, as eager's;
// its backward takes and returns U gradients, so gz and dv are rounded to U. A reduction or row map
// computes in float32 and rounds only where the program's expressions round (the reference's). The statistics the backward needs (the norm's means of gw and gw xhat, softmax's
// sum of gz z, ...) are row sums (shuffles, or Row::allreduce). The column sums the rest of the
// backward needs -- of dy (the bias), of the norm's weight and bias gradients and of each pre/post
// parameter's gradient -- stay in registers: a block takes one segment of the row and a strip of
// rows, and writes its sums to partial[s][chunk][column] (chunk: the block's strip and row slot);
// grad_sums_kernel adds the chunks in order. Deterministic, no atomics.
#pragma once

namespace fx {

enum GradKind : int { kNoGrad = 0, kPointwiseGrad = 1, kNormGrad = 2, kReduceGrad = 3 };
enum NormCode : int { kGroupNorm = 0, kLayerNorm = 1, kRmsNorm = 2, kBatchEvalNorm = 3 };
// the reductions (one value a row) up to kStd, then the row maps
enum ReduceCode : int {
  kSum = 0, kMean = 1, kMax = 2, kMin = 3, kLogSumExp = 4, kVectorNorm = 5, kVar = 6, kStd = 7, kSoftmax = 8,
  kLogSoftmax = 9, kNormalize = 10
};

// Whether the program's backward is this file's row kernel (a norm or a reduction in the middle)
template <class Prog>
constexpr bool has_row_grad() { return Prog::kGradKind == kNormGrad || Prog::kGradKind == kReduceGrad; }

// Program parameters of MASK at chunk i's VEC columns (a scalar in every slot)
template <class Prog, uint32_t MASK, class R>
FX_DEVICE void chunk_params(const R& r, int i, float (&p)[Prog::kParamSlots][R::VEC]) {
#pragma unroll
  for (int k = 0; k < Prog::kNumParams; ++k) {
    if (!(MASK & (1u << k))) continue;
    if (Prog::kColParams & (1u << k)) {
      r.chunk_of(r.a.pptr[k], r.a.pdtype[k], i, p[k]);
    } else {
      const float s = load_param(r.a.pptr[k], r.a.pdtype[k], 0);
#pragma unroll
      for (int e = 0; e < R::VEC; ++e) p[k][e] = s;
    }
  }
}

template <class Prog, int VEC>
FX_DEVICE void slot_params(const float (&p)[Prog::kParamSlots][VEC], int e, float (&out)[Prog::kParamSlots]) {
#pragma unroll
  for (int k = 0; k < Prog::kParamSlots; ++k) out[k] = p[k][e];
}

// gz = post'(z) g at one element (the identity without post), its parameters' gradients added to
// their column sums (where `valid`); z is the middle's output as eager's post reads it
template <class Prog, int S, int ITEMS, int VEC>
FX_DEVICE float through_post(float z, float g, const float (&pe)[Prog::kParamSlots], bool valid,
                             float (&sums)[S][ITEMS][VEC], int i, int e) {
  if constexpr (!Prog::kHasPost) {
    return g;
  } else {
    float dp[Prog::kParamSlots], gz;
#pragma unroll
    for (int k = 0; k < Prog::kParamSlots; ++k) dp[k] = 0.0f;
    Prog::grad_post(z, g, pe, gz, dp);
    if (valid)
#pragma unroll
      for (int k = 0; k < Prog::kNumParams; ++k)
        if (Prog::kPostParams & (1u << k)) sums[1 + k][i][e] += dp[k];
    return gz;
  }
}

// A norm's backward: g (the output's gradient) becomes dv, the gradient of the norm's input v
// (r.v, pre's values); the norm's weight and bias gradients go to their column sums.
//   gw = gz w,  xhat = (v - mean) rstd,  dv = rstd (gw - mean(gw) - xhat mean(gw xhat))
// the means over the group (shuffles) or the row; an RMS norm has no mean(gw) term. A BatchNorm in
// eval mode takes mean and rstd per column from its running statistics, constants of the
// backward: dv = rstd gw (eager's batch_norm backward with training=False).
template <class Prog, class R, int S, int ITEMS, int VEC>
FX_DEVICE void norm_dv(R& r, float (&g)[ITEMS][VEC], float (&sums)[S][ITEMS][VEC]) {
  using U = typename Prog::MidU;
  constexpr int W = Prog::kNormW;
  constexpr int B = Prog::kNormB;
  constexpr bool kColumnStats = Prog::kNormKind == kBatchEvalNorm;
  const int gs = Prog::kNormKind == kGroupNorm ? r.a.n / Prog::kNormGroups : r.a.n;
  const float inv_count = 1.0f / static_cast<float>(gs);

  float mean[ITEMS], rstd[ITEMS];  // a row norm's, the same for a chunk
  if constexpr (Prog::kNormKind == kGroupNorm) {
    r.template group_moments_by_lanes<U>(round_to<U>(Prog::kNormEps), gs, gs / VEC, mean, rstd);
  } else if constexpr (Prog::kNormKind == kLayerNorm) {
    float m, s;
    r.layer_moments(Prog::kNormEps, m, s);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      mean[i] = m;
      rstd[i] = s;
    }
  } else if constexpr (Prog::kNormKind == kRmsNorm) {
    const float s = r.rms_scale(Prog::kNormEps);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      mean[i] = 0.0f;
      rstd[i] = s;
    }
  }

  // through post and the norm's affine part; the two means' summands
  float s1[ITEMS], s2[ITEMS];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    float w[VEC], b[VEC], shift[VEC], scale[VEC], p[Prog::kParamSlots][VEC] = {};
    if constexpr (W >= 0) r.template col_chunk<W>(i, w);
    if constexpr (B >= 0) r.template col_chunk<B>(i, b);
    if constexpr (Prog::kHasPost) chunk_params<Prog, Prog::kPostParams>(r, i, p);
    if constexpr (kColumnStats) {
      r.template running_shift_scale<Prog::kNormRM, Prog::kNormRV>(i, Prog::kNormEps, shift, scale);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        shift[e] = mean[i];
        scale[e] = rstd[i];
      }
    }
    s1[i] = s2[i] = 0.0f;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const bool valid = r.active && r.col(i, e) < r.a.n;
      const float xhat = (r.v[i][e] - shift[e]) * scale[e];
      float gz = g[i][e];
      if constexpr (Prog::kHasPost) {
        float z = xhat;  // the forward's normalise()
        if constexpr (W >= 0 && B >= 0) {
          z = fx_fma(z, w[e], b[e]);
        } else if constexpr (W >= 0) {
          z = z * w[e];
        } else if constexpr (B >= 0) {
          z = z + b[e];
        }
        float pe[Prog::kParamSlots];
        slot_params<Prog>(p, e, pe);
        gz = round_to<U>(through_post<Prog>(round_to<U>(z), g[i][e], pe, valid, sums, i, e));
      }
      float gw = gz;
      if constexpr (W >= 0) gw = gz * w[e];
      if (valid) {
        if constexpr (W >= 0) sums[1 + W][i][e] += gz * xhat;
        if constexpr (B >= 0) sums[1 + B][i][e] += gz;
        s1[i] += gw;
        s2[i] += gw * xhat;
      }
      r.v[i][e] = xhat;
      g[i][e] = kColumnStats ? round_to<U>(gw * scale[e]) : gw;  // eager's norm returns U
    }
  }
  if constexpr (!kColumnStats) {  // the row norms' means
    if constexpr (Prog::kNormKind == kGroupNorm) {
      r.group_sums(s1, gs / VEC);
      r.group_sums(s2, gs / VEC);
    } else {
      float t1 = 0.0f, t2 = 0.0f;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        t1 += s1[i];
        t2 += s2[i];
      }
      t1 = r.allreduce(t1, OpAdd());
      t2 = r.allreduce(t2, OpAdd());
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        s1[i] = t1;
        s2[i] = t2;
      }
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const float m1 = Prog::kNormKind == kRmsNorm ? 0.0f : s1[i] * inv_count;
      const float m2 = s2[i] * inv_count;
#pragma unroll
      for (int e = 0; e < VEC; ++e) g[i][e] = round_to<U>(rstd[i] * (g[i][e] - m1 - r.v[i][e] * m2));  // eager's norm returns U
    }
  }
}

// A reduction's backward, eager's formulas (FunctionsManual.cpp): the row's constants here, each
// element's dv in reduction_dv. The reduction computes in float32 and its output is rounded only
// where post's expression rounds it (as the reference's), so nothing here rounds; post is a
// function of the row's one value s, its derivative rounds at post's rounding points as eager's
// (codegen: it runs once a row), and its parameters are scalars: their gradients go to column 0's
// sums of the row's first thread.
//   sum: gs    mean: gs / n    logsumexp: gs exp(v - s)
//   amax/amin ("split"): gs / count(v == s) where v == s    max/min(dim) ("first"): gs at the first
//   vector_norm: v (gs / s), v (gs * 0) where s is 0 (norm_backward's mask: 0, or NaN for an Inf/NaN gs)
//   var: 2 / (n - correction) gs (v - mean)    std: var's with gs / (2 s), 0 where s is 0 (std_backward)
struct ReductionRow {
  float s;      // the reduction's value
  float q;      // a selected element's gradient (sum, mean, max, min)
  float gs;     // the gradient of s
  float first;  // max/min(dim): the column that takes the gradient
  float mean;   // var, std: the row's mean
};

template <class Prog, class R, int S, int ITEMS, int VEC>
FX_DEVICE ReductionRow reduction_row(const R& r, float g_row, float (&sums)[S][ITEMS][VEC]) {
  constexpr int K = Prog::kReduceKind;
  float s = 0.0f;  // the forward's value (sum and mean need it only for post)
  float mean = 0.0f;  // var's and std's
  if constexpr (K == kSum) {
    if constexpr (Prog::kHasPost) s = r.reduce_sum();
  } else if constexpr (K == kMean) {
    if constexpr (Prog::kHasPost) s = r.reduce_mean();
  } else if constexpr (K == kMax) {
    s = r.reduce_max();
  } else if constexpr (K == kMin) {
    s = r.reduce_min();
  } else if constexpr (K == kVectorNorm) {
    s = r.reduce_vector_norm();
  } else if constexpr (K == kVar || K == kStd) {
    mean = r.reduce_mean();
    s = r.reduce_var_about(mean, Prog::kReduceAttribute);
    if constexpr (K == kStd) s = sqrtf(s);
  } else {
    s = r.reduce_logsumexp();
  }
  float pe[Prog::kParamSlots];
#pragma unroll
  for (int k = 0; k < Prog::kParamSlots; ++k)
    pe[k] = (Prog::kPostParams & (1u << k)) ? load_param(r.a.pptr[k], r.a.pdtype[k], 0) : 0.0f;
  ReductionRow row{s, 0.0f, 0.0f, 0.0f, mean};
  row.gs = through_post<Prog>(s, g_row, pe, r.active && r.lt == 0, sums, 0, 0);
  row.q = row.gs;
  if constexpr (K == kMean) {
    row.q = row.gs * (1.0f / static_cast<float>(r.a.n));  // grad / n: a * (1 / n) on CUDA
  } else if constexpr (K == kVectorNorm) {
    row.q = s == 0.0f ? row.gs * 0.0f : row.gs / s;  // eager's mask is a product: Inf, NaN stay NaN
  } else if constexpr (K == kVar || K == kStd) {
    const float g_var = K == kVar ? row.gs : (s == 0.0f ? 0.0f : row.gs / (s * 2.0f));
    row.q = 2.0f / (static_cast<float>(r.a.n) - Prog::kReduceAttribute) * g_var;
  } else if constexpr ((K == kMax || K == kMin) && !Prog::kTiesFirst) {
    // grad / count times the mask: no element equals a NaN, so gs / 0 times 0 makes the row's
    // gradient NaN, as eager's
    row.q = row.gs / r.reduce(0.0f, OpAdd(), [s](float x) { return x == s ? 1.0f : 0.0f; });
  } else if constexpr (K == kMax || K == kMin) {
    float first = INFINITY;  // the first element equal to s, or the first NaN
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float x = r.v[i][e];
        if (r.active && r.col(i, e) < r.a.n && (x == s || x != x)) first = fminf(first, static_cast<float>(r.col(i, e)));
      }
    row.first = r.allreduce(first, OpMin());
  }
  return row;
}

template <class Prog>
FX_DEVICE float reduction_dv(const ReductionRow& row, float x, int col) {
  constexpr int K = Prog::kReduceKind;
  if constexpr (K == kSum || K == kMean) {
    return row.q;
  } else if constexpr (K == kLogSumExp) {
    return row.gs * expf(x - row.s);
  } else if constexpr (K == kVectorNorm) {
    return x * row.q;
  } else if constexpr (K == kVar || K == kStd) {
    return row.q * (x - row.mean);
  } else if constexpr (!Prog::kTiesFirst) {
    return row.q * (x == row.s ? 1.0f : 0.0f);
  } else {
    return static_cast<float>(col) == row.first ? row.q : 0.0f;
  }
}

// A row map's output gradient through post: g becomes gz, the gradient of the map's output z =
// z_of(v) for each element v of r.v; returns the row's sum of term(gz, v) (every thread of the row).
template <class Prog, class R, int S, int ITEMS, int VEC, class Z, class Term>
FX_DEVICE float through_post_row(R& r, float (&g)[ITEMS][VEC], float (&sums)[S][ITEMS][VEC], Z z_of, Term term) {
  float part = 0.0f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i) {
    float p[Prog::kParamSlots][VEC] = {};
    if constexpr (Prog::kHasPost) chunk_params<Prog, Prog::kPostParams>(r, i, p);
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const bool valid = r.active && r.col(i, e) < r.a.n;
      float pe[Prog::kParamSlots];
      slot_params<Prog>(p, e, pe);
      const float v = r.v[i][e];
      const float gz = through_post<Prog>(z_of(v), g[i][e], pe, valid, sums, i, e);
      if (valid) part += term(gz, v);
      g[i][e] = gz;
    }
  }
  return r.allreduce(part, OpAdd());
}

// A row map's backward, in float32 as the reference's: g (the output's gradient) becomes dv, the
// gradient of v (r.v).
//   softmax: z (gz - sum(gz z))    log_softmax: gz - exp(z) sum(gz)    (eager's backward kernels)
//   normalize, autograd's through v / clamp_min(norm(v), eps): with n the norm and d = max(n, eps),
//   gz / d + v (c / n), c = -sum(gz v) / d^2 where n >= eps, else 0 (and c * 0 where n is 0, as
//   norm_backward masks it: by a product, so a NaN c — eps 0, a row of zeros — stays NaN)
template <class Prog, class R, int S, int ITEMS, int VEC>
FX_DEVICE void row_map_dv(R& r, float (&g)[ITEMS][VEC], float (&sums)[S][ITEMS][VEC]) {
  if constexpr (Prog::kReduceKind == kNormalize) {
    const float n = r.reduce_vector_norm();
    const float d = R::normalize_divisor(n, Prog::kReduceAttribute);
    const float total = through_post_row<Prog>(r, g, sums, [d](float v) { return v / d; },
                                               [](float gz, float v) { return gz * v; });
    const float c = n >= Prog::kReduceAttribute ? -total / (d * d) : 0.0f;  // clamp_min's gradient
    const float q = n == 0.0f ? c * 0.0f : c / n;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) g[i][e] = g[i][e] / d + r.v[i][e] * q;
  } else {
    constexpr bool kSoftmaxGrad = Prog::kReduceKind == kSoftmax;
    if constexpr (kSoftmaxGrad) {
      r.softmax();  // r.v holds z from here
    } else {
      r.log_softmax();
    }
    const float total = through_post_row<Prog>(r, g, sums, [](float z) { return z; },
                                               [](float gz, float z) { return kSoftmaxGrad ? gz * z : gz; });
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float z = r.v[i][e];
        g[i][e] = kSoftmaxGrad ? z * (g[i][e] - total) : g[i][e] - expf(z) * total;
      }
  }
}

template <class Prog, typename T, int ITEMS, bool ALIGNED>
FX_DEVICE void row_grad_body(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red) {
  using R = Row<Prog, T, ITEMS, ALIGNED>;
  using U = typename Prog::MidU;  // the norm's
  using Out = typename Prog::Out;
  constexpr int VEC = R::VEC;
  constexpr int OUT_VEC = DType<Out>::kVec < VEC ? DType<Out>::kVec : VEC;
  constexpr int P = Prog::kNumParams;
  constexpr int S = 1 + P;
  constexpr int kSlots = Prog::kParamSlots;
  constexpr bool kNorm = Prog::kGradKind == kNormGrad;
  constexpr bool kReduction = !kNorm && Prog::kReduceKind <= kStd;  // one output value a row
  const int lt = t.tid() % a.rt;
  const int lr = t.tid() / a.rt;
  float* scratch = dyn + static_cast<int64_t>(lr) * a.scratch_stride;
  const int seg = t.bid() % a.segs;
  const int64_t strip = t.bid() / a.segs;
  const int64_t strips = t.gdim() / a.segs;

  float sums[S][ITEMS][VEC];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) sums[s][i][e] = 0.0f;

  for (int64_t r0 = strip * a.rpc; r0 < a.m; r0 += strips * a.rpc) {  // block-uniform
    R r(a, t, red, scratch, lt, lr, r0 + lr, seg);
    r.load();
    const int64_t base = r.row * a.n;

    // the output's gradient, loaded with y (both in flight at once): a reduction's one value, or
    // the row (then dv, then dy)
    float g[kReduction ? 1 : ITEMS][VEC];
    float g_row = 0.0f;
    if constexpr (kReduction) {
      if (r.active) g_row = Mem<Out>::load(a.g, r.row);
    } else {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        const int c0 = r.col(i, 0);
        if constexpr (ALIGNED) {
          if (r.active && c0 < a.n) {
#pragma unroll
            for (int k = 0; k < VEC; k += OUT_VEC) Mem<Out>::load_vec(a.g, base + c0 + k, g[i] + k);
          } else {
#pragma unroll
            for (int e = 0; e < VEC; ++e) g[i][e] = 0.0f;
          }
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e)
            g[i][e] = (r.active && c0 + e < a.n) ? Mem<Out>::load(a.g, base + c0 + e) : 0.0f;
        }
      }
    }

    // pre's values, as the middle stage takes them (a norm's input rounded to U, as the forward's)
    if constexpr (Prog::kHasPre) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        float p[kSlots][VEC] = {};
        chunk_params<Prog, Prog::kPreParams>(r, i, p);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float pe[kSlots];
          slot_params<Prog>(p, e, pe);
          const float v = Prog::pre(r.v[i][e], pe);
          r.v[i][e] = kNorm ? round_to<U>(v) : v;
        }
      }
    }

    ReductionRow row{};
    if constexpr (kNorm) {
      norm_dv<Prog>(r, g, sums);
    } else if constexpr (kReduction) {
      row = reduction_row<Prog>(r, g_row, sums);
    } else {
      row_map_dv<Prog>(r, g, sums);
    }

    // through pre (y read again: it is in cache, and registers are not spent on it); the store
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float p[kSlots][VEC] = {};
      float y[VEC], d[VEC];
      if constexpr (Prog::kHasPre) {
        chunk_params<Prog, Prog::kPreParams>(r, i, p);
        r.load_chunk(i, y);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const bool valid = r.active && r.col(i, e) < a.n;
        float dv;
        if constexpr (kReduction) {
          dv = reduction_dv<Prog>(row, r.v[i][e], r.col(i, e));
        } else {
          dv = g[i][e];
        }
        float dx = dv;
        if constexpr (Prog::kHasPre) {
          float pe[kSlots], dp[kSlots];
          slot_params<Prog>(p, e, pe);
#pragma unroll
          for (int k = 0; k < kSlots; ++k) dp[k] = 0.0f;
          Prog::grad_pre(y[e], dv, pe, dx, dp);
          if (valid)
#pragma unroll
            for (int k = 0; k < P; ++k)
              if (Prog::kPreParams & (1u << k)) sums[1 + k][i][e] += dp[k];
        }
        d[e] = round_to<T>(dx);  // the stored gradient is what eager sums for the bias
        if (valid) sums[0][i][e] += d[e];
      }
      if (!r.active) continue;
      const int c0 = r.col(i, 0);
      if constexpr (ALIGNED) {
        if (c0 < a.n) Mem<T>::template store_chunk_rounded<VEC>(a.dy, base + c0, d);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (c0 + e < a.n) Mem<T>::store_rounded(a.dy, base + c0 + e, d[e]);
      }
    }
  }

  // this slot's column sums: chunk (strip, row slot) of partial, 16 bytes a store where the row
  // is (a store a float puts a warp's 32 values 32 bytes apart: eight times the L2 traffic)
  const R r(a, t, red, scratch, lt, lr, 0, seg);  // row 0 of the segment: its columns
  const int64_t chunk = strip * a.rpc + lr;
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = r.col(i, 0);
      float* out = a.partial + (s * a.chunks + chunk) * a.n;
      if constexpr (ALIGNED) {
        if (c0 < a.n)
#pragma unroll
          for (int k = 0; k < VEC; k += 4) Mem<float>::store_vec(out, c0 + k, sums[s][i] + k);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (c0 + e < a.n) out[c0 + e] = sums[s][i][e];
      }
    }
}

#if !defined(FX_EMULATE)
// One 16-byte chunk a thread: blocks of at most 256 threads (the plans), three an SM (80
// registers a thread, where the whole state would take 128 and allow two)
template <int ITEMS>
constexpr int row_grad_min_blocks() { return ITEMS == 1 ? 3 : 1; }

template <class Prog, typename T, int ITEMS, bool ALIGNED>
__global__ void __launch_bounds__(ITEMS == 1 ? 256 : kMaxBlock, row_grad_min_blocks<ITEMS>()) row_grad_kernel(const __grid_constant__ Args<Prog::kParamSlots> a) {
  __shared__ float red[FX_RED_FLOATS];
  const Thread t;
  row_grad_body<Prog, T, ITEMS, ALIGNED>(a, t, fx_dynamic_smem, red);
}
#endif

}  // namespace fx
