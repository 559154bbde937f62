// A training BatchNorm in the in-GEMM back end: fxg::ColumnMoments takes the column statistics of
// the norm's input in the GEMM's epilogue, per strip of 16 rows, and stores that input as its
// standardized deviation in the strip, (x - mean_strip) / std_strip; fxg::finalize_columns merges
// a column's strips into the batch statistics and folds them with the norm's weight into a scale
// per column; fxg::normalize_columns forms each strip's scale and shift from its mean and spread
// and runs the rest of the chain on D * scale + shift, in place. So the GEMM output is written once and
// read once, and no statistics pass reads it (the row path's three passes read it twice). See
// gemm_stages.cuh for the tree ColumnMoments is part of.
//
// Why standardized deviations, in float16 where the output is 16-bit: a bfloat16 D holds a value
// to 2^-9 of its magnitude, and normalising turns that into 2^-9 of |x - mean| / std, times the
// norm's weight: an error near one output ulp, which on top of the output's own rounding puts an
// element past eager's by more than the correctness rule's 1e-2 where eager's error happens to be
// small (measured: one element in 10^4 to 10^5 on the tests' draws). A standardized deviation is
// within +-sqrt(15) (16 rows), in float16's range at 2^-11 of its magnitude: a quarter of that
// error, below the output's rounding. The output buffer holds D (same width) until the
// normalizing pass overwrites it.
#pragma once

#include "column_moments.cuh"
#include "gemm_launch.cuh"
#include "gemm_stages.cuh"

namespace fxg {

// Rows of a strip: a warp's rows of a subtile (16, by the WGMMA layout)
constexpr int kMomentRows = 16;
CUTLASS_HOST_DEVICE int64_t moment_strips(int64_t m) { return (m + kMomentRows - 1) / kMomentRows; }

struct ColumnMomentsArguments {
  float* partials = nullptr;  // [2][moment_strips(m)][n] float32: the strips' means, then their M2
  int64_t m = 0;
  int64_t n = 0;
};

// The type D is stored in: float16 where the output is 16-bit (see above), else the output's
template <class Out>
using DeviationOf = cute::conditional_t<sizeof(Out) == 2, cutlass::half_t, Out>;

using fx::standardizer;  // (column_moments.cuh)

// Per (strip of 16 rows, column): the mean and the sum of squared deviations (M2) of the values its
// child computed (float32), for fxg::finalize_columns; the values go on to the store as their
// standardized deviations in the strip. By the WGMMA accumulator layout (fxg::SubtileCallbacks)
// lane 4g + q of a warp holds rows g and g + 8 of the warp's 16 and columns 2q, 2q + 1 of each
// 8-column block, so the lanes that share a column differ in g. A lane starts from its two rows'
// moments per column and the lanes merge them by Chan's formula in three halving steps (lanes 16,
// 8, 4 apart): each step a lane keeps half its columns and sends the other half to its partner, so
// a lane ends with the strip's moments of its own block's two columns (31 shuffles a subtile with
// the row counts', not the 96 of summing every column over the warp twice), and the warp writes 64
// adjacent columns a strip; three doubling steps (28 shuffles) then give every lane the strip's
// means and standardizers of its 16 columns. Rows past M count for nothing; a column holding an
// infinity or NaN gets a NaN mean or M2, as eager's statistics of it are not finite either.
template <int EpiN>
struct ColumnMoments : RegisterNode<ColumnMomentsArguments> {
  static constexpr int kPairs = EpiN / 4;  // a thread's columns of a subtile: two in each block
  static constexpr int kKept = kPairs / 8;  // its columns after the three halvings
  static_assert(EpiN % 32 == 0, "each of the 8 lanes of a column ends with whole column pairs");
  using RegisterNode::RegisterNode;  // (a base of no template parameter: its names need no using)

  template <class Coords>
  struct ConsumerStoreCallbacks : SubtileCallbacks<Coords, EpiN, Params> {
    using SubtileCallbacks<Coords, EpiN, Params>::SubtileCallbacks;

    // One halving step: the partner `mask` lanes away takes columns [0, Half) if this lane is the
    // upper one of the pair, else [Half, 2 Half); this lane merges the rest with the partner's
    // moments of them (the lower lane's rows first) into [0, Half).
    template <int Half>
    CUTLASS_DEVICE static void halve(float (&mean)[kPairs], float (&m2)[kPairs], float& count, int mask) {
      const bool upper = (threadIdx.x & mask) != 0;
      const float other = __shfl_xor_sync(0xffffffffu, count, mask);
      const float lower_n = upper ? other : count, upper_n = upper ? count : other;
      const float total = lower_n + upper_n;
      const float w = total > 0.f ? upper_n / total : 0.f;  // the upper rows' weight
      const float cross = lower_n * w;                     // lower_n * upper_n / total
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < Half; ++i) {
        const float got_mean = __shfl_xor_sync(0xffffffffu, upper ? mean[i] : mean[Half + i], mask);
        const float got_m2 = __shfl_xor_sync(0xffffffffu, upper ? m2[i] : m2[Half + i], mask);
        const float own_mean = upper ? mean[Half + i] : mean[i], own_m2 = upper ? m2[Half + i] : m2[i];
        const float lower_mean = upper ? got_mean : own_mean, upper_mean = upper ? own_mean : got_mean;
        const float d = upper_mean - lower_mean;
        mean[i] = lower_mean + d * w;
        m2[i] = own_m2 + got_m2 + d * d * cross;
      }
      count = total;
    }

