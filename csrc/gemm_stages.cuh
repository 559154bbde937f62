// The in-GEMM back end's epilogue stages: the typed leaves and nodes a program's epilogue visitor
// tree (CUTLASS EVT) is composed of, by the code generator (fxfuse/cuda/gemm_codegen.py).
//   fxg::Acc            the accumulator tile (Sm90AccFetch)
//   fxg::Col<F, T>      a per-column vector of N values of type T (the bias, a column parameter)
//   fxg::Full<F, T>     an M x N operand of type T (a residual, a gate): TMA loads of each subtile
//                       into shared memory by the epilogue's producer warp, ahead of its use
//   fxg::Scalar<T>      one value of type T read from device memory (a 0-d parameter)
//   fxg::Pointwise<Fn>  the program's pointwise expression on the float32 fragments of its inputs,
//                       rounded once to the output type (Sm90Compute)
//   fxg::RegisterNode   what a node that works in registers declares (the nodes of
//                       gemm_group_norm.cuh, gemm_gated.cuh, gemm_row_reduce.cuh and
//                       gemm_row_statistics.cuh)
//   fxg::SubtileCallbacks  where a thread's values of a subtile lie (the WGMMA layout), for the
//                       callbacks of the register nodes (gemm_gated.cuh, gemm_row_reduce.cuh,
//                       gemm_row_statistics.cuh)
// Col and Full take the GEMM's Frame (its CTA tile, CUTLASS's epilogue descriptor: subtile and
// load stages, and whether the GEMM runs with its operands swapped) as a template argument, so a
// program's tree is a template over it. A swapped GEMM (fxg::Swapped: out^T = weight . x^T, for few
// rows) has the output's columns along its tile's M: there a column vector is CUTLASS's column
// broadcast and an operand of the output's shape is read column-major; the pointwise stages are
// the same.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>

#include "epilogue_ops.cuh"
#include "fx_abi.h"

namespace fxg {

using namespace cute;
namespace fusion = cutlass::epilogue::fusion;

// -- element types ---------------------------------------------------------------------------------

template <int Code> struct ElementOf;
template <> struct ElementOf<FX_F32> { using type = float; };
template <> struct ElementOf<FX_BF16> { using type = cutlass::bfloat16_t; };
template <> struct ElementOf<FX_F16> { using type = cutlass::half_t; };
template <int Code> using Element = typename ElementOf<Code>::type;

// Elements of a 16-byte access: the alignment TMA and the vector loads need
template <class T> constexpr int kAlign = 128 / cutlass::sizeof_bits<T>::value;

// -- epilogue stages -------------------------------------------------------------------------------

using Acc = fusion::Sm90AccFetch;

// What the stages of a tree need of the GEMM around them, and what the GEMM builds its epilogue
// with: the CTA tile, the epilogue's dispatch policy and its descriptor (the subtile, and the
// stages of the load pipeline a Full operand's TMA loads use; C is void). CUTLASS's builder gives
// that pipeline min(subtiles, 4) stages; two are kept: four subtiles of a Full operand beside D's
// two took 48 KiB, which cost the cooperative 128 x 256 kernels a mainloop stage (three of four).
template <class Tile_, class EpilogueTileType, class Out, class Schedule, bool Swapped = false>
struct Frame {
  using Tile = Tile_;
  static constexpr bool kSwapped = Swapped;
  using Builder = cutlass::epilogue::collective::detail::EpilogueDescriptor<Tile, EpilogueTileType, void, Out, Schedule>;
  using Built = typename Builder::DispatchPolicy;
  using DispatchPolicy = cutlass::epilogue::Sm90TmaWarpSpecialized<cute::min(Built::StagesC, 2), Built::StagesD,
                                                                    Built::FragmentSize, Built::ReuseSmemC,
                                                                    Built::DelayTmaStore>;
  struct Descriptor {  // as AuxLoadDescriptor reads it
    using EpilogueTile = typename Builder::EpilogueTile;
    static constexpr int StagesC = DispatchPolicy::StagesC;
    static constexpr int StagesD = DispatchPolicy::StagesD;
  };
};

// A vector of the output's N columns: along the tile's N, or along its M where the GEMM is swapped
template <class F, class T>
using Col = cute::conditional_t<F::kSwapped,
                                fusion::Sm90ColBroadcast<0, typename F::Tile, T, float, Stride<_1, _0, int64_t>, kAlign<T>>,
                                fusion::Sm90RowBroadcast<0, typename F::Tile, T, float, Stride<_0, _1, int64_t>, kAlign<T>>>;

// An (M, N) row-major operand, read at each accumulator's position (the layout of the GEMM's D: the
// output itself, transposed where the GEMM is swapped)
template <class F>
using OutputLayout = cute::conditional_t<F::kSwapped, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;
template <class F, class T>
struct FullOf {
  using D = cutlass::epilogue::collective::detail::AuxLoadDescriptor<typename F::Descriptor, OutputLayout<F>, T>;
  using type = fusion::Sm90AuxLoad<D::Stages, typename D::EpilogueTile, T, typename D::Stride,
                                   typename D::SmemLayoutAtom, typename D::CopyOpS2R, kAlign<T>>;
};
template <class F, class T> using Full = typename FullOf<F, T>::type;

using ScalarStride = Stride<_0, _0, int64_t>;
template <class T> using Scalar = fusion::Sm90ScalarBroadcast<T, ScalarStride>;

template <template <class> class Fn, class Out>
using Pointwise = fusion::Sm90Compute<Fn, Out, float, cutlass::FloatRoundStyle::round_to_nearest>;

template <class Node, class... Inputs> using Tree = fusion::Sm90EVT<Node, Inputs...>;

// A parameter of type T as float: value i of a column vector (i = the column), or of a scalar (0).
template <class T> CUTLASS_DEVICE float load_param(const void* ptr, int64_t i) {
  if constexpr (sizeof(T) == 2) {
    return static_cast<float>(T::bitcast(__ldg(static_cast<const unsigned short*>(ptr) + i)));
  } else {
    return __ldg(static_cast<const float*>(ptr) + i);
  }
}

// Brings the cache line holding value i of a parameter of type T into L1, ahead of its
// load_param: a norm's parameters are read after its statistics, which then hide the latency
// (prefetches have no effect on what is computed)
template <class T> CUTLASS_DEVICE void prefetch_param(const void* ptr, int64_t i) {
  asm volatile("prefetch.global.L1 [%0];" ::"l"(static_cast<const T*>(ptr) + i));
}

// The element type a tree that stores no D (it writes its own output, or partials) declares as
// ElementAux: CUTLASS's epilogue still stages D in shared memory, sized by this type, though
// nothing is written there. One byte: as float (the row reductions'), the cooperative kernels'
// 128 x 64 subtiles took 64 KiB, a mainloop stage (three of 128 x 256 x 64 instead of four).
using NoDElement = uint8_t;

// What a node that works in registers declares to the epilogue: its arguments are its parameters,
// no shared memory, no workspace, nothing for the producer warp to load.
template <class Arguments_>
struct RegisterNode {
  using Arguments = Arguments_;
  using Params = Arguments;
  struct SharedStorage {};

