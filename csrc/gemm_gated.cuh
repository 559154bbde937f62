// fxg::Gated: a second GEMM on the same x in the same kernel (a gated MLP), its output combined with
// the GEMM's in registers and stored by the node (see gemm_stages.cuh for the tree it is part of).
#pragma once

#include "gemm_stages.cuh"

namespace fxg {

// Two GEMMs on the same x in one (a gated MLP: act(x Wg^T) * (x Wu^T)): the kernel runs one GEMM
// over the two weights interleaved in blocks of EpiN / 2 rows (gated_weight in the runtime), so
// each EpiN-column subtile holds EpiN / 2 gate columns and then the matching up columns. By the
// WGMMA accumulator layout (fxg::SubtileCallbacks) a thread holds 8-column block j of the gate half and
// block j + kBlocks / 2 of the up half: the same output columns. The node combines them
// (Gate::apply: the program's expression in float32, the up value as its second-GEMM parameter) and
// stores the (M, N) output itself, two adjacent columns a store; the kernel has no D (void).
//
// Gate (generated): Arguments, Scalars scalars(Arguments const&) and float apply(Arguments const&,
// Scalars const&, int64_t n, float gate, float up) -- the output at column n.
template <class Gate, class Out>
struct GatedArguments {
  Out* out = nullptr;  // (M, N) row-major
  int64_t m = 0;
  int64_t n = 0;  // output columns (the GEMM's are the interleaved weight's rows)
  typename Gate::Arguments gate{};
};

template <class Gate, int EpiN, class Out>
struct Gated : RegisterNode<GatedArguments<Gate, Out>> {
  static_assert(EpiN % 16 == 0, "the subtile is a whole number of 8-column blocks a half");
  static constexpr int kBlocks = EpiN / 8;
  static constexpr int kHalf = kBlocks / 2;
  using ElementAux = NoDElement;  // the kernel has no D
  using Base = RegisterNode<GatedArguments<Gate, Out>>;
  using typename Base::Arguments;
  using typename Base::Params;
  using Base::Base;
  using Base::params;

  template <class Problem>
  static bool can_implement(Problem const& problem, Arguments const& args) {
    return args.n % 2 == 0 && get<1>(problem) == 2 * padded_columns(args.n);
  }
  // Output columns rounded up to whole blocks of the interleaved weight
  CUTLASS_HOST_DEVICE static int64_t padded_columns(int64_t n) { return (n + EpiN / 2 - 1) / (EpiN / 2) * (EpiN / 2); }

  template <class Coords>
  struct ConsumerStoreCallbacks : SubtileCallbacks<Coords, EpiN, Params> {
    using SubtileCallbacks<Coords, EpiN, Params>::SubtileCallbacks;

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int epi_m, int epi_n, bool, VTensor visit_results) {
      float value[2][kBlocks][2];  // (row slot, block, column of the pair): gate blocks, then up blocks
      this->unpack(visit_results, value);
      // the thread's first (interleaved) column this subtile, and its output column
      const int64_t col = this->first_col + static_cast<int64_t>(epi_n) * EpiN;
      const int64_t out_col = col / EpiN * (EpiN / 2) + col % EpiN;
      const int64_t row = this->first_row + static_cast<int64_t>(epi_m) * this->epi_rows;
      const auto scalars = Gate::scalars(this->params.gate);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int64_t m = row + 8 * r;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kHalf; ++j) {
          const int64_t n = out_col + 8 * j;
          if (m >= this->params.m || n >= this->params.n) continue;  // n even, N even: both columns or neither
          cutlass::Array<Out, 2> pair;
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) {
            pair[e] = static_cast<Out>(Gate::apply(this->params.gate, scalars, n + e, value[r][j][e], value[r][j + kHalf][e]));
          }
          *reinterpret_cast<cutlass::Array<Out, 2>*>(this->params.out + m * this->params.n + n) = pair;
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args, params);
  }
};

}  // namespace fxg