    // One doubling step, a halving's inverse: [0, Have) of `values` becomes [0, 2 Have), the lower
    // lane's columns first
    template <int Have>
    CUTLASS_DEVICE static void gather(float (&values)[kPairs], int mask) {
      const bool upper = (threadIdx.x & mask) != 0;
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < Have; ++i) {
        const float own = values[i], got = __shfl_xor_sync(0xffffffffu, own, mask);
        values[i] = upper ? got : own;
        values[Have + i] = upper ? own : got;
      }
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor visit_results) {
      float value[2][EpiN / 8][2];  // (row slot, block, column of the pair)
      this->unpack(visit_results, value);
      const int lane = threadIdx.x % 32, g = lane / 4;
      const int64_t row = this->first_row + static_cast<int64_t>(epi_m) * this->epi_rows;  // the thread's first
      if (row % 8 != g || (row - g) % kMomentRows != 0 || this->col_in_tile % 8 != 2 * (lane % 4)) __trap();
      const bool first = row < this->params.m, second = row + 8 < this->params.m;
      float mean[kPairs], m2[kPairs];
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < kPairs; ++p) {  // column pair p: block p / 2, column p % 2
        const float a = value[0][p / 2][p % 2];
        const float d = second ? value[1][p / 2][p % 2] - a : 0.f;
        mean[p] = first ? a + 0.5f * d : 0.f;
        m2[p] = first ? 0.5f * d * d : 0.f;
      }
      float count = static_cast<float>(first) + static_cast<float>(second);
      halve<kPairs / 2>(mean, m2, count, 16);
      halve<kPairs / 4>(mean, m2, count, 8);
      halve<kPairs / 8>(mean, m2, count, 4);
      if (count == 0.f) return;  // the warp's rows are all past M (uniform over the warp), not stored
      const int64_t n = this->params.n, strip = (row - g) / kMomentRows;
      float* part_mean = this->params.partials + strip * n;
      float* part_m2 = this->params.partials + (moment_strips(this->params.m) + strip) * n;
      const int64_t base = this->first_col + static_cast<int64_t>(epi_n) * EpiN;  // the thread's column 0
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kKept; ++i) {
        const int p = g * kKept + i;  // the pair this lane kept, by the halvings' order
        const int64_t col = base + 8 * (p / 2) + p % 2;
        if (col < n) {
          part_mean[col] = mean[i];
          part_m2[col] = m2[i];
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kKept; ++i) m2[i] = standardizer(m2[i], count);  // (now what D is scaled by)
      gather<kKept>(mean, 4);
      gather<kKept>(m2, 4);
      gather<kKept * 2>(mean, 8);
      gather<kKept * 2>(m2, 8);
      gather<kKept * 4>(mean, 16);
      gather<kKept * 4>(m2, 16);
      CUTLASS_PRAGMA_UNROLL
      for (int p = 0; p < kPairs; ++p) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) value[r][p / 2][p % 2] = (value[r][p / 2][p % 2] - mean[p]) * m2[p];
      }
      this->pack(value, visit_results);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args, params);
  }
};

// Per column: the strips' moments merged in order (fx::combine_strips); writes the (2, n) batch
// statistics and the column's mean, scale s = weight / sqrt(biased variance + eps) and bias
// (fx::write_column_statistics; `columns`: [3][n]), from which fxg::normalize_columns forms each
// strip's scale and shift. Affine (generated):
// weight(args, c) and bias(args, c), 1 and 0 for a norm without them.
template <class Affine>
__global__ void __launch_bounds__(fx::kCombineBlock) finalize_columns(const float* partials, int64_t m, int64_t n,
                                                                      float eps, float* stats, float* columns,
                                                                      typename Affine::Arguments args) {
  __shared__ fx::Moments parts[fx::kCombineBlock];
  wait_for_prior_grid();
  const fx::Thread t;
  const int64_t strips = moment_strips(m);
  fx::Moments total;
  const int64_t c = fx::combine_strips(partials, partials + strips * n, m, n, strips, kMomentRows, t, parts, total);
  if (c < 0) return;
  fx::write_column_statistics(total, c, m, n, eps, Affine::weight(args, c), Affine::bias(args, c), stats, columns,
                              columns + n, columns + 2 * n);
}

// normalize_columns' block: 128 threads of VEC columns (16 bytes of Out) each, a thread taking the
// rows of one strip (its scale and shift formed once for 16 rows), kNormalizeRows rows' loads in
// flight at a time. At least 4 blocks an SM, so 128 registers a thread: 16 warps, and a 1024 x 8192
// output's 512 blocks in one wave. Loading all 16 rows first, unbounded, the compiler interleaved a
// heavy chain's math (S18's SiLU) over them in 255 registers (8 warps an SM, two waves: S18's pass
// took 19 us against S07's 10); 8 rows at a time still spilled under the bound, 4 do not.
constexpr int kNormalizeThreads = 128;
constexpr int kNormalizeBlocksPerSm = 4;
constexpr int kNormalizeRows = 4;