  template <class Problem>
  static constexpr Params to_underlying_arguments(Problem const&, Arguments const& args, void*) {
    return args;
  }
  template <class Problem>
  static size_t get_workspace_size(Problem const&, Arguments const&) {
    return 0;
  }
  template <class Problem>
  static cutlass::Status initialize_workspace(Problem const&, Arguments const&, void*, cudaStream_t,
                                              cutlass::CudaHostAdapter* = nullptr) {
    return cutlass::Status::kSuccess;
  }

  // any M and N, unless a node says otherwise (its own can_implement)
  template <class Problem>
  static bool can_implement(Problem const&, Arguments const&) {
    return true;
  }

  CUTLASS_HOST_DEVICE RegisterNode() {}
  CUTLASS_HOST_DEVICE RegisterNode(Params const& params, SharedStorage const&) : params(params) {}
  Params params;

  CUTLASS_DEVICE bool is_producer_load_needed() const { return false; }
  CUTLASS_DEVICE bool is_C_load_needed() const { return false; }

  template <class... Args>
  CUTLASS_DEVICE auto get_producer_load_callbacks(fusion::ProducerLoadArgs<Args...> const&) {
    return fusion::EmptyProducerLoadCallbacks{};
  }
};

// What the callbacks of a node that works on a thread's values in registers (fxg::Gated,
// fxg::RowReduce) start from: where the thread's values of an EpiN-column subtile lie, and those
// values as float. By the SM90 WGMMA accumulator layout (PTX ISA, wgmma fragments) a thread holds
// two rows 8 apart and, in each 8-column block of the subtile, two adjacent columns; the four lanes
// of its quad hold the rest of those blocks. The layout is checked where it is read: relative
// coordinates outside it stop the kernel (the checks fold away when it holds). Params: the node's.
template <class Coords, int EpiN, class Params>
struct SubtileCallbacks : fusion::EmptyConsumerStoreCallbacks {
  static_assert(EpiN % 8 == 0, "the subtile is a whole number of 8-column blocks");
  static constexpr int kBlocks = EpiN / 8;

