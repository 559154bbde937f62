// A norm or softmax over the whole row (wider than any tile; also F.normalize) in the in-GEMM back end:
// fxg::RowStatistics takes the statistics of the row map's input per (row, subtile of EpiN
// columns) in the GEMM's epilogue, from the float32 accumulators, and stores the input;
// fxg::normalize_rows merges a row's subtiles into the row's statistics and runs the map (a
// LayerNorm or RMSNorm with its weight and bias, a softmax or log_softmax) and the rest of the
// chain on the stored values, in place. The GEMM output is written once and read once, and no
// pass computes statistics from it (the row path's kernel reads cuBLAS's output for its statistics
// and maps it). See gemm_stages.cuh for the tree RowStatistics is part of.
//
// What a subtile keeps, and what it stores (RowStoredOf):
//   LayerNorm    mean and M2; each value as its standardized deviation in the subtile, in float16
//                where the output is 16-bit: gemm_batch_norm.cuh's reason, per row (a bfloat16 D
//                of x holds x to 2^-9 of |x|, which normalizing turns into 2^-9 of |x| / std, far
//                past the output's rounding where the row's mean is large against its spread; a
//                deviation in [-sqrt(EpiN), sqrt(EpiN)] holds 2^-11 of itself).
//   RMSNorm,     the sum of squares; the value itself, in the output's type: they subtract nothing,
//   normalize    and an infinite value then gives eager's result (its row's sum is infinite, the
//                scale 0: zeros, NaN at the infinity), where deviations would make the row NaN.
//   (log_)softmax  the max m and the sum of exp(x - m) (fx::merge_exp_sums, as the logsumexp
//                partials: m taken as 0 where it is not finite); each value as x - m (at most 0), in float16 where the output is
//                16-bit: exp of a bfloat16 x would be off by 2^-9 of |x|. A row whose max is not
//                finite (an infinity, a NaN, all of it -inf) is NaN, as eager's (x - max is NaN
//                somewhere, and so is the sum).
#pragma once

#include "gemm_batch_norm.cuh"
#include "gemm_launch.cuh"
#include "gemm_row_reduce.cuh"
#include "gemm_stages.cuh"
#include "row_statistics.cuh"

namespace fxg {

// The row maps and the partials' layout: row_statistics.cuh, with the pass that finishes them
using fx::kRowLayerNorm;
using fx::kRowLogSoftmax;
using fx::kRowNormalize;
using fx::kRowParts;
using fx::kRowRmsNorm;
using fx::kRowSoftmax;
using fx::kRowStatisticsMaxN;
using fx::kScalesBySquares;
using fx::row_statistics_floats;
using fx::row_subtiles;

// The type D is stored in (see above)
template <class Out, int Kind> using RowStoredOf = cute::conditional_t<kScalesBySquares<Kind>, Out, DeviationOf<Out>>;

struct RowStatisticsArguments {
  float* partials = nullptr;
  int64_t m = 0;
  int64_t n = 0;
};

// Per (row, EpiN-column subtile): the statistics of the values its child computed (float32), for
// fxg::normalize_rows; the values go on to the store (see above). By the WGMMA accumulator layout
// (fxg::SubtileCallbacks) a thread holds two rows 8 apart of the subtile, and its quad the rest of
// those rows' columns: a row's sums and max are its quad's. Columns past N count for nothing; rows
// past M are not written.
template <int EpiN, int Kind>
struct RowStatistics : RegisterNode<RowStatisticsArguments> {
  static constexpr int kBlocks = EpiN / 8;
  using RegisterNode::RegisterNode;  // (a base of no template parameter: its names need no using)

