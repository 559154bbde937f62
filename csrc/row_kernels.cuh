// The kernel bodies, shared by the CUDA kernels and the host emulator: walking a block's rows,
// the apply pass, the statistics pass and the BatchNorm column moments and their combine.
#pragma once

#include "column_moments.cuh"
#include "row_core.cuh"

namespace fx {

// ---------------------------------------------------------------------------------------------
// Kernel bodies (shared by the CUDA kernels and the emulator)

// Walks this block's units (one segment of rpc consecutive rows, lane lr taking row lr: plans
// with segments have one row a block, others one segment a row); `f(row)` sees every slot,
// active or not.
template <class Prog, typename T, int ITEMS, bool ALIGNED, bool PARAMS_T, class F>
FX_DEVICE void for_each_row(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red, F f) {
  using R = Row<Prog, T, ITEMS, ALIGNED, PARAMS_T>;
  const int lt = t.tid() % a.rt;
  const int lr = t.tid() / a.rt;
  float* scratch = dyn + static_cast<int64_t>(lr) * a.scratch_stride;
  const int64_t units = (a.m + a.rpc - 1) / a.rpc * a.segs;
  for (int64_t unit = t.bid(); unit < units; unit += t.gdim()) {
    const int64_t group = unit / a.segs;
    R r(a, t, red, scratch, lt, lr, group * a.rpc + lr, static_cast<int>(unit - group * a.segs));
    r.load();
    f(r);
  }
}

template <class Prog, typename T, int ITEMS, bool ALIGNED, bool PARAMS_T>
FX_DEVICE void apply_body(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red) {
  for_each_row<Prog, T, ITEMS, ALIGNED, PARAMS_T>(a, t, dyn, red, [](Row<Prog, T, ITEMS, ALIGNED, PARAMS_T>& r) {
    Prog::prefix(r);
    Prog::rest(r);
  });
}

// Column moments (count, mean, M2) of the values entering the BatchNorm stage (rounded to T like
// the normalisation's input), per strip of rows. The grid is
// segs x chunks blocks, block (q, s) walking segment s of strip q's rows, its lane l taking the
// strip's rows l, l + rpc, l + 2 rpc, ...; the lanes' moments then merge by a fixed tree (lane
// pairs, then pairs of pairs: every lane busy, the result deterministic). A row-local program's
// segments are a warp wide (Launcher::stats_plan): a short, wide output (1024 x 8192) still
// spreads over the whole device, and the partials stay a few rows of the output, not its size.
// Shared memory: rpc * scratch_stride floats during the walk, rpc * rt * ITEMS * VEC after.
template <class Prog, typename T, int ITEMS, bool ALIGNED>
FX_DEVICE void stats_body(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red) {
  using R = Row<Prog, T, ITEMS, ALIGNED>;
  constexpr int VEC = chunk_elements<Prog, T>();
  const int lt = t.tid() % a.rt;
  const int lr = t.tid() / a.rt;
  const int seg = static_cast<int>(t.bid() % a.segs);
  const int64_t strip = t.bid() / a.segs;
  const int64_t strip_rows = stats_strip_rows(a.m, a.chunks);
  const int64_t first = strip * strip_rows;
  const int64_t rows = rows_of_strip(a.m, strip_rows, strip);
  const int64_t steps = (rows + a.rpc - 1) / a.rpc;  // block-uniform: every lane reaches every barrier
  if (steps == 0) return;
  // lane lr's k-th row (past the strip's rows: row m, inactive)
  const auto row_at = [&](int64_t k) {
    const int64_t j = lr + k * a.rpc;
    return j < rows ? first + j : a.m;
  };
  // rows of lanes [lo, hi) of the strip
  const auto lane_rows = [&](int lo, int hi) {
    int64_t c = 0;
    for (int l = lo; l < hi && l < rows; ++l) c += (rows - 1 - l) / a.rpc + 1;
    return c;
  };
  float* scratch = dyn + static_cast<int64_t>(lr) * a.scratch_stride;
  // sums of x - shift and of its square, shift a column's first value in the lane's rows (0 where
  // that is not finite): three instructions a value where Welford's update takes a division a row
  // and twice the arithmetic, and as exact where the shift is near the mean (a value of the
  // column is); turned into Welford's (mean, m2) for the merges
  float shift[ITEMS][VEC], s1[ITEMS][VEC], s2[ITEMS][VEC];
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) shift[i][e] = s1[i][e] = s2[i][e] = 0.0f;
  int64_t count = 0;
  const auto add = [&](R& r) {
    Prog::prefix(r);  // ends with the BatchNorm's input, as batch_norm_train() sees it
    if (!r.active) return;
    if (count++ == 0) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) shift[i][e] = isfinite(r.v[i][e]) ? r.v[i][e] : 0.0f;
    }
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float d = r.v[i][e] - shift[i][e];
        s1[i][e] += d;
        s2[i][e] = fx_fma(d, d, s2[i][e]);
      }
  };
  if constexpr (ITEMS * VEC <= 8) {  // two rows in flight a lane (16 bytes each), not one
    for (int64_t k = 0; k < steps; k += 2) {
      R r0(a, t, red, scratch, lt, lr, row_at(k), seg), r1(a, t, red, scratch, lt, lr, row_at(k + 1), seg);
      r0.load();
      r1.load();
      add(r0);
      add(r1);
    }
  } else {
    for (int64_t k = 0; k < steps; ++k) {
      R r(a, t, red, scratch, lt, lr, row_at(k), seg);
      r.load();
      add(r);
    }
  }
  float mean[ITEMS][VEC], m2[ITEMS][VEC];
  const float inv = count > 0 ? 1.0f / static_cast<float>(count) : 0.0f;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float m = s1[i][e] * inv;
      const float q = s2[i][e] - s1[i][e] * m;  // NaN stays NaN: no fmaxf
      mean[i][e] = shift[i][e] + m;
      m2[i][e] = q < 0.0f ? 0.0f : q;
    }
  const int width = a.rt * ITEMS * VEC;  // a segment's columns
  for (int span = 1; span < a.rpc; span *= 2) {  // lane lr += lane lr + span, for lr a multiple of 2 span
    t.sync();  // the walk's scratch, or the last step's slots, are free
    const int slot = lr / (2 * span);
    if (lr % (2 * span) == span) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const int j = (i * a.rt + lt) * VEC + e;
          dyn[(2 * slot) * width + j] = mean[i][e];
          dyn[(2 * slot + 1) * width + j] = m2[i][e];
        }
    }
    t.sync();
    if (lr % (2 * span) == 0) {
      const int64_t other = lane_rows(lr + span, lr + 2 * span);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const int j = (i * a.rt + lt) * VEC + e;
          Moments acc{count, mean[i][e], m2[i][e]};
          merge(acc, other, dyn[(2 * slot) * width + j], dyn[(2 * slot + 1) * width + j]);
          mean[i][e] = acc.mean;
          m2[i][e] = acc.m2;
        }
      count += other;
    }
  }
  if (lr != 0) return;
  const int64_t col0 = static_cast<int64_t>(seg) * width;