// out (M x N, row-major, holding the GEMM's D: DeviationOf<Out>) in place: the normalized value
// through the norm's weight and bias, D * scale + shift, with the strip's scale = s * std_strip and
// shift = (mean_strip - mean) * s + bias (partials: the strips' moments; columns: the column's mean,
// s and bias, fxg::finalize_columns), through After (the stages after the norm), as Out. N is a
// multiple of 16 bytes of Out (the GEMM's TMA store needs that too).
template <class After, class Out>
__global__ void __launch_bounds__(kNormalizeThreads, kNormalizeBlocksPerSm)
    normalize_columns(Out* out, const float* partials, const float* columns, int64_t m, int64_t n,
                      typename After::Arguments args) {
  using D = DeviationOf<Out>;
  static_assert(sizeof(D) == sizeof(Out), "D is stored where the output goes");
  constexpr int kVec = 16 / static_cast<int>(sizeof(Out));
  wait_for_prior_grid();
  const int64_t col = (static_cast<int64_t>(blockIdx.x) * kNormalizeThreads + threadIdx.x) * kVec;
  if (col >= n) return;
  const int64_t strips = moment_strips(m);
  const auto scalars = After::scalars(args);
  float column_mean[kVec], column_scale[kVec], column_bias[kVec];
  CUTLASS_PRAGMA_UNROLL
  for (int v = 0; v < kVec; ++v) {
    column_mean[v] = __ldg(columns + col + v);
    column_scale[v] = __ldg(columns + n + col + v);
    column_bias[v] = __ldg(columns + 2 * n + col + v);
  }
  for (int64_t strip = blockIdx.y; strip < strips; strip += gridDim.y) {
    const int64_t first = strip * kMomentRows;
    const float rows = static_cast<float>(fx::rows_of_strip(m, kMomentRows, strip));
    float a[kVec], b[kVec];  // the strip's scale and shift
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < kVec; ++v) {
      const float standardizer_q = standardizer(__ldg(partials + (strips + strip) * n + col + v), rows);
      a[v] = standardizer_q > 0.f ? column_scale[v] / standardizer_q : 0.f;
      b[v] = (__ldg(partials + strip * n + col + v) - column_mean[v]) * column_scale[v] + column_bias[v];
    }
#pragma unroll 1
    for (int part = 0; part < kMomentRows; part += kNormalizeRows) {
      uint4 chunk[kNormalizeRows];  // the rows' loads in flight before the math
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kNormalizeRows; ++i) {
        if (first + part + i < m) chunk[i] = *reinterpret_cast<const uint4*>(out + (first + part + i) * n + col);
      }
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kNormalizeRows; ++i) {
        if (first + part + i >= m) continue;
        const D* stored = reinterpret_cast<const D*>(&chunk[i]);
        Out* values = reinterpret_cast<Out*>(&chunk[i]);
        CUTLASS_PRAGMA_UNROLL
        for (int v = 0; v < kVec; ++v) {
          const float x = static_cast<float>(stored[v]) * a[v] + b[v];
          values[v] = static_cast<Out>(After::apply(args, scalars, col + v, x));
        }
        *reinterpret_cast<uint4*>(out + (first + part + i) * n + col) = chunk[i];
      }
    }
  }
}

// The statistics' workspace: [2][strips][n], the strips' means and M2, then [3][n], the columns'
// mean, scale and bias
CUTLASS_HOST_DEVICE int64_t batch_norm_floats(int64_t m, int64_t n) { return (2 * moment_strips(m) + 3) * n; }

// The launches after the GEMM (`dependent`: fxg::launch_after's). Affine, After (generated): the
// norm's weight and bias, and the stages after the norm (fxg::finalize_columns,
// fxg::normalize_columns); their Arguments are one.
template <class Affine, class After, class Out>
inline void launch_batch_norm(float* partials, Out* out, float* stats, int64_t m, int64_t n, float eps,
                              typename After::Arguments args, cudaStream_t stream, bool dependent) {
  const int64_t strips = moment_strips(m);
  float* columns = partials + 2 * strips * n;
  launch_after(dependent, finalize_columns<Affine>,
               dim3(static_cast<unsigned>((n + fx::kCombineColumns - 1) / fx::kCombineColumns)),
               dim3(fx::combine_block(strips)), 0, stream, partials, m, n, eps, stats, columns, args);
  constexpr int64_t kBlockCols = kNormalizeThreads * (16 / static_cast<int64_t>(sizeof(Out)));
  const dim3 grid(static_cast<unsigned>((n + kBlockCols - 1) / kBlockCols),
                  static_cast<unsigned>(strips < 65535 ? strips : 65535));
  launch_after(dependent, normalize_columns<After, Out>, grid, dim3(kNormalizeThreads), 0, stream, out,
               static_cast<const float*>(partials), static_cast<const float*>(columns), m, n, args);
}

}  // namespace fxg
