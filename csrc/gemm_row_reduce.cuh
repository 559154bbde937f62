// fxg::RowReduce: a row reduction to one value a row (sum, mean, max, min, logsumexp, the
// Euclidean norm) in the
// in-GEMM epilogue: per (row, N-tile) partials from the accumulators, then fxg::finalize_rows
// combines a row's partials in tile order and runs the stages after the reduction. The M x N
// output is never written (see gemm_stages.cuh for the tree it is part of).
#pragma once

#include "gemm_launch.cuh"
#include "gemm_stages.cuh"
#include "row_args.cuh"
#include "row_statistics.cuh"

namespace fxg {

enum ReduceKind : int { kSum = 0, kMean = 1, kMax = 2, kMin = 3, kLogSumExp = 4, kVectorNorm = 5 };

// A partial reduction of some of a row's values: the sum, max, min or sum of squares (the
// Euclidean norm's) (value); for logsumexp the
// max (value) and the sum of exp(x - ref(max)) (scaled), ref(max) being 0 where the max is not
// finite, as torch.logsumexp shifts by. Partials combine in any grouping; NaN propagates.
template <int Kind>
struct Partial {
  float value = Kind == kMax || Kind == kLogSumExp ? -INFINITY : Kind == kMin ? INFINITY : 0.f;
  float scaled = 0.f;

  CUTLASS_HOST_DEVICE static float shift(float max) { return fx::exp_sum_shift(max); }

  CUTLASS_DEVICE void combine(Partial const& other) {
    if constexpr (Kind == kSum || Kind == kMean || Kind == kVectorNorm) {
      value += other.value;
    } else if constexpr (Kind == kMax) {
      value = fx::OpMax()(value, other.value);
    } else if constexpr (Kind == kMin) {
      value = fx::OpMin()(value, other.value);
    } else {
      fx::merge_exp_sums(value, scaled, other.value, other.scaled);
    }
  }

  // The partial of a row's values of a subtile (value[block][column of the pair], as
  // SubtileCallbacks::unpack gives them), columns from `col` on; those at N or past it left out.
  // Folded pairwise (a tree four deep for 16 values, not a chain of 16 dependent adds or
  // maxima: the epilogue runs exposed between two tiles' mainloops).
  template <int Blocks>
  CUTLASS_DEVICE static Partial of(float const (&value)[Blocks][2], int64_t col, int64_t n) {
    constexpr int kValues = 2 * Blocks;
    constexpr float kIdentity = Kind == kMax || Kind == kLogSumExp ? -INFINITY : Kind == kMin ? INFINITY : 0.f;
    float acc[kValues];
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < kValues; ++i) {
      const float x = value[i / 2][i % 2];
      acc[i] = col + 8 * (i / 2) + i % 2 < n ? (Kind == kVectorNorm ? x * x : x) : kIdentity;
    }
    Partial p;
    p.value = fold(acc);
    if constexpr (Kind == kLogSumExp) {
      const float ref = shift(p.value);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < kValues; ++i) {  // the fast exponential: the rule, not eager's bits
        acc[i] = col + 8 * (i / 2) + i % 2 < n ? __expf(value[i / 2][i % 2] - ref) : 0.f;
      }
      p.scaled = fold<kSum>(acc);
    }
    return p;
  }

  // This partial combined over the thread's quad (lanes 1 and 2 apart: the rest of its row's
  // columns of the subtile); every lane of the quad gets the same bits (a op b == b op a)
  CUTLASS_DEVICE Partial over_quad() const {
    Partial p = *this;
    CUTLASS_PRAGMA_UNROLL
    for (int lane = 1; lane < 4; lane *= 2) {
      Partial other;
      other.value = __shfl_xor_sync(0xffffffffu, p.value, lane);
      if constexpr (Kind == kLogSumExp) other.scaled = __shfl_xor_sync(0xffffffffu, p.scaled, lane);
      p.combine(other);
    }
    return p;
  }

  // acc[0] op acc[1] op ... in a pairwise tree (Op: the partial's own fold, or a sum)
  template <int Op = Kind, int Count>
  CUTLASS_DEVICE static float fold(float (&acc)[Count]) {
    CUTLASS_PRAGMA_UNROLL
    for (int width = 1; width < Count; width *= 2) {
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i + width < Count; i += 2 * width) {
        if constexpr (Op == kMax || Op == kLogSumExp) acc[i] = fx::OpMax()(acc[i], acc[i + width]);
        else if constexpr (Op == kMin) acc[i] = fx::OpMin()(acc[i], acc[i + width]);
        else acc[i] += acc[i + width];
      }
    }
    return acc[0];
  }

  // The reduction of the row of n values this partial covers
  CUTLASS_DEVICE float result(int64_t n) const {
    if constexpr (Kind == kMean) return value / static_cast<float>(n);
    if constexpr (Kind == kLogSumExp) return logf(scaled) + shift(value);
    if constexpr (Kind == kVectorNorm) return sqrtf(value);
    return value;
  }
};

// The N-tiles of a row: its partials
template <int TileN> CUTLASS_HOST_DEVICE int64_t row_tiles(int64_t n) { return (n + TileN - 1) / TileN; }