  template <class Coords>
  struct ConsumerStoreCallbacks : SubtileCallbacks<Coords, EpiN, Params> {
    using SubtileCallbacks<Coords, EpiN, Params>::SubtileCallbacks;

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor visit_results) {
      float value[2][kBlocks][2];  // (row slot, block, column of the pair)
      this->unpack(visit_results, value);
      const int64_t n = this->params.n, m = this->params.m;
      const int64_t col = this->first_col + static_cast<int64_t>(epi_n) * EpiN;  // the thread's first, this subtile
      const int64_t first = col - this->col_in_tile % EpiN;                      // the subtile's first column
      const int64_t valid = n - first < EpiN ? (n > first ? n - first : 0) : EpiN;
      const int64_t subtiles = row_subtiles<EpiN>(n), subtile = first / EpiN;
      const bool writes = (threadIdx.x & 3) == 0 && valid > 0;
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int64_t row = this->first_row + static_cast<int64_t>(epi_m) * this->epi_rows + 8 * r;
        // the row's partials of the subtile: a thread's values folded as fxg::RowReduce folds them
        // (Partial::of), then over its quad (Partial::over_quad: the same bits on each lane)
        float first_part = 0.f, second_part = 0.f;
        if constexpr (kScalesBySquares<Kind>) {
          first_part = Partial<kVectorNorm>::of(value[r], col, n).over_quad().value;
        } else if constexpr (Kind == kRowLayerNorm) {
          const float mean = Partial<kSum>::of(value[r], col, n).over_quad().value / static_cast<float>(valid);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kBlocks; ++j) {
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < 2; ++e) value[r][j][e] -= mean;
          }
          const float m2 = Partial<kVectorNorm>::of(value[r], col, n).over_quad().value;
          const float s = standardizer(m2, static_cast<float>(valid));
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kBlocks; ++j) {
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < 2; ++e) value[r][j][e] *= s;
          }
          first_part = mean;
          second_part = m2;
        } else {  // softmax, log_softmax: the logsumexp partial, and the values less its shift
          const Partial<kLogSumExp> p = Partial<kLogSumExp>::of(value[r], col, n).over_quad();
          const float ref = Partial<kLogSumExp>::shift(p.value);
          CUTLASS_PRAGMA_UNROLL
          for (int j = 0; j < kBlocks; ++j) {
            CUTLASS_PRAGMA_UNROLL
            for (int e = 0; e < 2; ++e) value[r][j][e] -= ref;
          }
          first_part = p.value;
          second_part = p.scaled;
        }
        if (writes && row < m) {
          this->params.partials[row * subtiles + subtile] = first_part;
          if constexpr (kRowParts<Kind> == 2) this->params.partials[(m + row) * subtiles + subtile] = second_part;
        }
      }
      if constexpr (!kScalesBySquares<Kind>) this->pack(value, visit_results);
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args, params);
  }
};

// fx::normalize_rows_body as a kernel: a block a row
template <class Affine, class After, class Out, int Kind, int EpiN>
__global__ void __launch_bounds__(fx::kRowNormThreads)
    normalize_rows(Out* out, const float* partials, int64_t m, int64_t n, float eps, typename After::Arguments args) {
  extern __shared__ float scale_shift[];
  __shared__ fx::Moments parts[fx::kRowNormThreads];
  wait_for_prior_grid();
  fx::normalize_rows_body<Affine, After, Out, RowStoredOf<Out, Kind>, Kind, EpiN>(fx::Thread{}, out, partials, m, n,
                                                                              eps, args, scale_shift, parts);
}

// The launch after the GEMM: a block a row (`dependent`: fxg::launch_after's). Affine, After
// (generated): the norm's weight and bias, and the stages after the map; their Arguments are one.
template <class Affine, class After, class Out, int Kind, int EpiN>
inline void launch_row_statistics(const float* partials, Out* out, int64_t m, int64_t n, float eps,
                                  typename After::Arguments args, cudaStream_t stream, bool dependent) {
  const size_t smem = kScalesBySquares<Kind> ? 0 : 2 * static_cast<size_t>(row_subtiles<EpiN>(n)) * sizeof(float);
  launch_after(dependent, normalize_rows<Affine, After, Out, Kind, EpiN>, dim3(static_cast<unsigned>(m)),
               dim3(fx::kRowNormThreads), smem, stream, out, partials, m, n, eps, args);
}

}  // namespace fxg
