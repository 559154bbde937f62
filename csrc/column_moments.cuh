// A training BatchNorm's column statistics from per-strip partials, for both GPU back ends: the
// row kernels' statistics pass (row_kernels.cuh) and the in-GEMM epilogue (gemm_batch_norm.cuh)
// write the moments of each strip of consecutive rows per column; the combine here merges a
// column's strips in order (deterministic: the grouping depends only on the strip count).
#pragma once

#include "fx_port.cuh"

namespace fx {

// Column moments of a set of rows: count, mean, sum of squared deviations.
struct Moments {
  int64_t n;
  float mean;
  float m2;
};

// acc += (nb, mb, m2b) (Chan et al.); order-dependent, so callers merge in a fixed order
FX_DEVICE void merge(Moments& acc, int64_t nb, float mb, float m2b) {
  if (nb == 0) return;
  if (acc.n == 0) {
    acc = Moments{nb, mb, m2b};
    return;
  }
  const int64_t total = acc.n + nb;
  const float wb = static_cast<float>(nb) / static_cast<float>(total);
  const float d = mb - acc.mean;
  acc.mean += d * wb;
  acc.m2 += m2b + d * d * (static_cast<float>(acc.n) * wb);
  acc.n = total;
}

// 1 / the standard deviation of `count` values of sum of squared deviations m2: what a deviation
// is multiplied by to store it standardized (0 where they are all equal: their deviations are 0)
FX_DEVICE float standardizer(float m2, float count) { return m2 > 0.f ? fx_rsqrt(m2 / count) : 0.f; }

// Rows of strip q of `strip_rows` consecutive rows each (the last ones shorter, or empty)
FX_HOST_DEVICE int64_t rows_of_strip(int64_t m, int64_t strip_rows, int64_t q) {
  const int64_t first = q * strip_rows;
  return first >= m ? 0 : (m - first < strip_rows ? m - first : strip_rows);
}

// The statistics pass's strip length for `strips` strips of m rows
FX_HOST_DEVICE int64_t stats_strip_rows(int64_t m, int64_t strips) { return (m + strips - 1) / strips; }

constexpr int kCombineColumns = 32;  // a block: 32 columns x (block / 32) ranges of strips
constexpr int kCombineBlock = 512;
constexpr int kCombineStrips = 8;  // strips a thread merges at most (then ranges: more threads a column)

// The combine kernel's threads a block: a range of up to kCombineStrips strips a thread, so that
// a few strips (a short output) are one thread's loads in flight and one merge chain, and many
// (a tall, narrow one) still split over up to 16 threads a column
FX_HOST_DEVICE int combine_block(int64_t strips) {
  const int64_t parts = (strips + kCombineStrips - 1) / kCombineStrips;
  return kCombineColumns * static_cast<int>(parts < kCombineBlock / kCombineColumns ? parts : kCombineBlock / kCombineColumns);
}

// The moments of column bid * 32 + (tid % 32) over all m rows, from the strips' partials
// part_mean / part_m2 ([strips][n]): the block's block / 32 threads of a column merge fixed
// consecutive ranges of strips, then the ranges merge in order. Shared memory: block Moments.
// Returns the column whose total `total` holds, or -1 for the threads that hold none.
FX_DEVICE int64_t combine_strips(const float* part_mean, const float* part_m2, int64_t m, int64_t n, int64_t strips,
                                 int64_t strip_rows, const Thread& t, Moments* parts, Moments& total) {
  const int lane = t.tid() % kCombineColumns;
  const int part = t.tid() / kCombineColumns;
  const int nparts = t.bdim() / kCombineColumns;
  const int64_t c = static_cast<int64_t>(t.bid()) * kCombineColumns + lane;
  const int64_t per = (strips + nparts - 1) / nparts;
  const int64_t k0 = part * per;
  const int64_t k1 = k0 + per < strips ? k0 + per : strips;
  Moments acc{0, 0.0f, 0.0f};
  if (c < n) {
    constexpr int kDepth = kCombineStrips;  // loads in flight a thread: the merges wait on memory otherwise
    for (int64_t k = k0; k < k1; k += kDepth) {
      float mb[kDepth], m2b[kDepth];
#pragma unroll
      for (int j = 0; j < kDepth; ++j) {
        mb[j] = k + j < k1 ? part_mean[(k + j) * n + c] : 0.0f;
        m2b[j] = k + j < k1 ? part_m2[(k + j) * n + c] : 0.0f;
      }
#pragma unroll
      for (int j = 0; j < kDepth; ++j)
        if (k + j < k1) merge(acc, rows_of_strip(m, strip_rows, k + j), mb[j], m2b[j]);
    }
  }
  parts[t.tid()] = acc;
  t.sync();
  if (part != 0 || c >= n) return -1;
  total = Moments{0, 0.0f, 0.0f};
  for (int p = 0; p < nparts; ++p) {
    const Moments& q = parts[p * kCombineColumns + lane];
    merge(total, q.n, q.mean, q.m2);
  }
  return c;
}

// What a column's merged moments give the op and the normalizing pass, in both back ends: the
// (2, n) batch statistics [mean, unbiased variance] the op returns for the running statistics, and
// the column's mean, scale = weight / sqrt(biased variance + eps) and bias (1 and 0 without them)
FX_DEVICE void write_column_statistics(const Moments& total, int64_t c, int64_t m, int64_t n, float eps,
                                       float weight, float bias, float* stats, float* mean, float* scale,
                                       float* bias_out) {
  stats[c] = total.mean;
  stats[n + c] = total.m2 / static_cast<float>(m - 1);
  mean[c] = total.mean;
  scale[c] = 1.0f / sqrtf(total.m2 / static_cast<float>(m) + eps) * weight;
  bias_out[c] = bias;
}

}  // namespace fx