  template <class Args>
  CUTLASS_DEVICE SubtileCallbacks(Args const& args, Params const& params)
      : params(params),
        coords(args.tCcD),
        first_row(get<0>(args.problem_shape_mnkl) - get<0>(args.residue_tCcD)),
        first_col(get<1>(args.problem_shape_mnkl) - get<1>(args.residue_tCcD)),
        col_in_tile(static_cast<int>(get<1>(args.residue_cD) - get<1>(args.residue_tCcD))),
        epi_rows(static_cast<int>(decltype(size<0>(args.epi_tile))::value)) {
    static_assert(decltype(size<1>(args.epi_tile))::value == EpiN, "the subtile the node was built for");
  }

  Params params;      // a copy: pointers and sizes in registers, not read through memory per value
  Coords coords;      // (R2S, R2S_M, R2S_N, EPI_M, EPI_N) -> (m, n) relative to the thread's first value
  int64_t first_row;  // the row and column of the thread's first value (of the first subtile)
  int64_t first_col;
  int col_in_tile;    // the thread's first column within the CTA tile
  int epi_rows;       // rows of a subtile

  template <class ElementAccumulator, class ElementInput, int F>
  CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&, int, int, int,
                                                cutlass::Array<ElementInput, F> const& input) {
    return cutlass::NumericArrayConverter<float, ElementInput, F>{}(input);
  }

  // A subtile's visited values as value[row slot][block][column of the pair]: row first_row +
  // 8 * slot (+ the subtile's rows), column first_col + 8 * block + column (+ the subtile's)
  template <class VTensor>
  CUTLASS_DEVICE void unpack(VTensor const& visit_results, float (&value)[2][kBlocks][2]) const {
    using Fragment = typename cute::remove_cvref_t<VTensor>::value_type;
    constexpr int F = Fragment::kElements;
    constexpr int V = decltype(size(visit_results))::value;
    static_assert(V * F == 4 * kBlocks, "two rows and two columns of each 8-column block a thread");
    auto relative = coords(_, _, _, _0{}, _0{});  // the same in every subtile
    if (col_in_tile % EpiN >= 8 || col_in_tile % 2 != 0) __trap();
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < V; ++v) {
      CUTLASS_PRAGMA_UNROLL
      for (int f = 0; f < F; ++f) {
        auto c = relative(v * F + f);
        const int r = get<0>(c) / 8, j = get<1>(c) / 8, e = get<1>(c) % 8;
        if (get<0>(c) % 8 != 0 || r > 1 || j >= kBlocks || e > 1) __trap();
        value[r][j][e] = visit_results(v)[f];
      }
    }
  }

  // The inverse of unpack: value[row slot][block][column of the pair] back into the visited values
  // (which the epilogue then stores, where the tree has a D)
  template <class VTensor>
  CUTLASS_DEVICE void pack(float const (&value)[2][kBlocks][2], VTensor& visit_results) const {
    using Fragment = typename cute::remove_cvref_t<VTensor>::value_type;
    constexpr int F = Fragment::kElements;
    constexpr int V = decltype(size(visit_results))::value;
    auto relative = coords(_, _, _, _0{}, _0{});
    CUTLASS_PRAGMA_UNROLL
    for (int v = 0; v < V; ++v) {
      CUTLASS_PRAGMA_UNROLL
      for (int f = 0; f < F; ++f) {
        auto c = relative(v * F + f);
        visit_results(v)[f] = value[get<0>(c) / 8][get<1>(c) / 8][get<1>(c) % 8];
      }
    }
  }
};

// Arguments of the leaves, from the launch's pointers
inline typename Acc::Arguments acc_args() { return {}; }

template <class Arguments, class = void> struct IsColumnBroadcast : std::false_type {};
template <class Arguments>
struct IsColumnBroadcast<Arguments, cute::void_t<decltype(Arguments::ptr_col)>> : std::true_type {};

template <class Node> typename Node::Arguments col_args(const void* ptr) {
  using T = typename Node::ElementInput;
  typename Node::Arguments a{};
  if constexpr (IsColumnBroadcast<typename Node::Arguments>::value) {  // a swapped GEMM's
    a.ptr_col = static_cast<const T*>(ptr);
  } else {
    a.ptr_row = static_cast<const T*>(ptr);
  }
  return a;
}

// The (M, N) row-major operand at ptr; a swapped GEMM reads it as its (N, M) column-major D
template <class Node> typename Node::Arguments full_args(const void* ptr, int64_t m, int64_t n) {
  typename Node::Arguments a{};
  a.ptr_aux = static_cast<decltype(a.ptr_aux)>(ptr);
  if constexpr (cute::is_static_v<decltype(get<0>(a.dAux))>) {
    a.dAux = make_stride(_1{}, n, m * n);
  } else {
    a.dAux = make_stride(n, _1{}, m * n);
  }
  return a;
}

template <class T> typename Scalar<T>::Arguments scalar_args(const void* ptr) {
  typename Scalar<T>::Arguments a{};
  a.scalar_ptrs[0] = static_cast<const T*>(ptr);
  return a;
}

}  // namespace fxg