// partials: [parts][M][N-tiles] float32 (parts: 2 for logsumexp's two values, else 1), a row's
// partials side by side for the finalize's coalesced read
template <int Kind> constexpr int kPartialParts = Kind == kLogSumExp ? 2 : 1;
CUTLASS_HOST_DEVICE int64_t partial_index(int part, int64_t row, int64_t tile, int64_t m, int64_t tiles) {
  return (part * m + row) * tiles + tile;
}

struct RowReduceArguments {
  float* partials = nullptr;
  int64_t m = 0;
  int64_t n = 0;
};

// Per (row, N-tile) partials of the values its child computed (the pointwise stages before the
// reduction, in float32): by the WGMMA accumulator layout (fxg::SubtileCallbacks) a thread
// holds two rows 8 apart of each EpiN-column subtile, and its quad the rest of those rows'
// columns, so a thread folds its values subtile by subtile (columns past N left out), its quad
// combines them at the end of the tile, and one lane a quad writes the row's partial. The kernel
// stores no D.
template <class Frame, int Kind, int EpiN>
struct RowReduce : RegisterNode<RowReduceArguments> {
  static_assert(EpiN % 8 == 0, "the subtile is a whole number of 8-column blocks");
  static constexpr int kBlocks = EpiN / 8;
  static constexpr int kTileN = decltype(size<1>(typename Frame::Tile{}))::value;
  static constexpr int kTileM = decltype(size<0>(typename Frame::Tile{}))::value;
  static constexpr int kSlots = kTileM / 64;  // subtiles a tile: of 64 rows (ping-pong) or all of them
  using ElementAux = NoDElement;  // the kernel has no D
  using RegisterNode::RegisterNode;  // (a base of no template parameter: its names need no using)

  template <class Coords>
  struct ConsumerStoreCallbacks : SubtileCallbacks<Coords, EpiN, Params> {
    using SubtileCallbacks<Coords, EpiN, Params>::SubtileCallbacks;
    Partial<Kind> rows[kSlots][2];  // (subtile row, row slot): the thread's values so far

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor visit_results) {
      if (epi_m >= kSlots) __trap();  // subtiles of fewer than 64 rows
      float value[2][kBlocks][2];  // (row slot, block, column of the pair)
      this->unpack(visit_results, value);
      const int64_t col = this->first_col + static_cast<int64_t>(epi_n) * EpiN;  // the thread's first, this subtile
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) rows[epi_m][r].combine(Partial<Kind>::of(value[r], col, this->params.n));
    }

    CUTLASS_DEVICE void end() {
      const int64_t tile = this->first_col / kTileN;
      const int64_t tiles = row_tiles<kTileN>(this->params.n);
      if (tile >= tiles) return;  // a CTA past N in a cluster that is not: nothing of the rows (CTA-uniform)
      const bool writes = (threadIdx.x & 3) == 0;
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kSlots; ++s) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          const Partial<Kind> p = rows[s][r].over_quad();  // the quad: the rest of the row's columns
          const int64_t row = this->first_row + static_cast<int64_t>(s) * this->epi_rows + 8 * r;
          if (!writes || s * this->epi_rows >= kTileM || row >= this->params.m) continue;
          this->params.partials[partial_index(0, row, tile, this->params.m, tiles)] = p.value;
          if constexpr (kPartialParts<Kind> == 2) this->params.partials[partial_index(1, row, tile, this->params.m, tiles)] = p.scaled;
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args, params);
  }
};

// One warp a row: lane l combines the row's partials of tiles l, l + 32, ... in order, then the
// lanes combine by a fixed butterfly (deterministic: the grouping depends only on the tile count);
// lane 0 takes the reduction's result through Finalize::apply (the stages after the reduction)
// and stores it in Out. A warp a row rather than a thread: a short output (M = 1024 rows, 64
// tiles) would otherwise run a few blocks, each thread walking its row's tiles one load at a time.
// Finalize (generated): Arguments, Scalars scalars(Arguments const&), float apply(Arguments const&,
// Scalars const&, int64_t n, float x).
constexpr int kFinalizeThreads = 256;

template <class Finalize, int Kind, class Out>
__global__ void __launch_bounds__(kFinalizeThreads) finalize_rows(const float* partials, Out* out, int64_t m,
                                                                    int64_t n, int64_t tiles,
                                                                    typename Finalize::Arguments args) {
  wait_for_prior_grid();
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= m) return;  // warp-uniform
  Partial<Kind> total;
  for (int64_t t = lane; t < tiles; t += 32) {
    Partial<Kind> p;
    p.value = partials[partial_index(0, row, t, m, tiles)];
    if constexpr (kPartialParts<Kind> == 2) p.scaled = partials[partial_index(1, row, t, m, tiles)];
    total.combine(p);
  }
  CUTLASS_PRAGMA_UNROLL
  for (int lanes = 16; lanes > 0; lanes /= 2) {
    Partial<Kind> other;
    other.value = __shfl_xor_sync(0xffffffffu, total.value, lanes);
    other.scaled = __shfl_xor_sync(0xffffffffu, total.scaled, lanes);
    total.combine(other);
  }
  if (lane != 0) return;
  const auto scalars = Finalize::scalars(args);
  out[row] = static_cast<Out>(Finalize::apply(args, scalars, 0, total.result(n)));
}

}  // namespace fxg