#pragma unroll
  for (int i = 0; i < ITEMS; ++i)
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int64_t c = col0 + (i * a.rt + lt) * VEC + e;
      if (c < a.n) {
        a.part_mean[strip * a.n + c] = mean[i][e];
        a.part_m2[strip * a.n + c] = m2[i][e];
      }
    }
}

// Per column: the strips' moments merged (combine_strips); write the (2, n) stats output and what
// the row kernel normalises with (write_column_statistics: the weight and bias as float32, two
// loads of a runtime dtype a chunk fewer in the apply pass). Shared memory: block Moments.
template <class Prog>
FX_DEVICE void combine_body(const Args<Prog::kParamSlots>& a, const Thread& t, Moments* parts) {
  Moments total;
  const int64_t c = combine_strips(a.part_mean, a.part_m2, a.m, a.n, a.chunks, stats_strip_rows(a.m, a.chunks), t,
                                   parts, total);
  if (c < 0) return;
  float weight = 1.0f, bias = 0.0f;
  constexpr int W = Prog::kBatchWeight, B = Prog::kBatchBias;
  if constexpr (W >= 0) weight = load_param(a.pptr[W], a.pdtype[W], c);
  if constexpr (B >= 0) bias = load_param(a.pptr[B], a.pdtype[B], c);
  write_column_statistics(total, c, a.m, a.n, Prog::kBatchEps, weight, bias, a.stats, a.bn_mean, a.bn_scale, a.bn_bias);
}

}  // namespace fx
