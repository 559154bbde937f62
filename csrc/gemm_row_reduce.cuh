// fxg::RowReduce: a row reduction to one value a row (sum, mean, max, min, logsumexp, the
// Euclidean norm) in the
// in-GEMM epilogue: per (row, N-tile) partials from the accumulators, then fxg::finalize_rows
// combines a row's partials in tile order and runs the stages after the reduction. The M x N
// output is never written (see gemm_stages.cuh for the tree it is part of).
#pragma once

#include "gemm_stages.cuh"
#include "row_args.cuh"

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

  CUTLASS_HOST_DEVICE static float shift(float max) { return isfinite(max) ? max : 0.f; }

  CUTLASS_DEVICE void combine(Partial const& other) {
    if constexpr (Kind == kSum || Kind == kMean || Kind == kVectorNorm) {
      value += other.value;
    } else if constexpr (Kind == kMax) {
      value = fx::OpMax()(value, other.value);
    } else if constexpr (Kind == kMin) {
      value = fx::OpMin()(value, other.value);
    } else {
      const float max = fx::OpMax()(value, other.value), ref = shift(max);
      // a sum of 0 (no values, or all -inf) adds nothing, also where its rescaling would overflow
      scaled = (scaled == 0.f ? 0.f : scaled * expf(shift(value) - ref)) +
               (other.scaled == 0.f ? 0.f : other.scaled * expf(shift(other.value) - ref));
      value = max;
    }
  }

  // The partial of `count` values
  template <int Count>
  CUTLASS_DEVICE static Partial of(float const (&x)[Count], bool const (&in)[Count]) {
    Partial p;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < Count; ++i) {
      if (!in[i]) continue;
      if constexpr (Kind == kSum || Kind == kMean) p.value += x[i];
      if constexpr (Kind == kVectorNorm) p.value += x[i] * x[i];
      if constexpr (Kind == kMax || Kind == kLogSumExp) p.value = fx::OpMax()(p.value, x[i]);
      if constexpr (Kind == kMin) p.value = fx::OpMin()(p.value, x[i]);
    }
    if constexpr (Kind == kLogSumExp) {
      const float ref = shift(p.value);
      CUTLASS_PRAGMA_UNROLL
      for (int i = 0; i < Count; ++i) {
        if (in[i]) p.scaled += __expf(x[i] - ref);  // the fast exponential: the rule, not eager's bits
      }
    }
    return p;
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

// partials: [parts][N-tiles][M] float32 (parts: 2 for logsumexp's two values, else 1)
template <int Kind> constexpr int kPartialParts = Kind == kLogSumExp ? 2 : 1;

struct RowReduceArguments {
  float* partials = nullptr;
  int64_t m = 0;
  int64_t n = 0;
};

