// The pass that finishes a norm or softmax over the row from per (row, subtile) partials: the
// in-GEMM back end's fxg::RowStatistics writes the partials and the map's input in the GEMM's
// epilogue (gemm_row_statistics.cuh, which also says what each map keeps and stores), and
// normalize_rows_body merges a row's partials and maps the row in place. Written against fx::Thread
// (fx_port.cuh), so that the host emulator runs the very same body in the CPU tests
// (tests/gpu/test_row_statistics_cpu.py).
#pragma once

#include "column_moments.cuh"
#include "epilogue_ops.cuh"
#include "fx_port.cuh"

namespace fx {

// The row maps (the generated Prog::kRowStatistic; -1: none). F.normalize: x / max(||x||, eps).
enum RowStatistic : int { kRowLayerNorm = 0, kRowRmsNorm = 1, kRowSoftmax = 2, kRowLogSoftmax = 3, kRowNormalize = 4 };

// The maps that scale the row by a function of its sum of squares: their subtiles keep that sum
// and store the values themselves (gemm_row_statistics.cuh says why)
template <int Kind> constexpr bool kScalesBySquares = Kind == kRowRmsNorm || Kind == kRowNormalize;

// The partials: [parts][M][subtiles] (a LayerNorm's means, then M2s; a softmax's maxima, then sums
// of exponentials; an RMSNorm's or normalize's sums of squares)
template <int Kind> constexpr int kRowParts = kScalesBySquares<Kind> ? 1 : 2;
template <int EpiN> FX_HOST_DEVICE int64_t row_subtiles(int64_t n) { return (n + EpiN - 1) / EpiN; }
template <int EpiN, int Kind> FX_HOST_DEVICE int64_t row_statistics_floats(int64_t m, int64_t n) {
  return kRowParts<Kind> * m * row_subtiles<EpiN>(n);
}

// What a sum of exponentials is taken relative to: its max, or 0 where that is not finite (as
// torch.logsumexp shifts)
FX_HOST_DEVICE float exp_sum_shift(float max) { return isfinite(max) ? max : 0.f; }

// (max, sum of exp(x - exp_sum_shift(max))) += (mb, sb): a sum of 0 (no values, or all -inf)
// adds nothing, also where its rescaling would overflow; NaN propagates. Merges in any grouping.
// Both rescalings are computed, then selected: branched around, each merge of an epilogue's
// shuffles became two branches of its own (epilogue_ops.cuh, fx_tanh_softplus).
FX_HOST_DEVICE void merge_exp_sums(float& max, float& sum, float mb, float sb) {
  const float merged = (max > mb || max != max) ? max : mb, ref = exp_sum_shift(merged);
  const float rescale_a = expf(exp_sum_shift(max) - ref), rescale_b = expf(exp_sum_shift(mb) - ref);
  sum = (sum == 0.f ? 0.f : sum * rescale_a) + (sb == 0.f ? 0.f : sb * rescale_b);
  max = merged;
}

// acc += (nb, mb, m2b), a partial of the map's kind (Moments holds a softmax's (max, sum) in
// (mean, m2), a sum of squares in mean); order-dependent for a LayerNorm (fx::merge), so callers
// merge in a fixed order
template <int Kind>
FX_DEVICE void merge_row_partial(Moments& acc, int64_t nb, float mb, float m2b) {
  if constexpr (kScalesBySquares<Kind>) {
    acc.mean += mb;
  } else if constexpr (Kind == kRowLayerNorm) {
    merge(acc, nb, mb, m2b);
  } else {
    merge_exp_sums(acc.mean, acc.m2, mb, m2b);
  }
}

constexpr int kRowNormThreads = 256;  // a block: a row
constexpr int kRowNormLoads = 4;      // 16-byte loads a thread has in flight
// The largest N the pass takes: its scales and shifts within 48 KiB of shared memory
constexpr int64_t kRowStatisticsMaxN = int64_t{1} << 18;

// Row t.bid() of out (M x N, row-major, holding the stored values D) in place. The row's
// statistics first: thread i merges the partials of subtiles i, i + 256, ... in order, then the
// threads' merge in a fixed tree (deterministic). Each subtile s then gets the scale a_s and shift
// b_s that take its stored values to the normalized ones, y = D a_s + b_s: a LayerNorm's
// rstd / standardizer_s and (mean_s - mean) rstd; a softmax's 1 and shift(max_s) - logsumexp (then
// exp(y); a log_softmax's y itself); an RMSNorm's rstd and 0, normalize's 1 / max(norm, eps) and
// 0, the same for all. Then the norm's
// weight and bias (Affine: 1 and 0 for a softmax) and the stages after the map (After), as Out.
// A softmax row whose max is not finite is NaN. N is a multiple of 16 bytes of Out. Shared memory:
// scale_shift [2][subtiles] (not read for a sum of squares), parts [kRowNormThreads].
template <class Affine, class After, class Out, class D, int Kind, int EpiN>
FX_DEVICE void normalize_rows_body(const Thread& t, Out* out, const float* partials, int64_t m, int64_t n, float eps,
                                   const typename After::Arguments& args, float* scale_shift, Moments* parts) {
  static_assert(sizeof(D) == sizeof(Out), "D is stored where the output goes");
  constexpr int kVec = 16 / static_cast<int>(sizeof(Out));
  static_assert(EpiN % kVec == 0, "a 16-byte access lies in one subtile");
  constexpr bool kSoftmax = Kind == kRowSoftmax || Kind == kRowLogSoftmax;
  const int tid = t.tid();
  const int64_t row = t.bid(), subtiles = row_subtiles<EpiN>(n);
  const float* first_parts = partials + row * subtiles;
  const float* second_parts = partials + (m + row) * subtiles;  // (none for a sum of squares)
  auto valid = [&](int64_t s) { return n - s * EpiN < EpiN ? n - s * EpiN : int64_t{EpiN}; };
  // a softmax's (max, sum) in Moments' (mean, m2); a sum of squares in its mean
  Moments acc{0, kSoftmax ? -INFINITY : 0.f, 0.f};
  for (int64_t s = tid; s < subtiles; s += kRowNormThreads) {
    merge_row_partial<Kind>(acc, valid(s), first_parts[s], kScalesBySquares<Kind> ? 0.f : second_parts[s]);
  }
  parts[tid] = acc;
  t.sync();
  for (int stride = kRowNormThreads / 2; stride > 0; stride /= 2) {
    if (tid < stride) {
      const Moments other = parts[tid + stride];
      merge_row_partial<Kind>(parts[tid], other.n, other.mean, other.m2);
    }
    t.sync();
  }
  const Moments total = parts[0];
  float scale = 1.f, center = 0.f;  // a norm's rstd and mean (0 for an RMSNorm); a softmax's logsumexp
  if constexpr (Kind == kRowRmsNorm) {
    scale = fx_rsqrt(total.mean / static_cast<float>(n) + eps);
  } else if constexpr (Kind == kRowNormalize) {
    const float norm = sqrtf(total.mean);
    scale = 1.f / (norm < eps ? eps : norm);  // clamp_min: NaN stays NaN
  } else if constexpr (Kind == kRowLayerNorm) {
    scale = fx_rsqrt(total.m2 / static_cast<float>(n) + eps);
    center = total.mean;
  } else {
    center = isfinite(total.mean) ? total.mean + logf(total.m2) : NAN;
  }
  if constexpr (!kScalesBySquares<Kind>) {
    for (int64_t s = tid; s < subtiles; s += kRowNormThreads) {
      if constexpr (Kind == kRowLayerNorm) {
        const float standardizer_s = standardizer(second_parts[s], static_cast<float>(valid(s)));
        scale_shift[s] = standardizer_s > 0.f ? scale / standardizer_s : 0.f;
        scale_shift[subtiles + s] = (first_parts[s] - center) * scale;
      } else {  // D = x - exp_sum_shift(max_s)
        scale_shift[s] = 1.f;
        scale_shift[subtiles + s] = exp_sum_shift(first_parts[s]) - center;
      }
    }
    t.sync();
  }
  const auto scalars = After::scalars(args);
  Out* line = out + row * n;
  constexpr int64_t kStride = static_cast<int64_t>(kRowNormThreads) * kVec;
  for (int64_t base = static_cast<int64_t>(tid) * kVec; base < n; base += kStride * kRowNormLoads) {
    uint4 chunk[kRowNormLoads];  // the loads in flight before the math
#pragma unroll
    for (int i = 0; i < kRowNormLoads; ++i) {
      if (base + i * kStride < n) chunk[i] = *reinterpret_cast<const uint4*>(line + base + i * kStride);
    }
#pragma unroll
    for (int i = 0; i < kRowNormLoads; ++i) {
      const int64_t col = base + i * kStride;
      if (col >= n) continue;
      const float a = kScalesBySquares<Kind> ? scale : scale_shift[col / EpiN];
      const float b = kScalesBySquares<Kind> ? 0.f : scale_shift[subtiles + col / EpiN];
      const D* stored = reinterpret_cast<const D*>(&chunk[i]);
      Out* values = reinterpret_cast<Out*>(&chunk[i]);
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        float y = static_cast<float>(stored[v]) * a + b;
        if constexpr (Kind == kRowSoftmax) y = fx_expf(y);
        y = y * Affine::weight(args, col + v) + Affine::bias(args, col + v);
        values[v] = static_cast<Out>(After::apply(args, scalars, col + v, y));
      }
      *reinterpret_cast<uint4*>(line + col) = chunk[i];
    }
  }
}

}  // namespace fx