// Per (row, N-tile) partials of the values its child computed (the pointwise stages before the
// reduction, in float32): by the WGMMA accumulator layout (see gemm_group_norm.cuh) a thread
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
  using ElementAux = float;  // the epilogue's element type where it has no D
  using Base = RegisterNode<RowReduceArguments>;
  using typename Base::Arguments;
  using typename Base::Params;
  using Base::Base;
  using Base::params;

  template <class Problem>
  static bool can_implement(Problem const&, Arguments const&) {
    return true;  // any M and N: columns past N are left out, rows past M not written
  }

  template <class Coords>
  struct ConsumerStoreCallbacks : fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Coords coords, int64_t first_row, int64_t first_col, int col_in_tile,
                                          int epi_rows, Params const& params)
        : coords(coords), first_row(first_row), first_col(first_col), col_in_tile(col_in_tile),
          epi_rows(epi_rows), params(params) {}

    Coords coords;      // (R2S, R2S_M, R2S_N, EPI_M, EPI_N) -> (m, n) relative to the thread's first value
    int64_t first_row;  // the row and column of the thread's first value
    int64_t first_col;
    int col_in_tile;    // the thread's first column within the CTA tile
    int epi_rows;       // rows of a subtile
    Params params;
    Partial<Kind> rows[kSlots][2];  // (subtile row, row slot): the thread's values so far

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&, int, int, int,
                                                  cutlass::Array<ElementInput, F> const& input) {
      return cutlass::NumericArrayConverter<float, ElementInput, F>{}(input);
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor visit_results) {
      using Fragment = typename cute::remove_cvref_t<VTensor>::value_type;
      constexpr int F = Fragment::kElements;
      constexpr int V = decltype(size(visit_results))::value;
      static_assert(V * F == 4 * kBlocks, "two rows and two columns of each 8-column block a thread");
      auto relative = coords(_, _, _, _0{}, _0{});  // the same in every subtile
      if (col_in_tile % EpiN >= 8 || col_in_tile % 2 != 0 || epi_m >= kSlots) __trap();  // the layout above
      const int64_t col = first_col + static_cast<int64_t>(epi_n) * EpiN;  // the thread's first, this subtile
      float x[2][2 * kBlocks];
      bool in[2][2 * kBlocks];
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < V; ++v) {
        CUTLASS_PRAGMA_UNROLL
        for (int f = 0; f < F; ++f) {
          auto c = relative(v * F + f);
          const int r = get<0>(c) / 8, j = get<1>(c) / 8, e = get<1>(c) % 8;
          if (get<0>(c) % 8 != 0 || r > 1 || j >= kBlocks || e > 1) __trap();
          x[r][2 * j + e] = visit_results(v)[f];
          in[r][2 * j + e] = col + get<1>(c) < params.n;
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) rows[epi_m][r].combine(Partial<Kind>::of(x[r], in[r]));
    }

    CUTLASS_DEVICE void end() {
      const int64_t tile = first_col / kTileN;
      const int64_t tiles = row_tiles<kTileN>(params.n);
      if (tile >= tiles) return;  // a CTA past N in a cluster that is not: nothing of the rows (CTA-uniform)
      const bool writes = (threadIdx.x & 3) == 0;
      CUTLASS_PRAGMA_UNROLL
      for (int s = 0; s < kSlots; ++s) {
        CUTLASS_PRAGMA_UNROLL
        for (int r = 0; r < 2; ++r) {
          Partial<Kind> p = rows[s][r];
          CUTLASS_PRAGMA_UNROLL
          for (int lane = 1; lane < 4; lane *= 2) {  // the quad: the rest of the row's columns
            Partial<Kind> other;
            other.value = __shfl_xor_sync(0xffffffffu, p.value, lane);
            other.scaled = __shfl_xor_sync(0xffffffffu, p.scaled, lane);
            p.combine(other);
          }
          const int64_t row = first_row + static_cast<int64_t>(s) * epi_rows + 8 * r;
          if (!writes || s * epi_rows >= kTileM || row >= params.m) continue;
          params.partials[tile * params.m + row] = p.value;
          if constexpr (kPartialParts<Kind> == 2) params.partials[(tiles + tile) * params.m + row] = p.scaled;
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    static_assert(decltype(size<1>(args.epi_tile))::value == EpiN, "the subtile the layout was checked for");
    const int64_t first_row = get<0>(args.problem_shape_mnkl) - get<0>(args.residue_tCcD);
    const int64_t first_col = get<1>(args.problem_shape_mnkl) - get<1>(args.residue_tCcD);
    const int col_in_tile = static_cast<int>(get<1>(args.residue_cD) - get<1>(args.residue_tCcD));
    const int epi_rows = static_cast<int>(decltype(size<0>(args.epi_tile))::value);
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args.tCcD, first_row, first_col, col_in_tile, epi_rows,
                                                       params);
  }
};

// One thread a row: its partials combined in tile order (deterministic), the reduction's result,
// then Finalize::apply (the stages after the reduction), stored in Out.
// Finalize (generated): Arguments, Scalars scalars(Arguments const&), float apply(Arguments const&,
// Scalars const&, int64_t n, float x).
template <class Finalize, int Kind, class Out>
__global__ void finalize_rows(const float* partials, Out* out, int64_t m, int64_t n, int64_t tiles,
                              typename Finalize::Arguments args) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= m) return;
  Partial<Kind> total;
  for (int64_t t = 0; t < tiles; ++t) {
    Partial<Kind> p;
    p.value = partials[t * m + row];
    if constexpr (kPartialParts<Kind> == 2) p.scaled = partials[(tiles + t) * m + row];
    total.combine(p);
  }
  const auto scalars = Finalize::scalars(args);
  out[row] = static_cast<Out>(Finalize::apply(args, scalars, 0, total.result(n)));
}

}  // namespace fxg
