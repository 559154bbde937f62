// The in-GEMM back end: a CUTLASS 3.x Hopper GEMM (TMA loads, WGMMA, warp-specialized persistent
// kernel) whose epilogue applies a program's chain to the float32 accumulators before anything is
// stored, so the M x N output is written once and never read back.
//
// The epilogue is a CUTLASS epilogue visitor tree (EVT) composed by the code generator
// (fxfuse/cuda/gemm_codegen.py) from typed stages defined here:
//   fxg::Acc            the accumulator tile (Sm90AccFetch)
//   fxg::Col<F, T>      a per-column vector of N values of type T (the bias, a column parameter)
//   fxg::Full<F, T>     an M x N operand of type T (a residual, a gate): TMA loads of each subtile
//                       into shared memory by the epilogue's producer warp, ahead of its use
//   fxg::Scalar<T>      one value of type T read from device memory (a 0-d parameter)
//   fxg::Pointwise<Fn>  the program's pointwise expression on the float32 fragments of its inputs,
//                       rounded once to the output type (Sm90Compute)
//   fxg::GroupNorm<Post, EpiN>  GroupNorm of groups inside the epilogue subtile on its input's
//                       float32 values, statistics in registers, then the rest of the chain
//   fxg::Gated<Gate, EpiN, Out>  a second GEMM on the same x in the same kernel (a gated MLP): the
//                       GEMM runs over both weights interleaved, the node combines each gate column
//                       with its up column and stores the output itself
// Col and Full take the GEMM's Frame (its CTA tile and CUTLASS's epilogue descriptor: subtile and
// load stages) as a template argument, so a program's tree is a template over it (Prog::Tree<Frame>). The GEMM around it is assembled from a Config (tile, cluster, mainloop
// and epilogue schedules) by fxg::GemmFor; a program module compiles one unit per Config so that
// ninja builds them in parallel; each runs under several tile orders chosen at launch, and the
// runtime runs the configuration measured fastest for the call's shape bucket.
//
// Layouts: x is (M, K) row-major, weight (N, K) row-major (B is K-major), out (M, N) row-major.
// TMA needs 16-byte aligned base pointers and row strides; the runtime checks the pointers,
// Prog::supports the sizes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include <cute/tensor.hpp>
#include <cutlass/cutlass.h>
#include <cutlass/epilogue/collective/collective_builder.hpp>
#include <cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp>
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

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

// What the stages of a tree need of the GEMM around them: the CTA tile, and the epilogue's
// descriptor (its subtile, and the stages of the load pipeline a Full operand shares with C).
template <class Tile_, class EpilogueTile, class Out, class Schedule>
struct Frame {
  using Tile = Tile_;
  using Descriptor = cutlass::epilogue::collective::detail::EpilogueDescriptor<Tile, EpilogueTile, void, Out, Schedule>;
};

using ColStride = Stride<_0, _1, int64_t>;
template <class F, class T>
using Col = fusion::Sm90RowBroadcast<0, typename F::Tile, T, float, ColStride, kAlign<T>>;

// An (M, N) row-major operand, read at each accumulator's position
using FullLayout = cutlass::layout::RowMajor;
template <class F, class T>
struct FullOf {
  using D = cutlass::epilogue::collective::detail::AuxLoadDescriptor<typename F::Descriptor, FullLayout, T>;
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

template <class Post>
struct GroupNormArguments {
  int32_t group = 0;  // columns of a group: a multiple of 8 dividing EpiN (N / groups)
  float eps = 0.f;
  typename Post::Arguments post{};
};

// GroupNorm of groups that lie inside the epilogue subtile (EpiN columns), on the float32 values
// of the stages before it, then the rest of the chain (Post): per (row, group) mean and variance in
// registers, two passes (mean, then squared deviations), one store.
//
// It runs in the epilogue's reduce step, which sees the whole subtile's visited values. The
// statistics rely on the SM90 WGMMA accumulator layout (PTX ISA, wgmma fragments): a thread holds
// two rows 8 apart and, in each 8-column block of the subtile, two adjacent columns; the four
// lanes of a quad hold the rest of those blocks. So a group of a multiple of 8 columns is summed
// per thread over its blocks, then over the quad (two shuffles). The layout is checked where it is
// read: relative coordinates outside it stop the kernel (the checks fold away when it holds).
//
// Post (generated): Arguments (the parameters' pointers), Scalars scalars(Arguments const&) (the
// scalar parameters, read once a subtile) and float apply(Arguments const&, Scalars const&,
// int64_t n, float x) -- the normalized value x at column n through the norm's affine parameters
// and the stages after it.
template <class Post, int EpiN>
struct GroupNorm : RegisterNode<GroupNormArguments<Post>> {
  static_assert(EpiN % 8 == 0, "the subtile is a whole number of 8-column blocks");
  static constexpr int kBlocks = EpiN / 8;
  using Base = RegisterNode<GroupNormArguments<Post>>;
  using typename Base::Arguments;
  using typename Base::Params;
  using Base::Base;
  using Base::params;

  template <class Problem>
  static bool can_implement(Problem const& problem, Arguments const& args) {
    const int n = get<1>(problem);
    return args.group >= 8 && args.group % 8 == 0 && EpiN % args.group == 0 && n % args.group == 0;
  }

  template <class Coords>
  struct ConsumerStoreCallbacks : fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Coords coords, int64_t first_col, int64_t n, int col_in_tile,
                                          Params const& params)
        : coords(coords), first_col(first_col), n(n), col_in_tile(col_in_tile), params(params) {}

    Coords coords;    // (R2S, R2S_M, R2S_N, EPI_M, EPI_N) -> (m, n) relative to the thread's first value
    int64_t first_col;  // the column of the thread's first value
    int64_t n;          // N
    int col_in_tile;    // the thread's first column within the CTA tile
    Params params;      // a copy: pointers and sizes in registers, not read through memory per value

    template <class ElementAccumulator, class ElementInput, int F>
    CUTLASS_DEVICE cutlass::Array<float, F> visit(cutlass::Array<ElementAccumulator, F> const&, int, int, int,
                                         cutlass::Array<ElementInput, F> const& input) {
      return cutlass::NumericArrayConverter<float, ElementInput, F>{}(input);
    }

    // Per (row slot, block): the sum over the group holding the block, of the thread's values
    // (a butterfly over the blocks of a group: groups are 1, 2, 4 or 8 blocks), then its quad's.
    CUTLASS_DEVICE static void group_sums(float (&sums)[2][kBlocks], int blocks_per_group) {
      CUTLASS_PRAGMA_UNROLL
      for (int step = 1; step < kBlocks; step *= 2) {
        if (step < blocks_per_group) {  // uniform over the warp
          float partner[2][kBlocks];
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < 2; ++r) {
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kBlocks; ++j) partner[r][j] = sums[r][j ^ step];
          }
          CUTLASS_PRAGMA_UNROLL
          for (int r = 0; r < 2; ++r) {
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < kBlocks; ++j) sums[r][j] += partner[r][j];
          }
        }
      }
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) {
          float s = sums[r][j];
          s += __shfl_xor_sync(0xffffffffu, s, 1);
          s += __shfl_xor_sync(0xffffffffu, s, 2);
          sums[r][j] = s;
        }
      }
    }

    template <class STensor, class SyncFn, class VTensor>
    CUTLASS_DEVICE void reduce(STensor&&, SyncFn const&, int, int epi_n, bool, VTensor visit_results) {
      using Fragment = typename cute::remove_cvref_t<VTensor>::value_type;
      constexpr int F = Fragment::kElements;
      constexpr int V = decltype(size(visit_results))::value;
      auto relative = coords(_, _, _, _0{}, _0{});  // the same in every subtile
      if (col_in_tile % EpiN >= 8 || col_in_tile % 8 > 6) __trap();  // the layout above
      const int blocks_per_group = params.group / 8;
      const float inv_group = 1.f / static_cast<float>(params.group);

      float mean[2][kBlocks], rstd[2][kBlocks];
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) mean[r][j] = rstd[r][j] = 0.f;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < V; ++v) {
        CUTLASS_PRAGMA_UNROLL
        for (int f = 0; f < F; ++f) {
          auto c = relative(v * F + f);
          const int r = get<0>(c) / 8, j = get<1>(c) / 8;
          if (r < 0 || r > 1 || j < 0 || j >= kBlocks) __trap();
          mean[r][j] += visit_results(v)[f];
        }
      }
      group_sums(mean, blocks_per_group);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) mean[r][j] *= inv_group;
      }
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < V; ++v) {
        CUTLASS_PRAGMA_UNROLL
        for (int f = 0; f < F; ++f) {
          auto c = relative(v * F + f);
          const int r = get<0>(c) / 8, j = get<1>(c) / 8;
          const float d = visit_results(v)[f] - mean[r][j];
          rstd[r][j] += d * d;
        }
      }
      group_sums(rstd, blocks_per_group);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kBlocks; ++j) rstd[r][j] = rsqrtf(rstd[r][j] * inv_group + params.eps);
      }
      const int64_t subtile_col = first_col + static_cast<int64_t>(epi_n) * EpiN;
      const auto scalars = Post::scalars(params.post);
      CUTLASS_PRAGMA_UNROLL
      for (int v = 0; v < V; ++v) {
        CUTLASS_PRAGMA_UNROLL
        for (int f = 0; f < F; ++f) {
          auto c = relative(v * F + f);
          const int r = get<0>(c) / 8, j = get<1>(c) / 8;
          const int64_t col = subtile_col + get<1>(c);
          const float x = (visit_results(v)[f] - mean[r][j]) * rstd[r][j];
          // columns past N are not stored: read the last column's parameters there, so that the
          // loads need no branch and the unrolled loop can issue them together
          visit_results(v)[f] = Post::apply(params.post, scalars, col < n ? col : n - 1, x);
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    static_assert(decltype(size<1>(args.epi_tile))::value == EpiN, "the subtile the norm was built for");
    const int64_t n = get<1>(args.problem_shape_mnkl);
    const int64_t first_col = n - get<1>(args.residue_tCcD);
    const int col_in_tile = static_cast<int>(get<1>(args.residue_cD) - get<1>(args.residue_tCcD));
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args.tCcD, first_col, n, col_in_tile, params);
  }
};

// Two GEMMs on the same x in one (a gated MLP: act(x Wg^T) * (x Wu^T)): the kernel runs one GEMM
// over the two weights interleaved in blocks of EpiN / 2 rows (gated_weight in the runtime), so
// each EpiN-column subtile holds EpiN / 2 gate columns and then the matching up columns. By the
// WGMMA accumulator layout (see GroupNorm) a thread holds 8-column block j of the gate half and
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
  using ElementAux = Out;  // the epilogue's element type where it has no D
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
  struct ConsumerStoreCallbacks : fusion::EmptyConsumerStoreCallbacks {
    CUTLASS_DEVICE ConsumerStoreCallbacks(Coords coords, int64_t first_row, int64_t first_col, int col_in_tile,
                                          int epi_rows, Params const& params)
        : coords(coords), first_row(first_row), first_col(first_col), col_in_tile(col_in_tile),
          epi_rows(epi_rows), params(params) {}

    Coords coords;      // (R2S, R2S_M, R2S_N, EPI_M, EPI_N) -> (m, n) relative to the thread's first value
    int64_t first_row;  // the row and (interleaved) column of the thread's first value
    int64_t first_col;
    int col_in_tile;    // the thread's first column within the CTA tile
    int epi_rows;       // rows of a subtile
    Params params;

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
      if (col_in_tile % EpiN >= 8 || col_in_tile % 2 != 0) __trap();  // the layout above

      float value[2][kBlocks][2];  // (row slot, block, column of the pair)
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
      const int64_t col = first_col + static_cast<int64_t>(epi_n) * EpiN;  // the thread's first, this subtile
      const int64_t out_col = col / EpiN * (EpiN / 2) + col % EpiN;
      const int64_t row = first_row + static_cast<int64_t>(epi_m) * epi_rows;
      const auto scalars = Gate::scalars(params.gate);
      CUTLASS_PRAGMA_UNROLL
      for (int r = 0; r < 2; ++r) {
        const int64_t m = row + 8 * r;
        CUTLASS_PRAGMA_UNROLL
        for (int j = 0; j < kHalf; ++j) {
          const int64_t n = out_col + 8 * j;
          if (m >= params.m || n >= params.n) continue;  // n even, N even: both columns or neither
          cutlass::Array<Out, 2> pair;
          CUTLASS_PRAGMA_UNROLL
          for (int e = 0; e < 2; ++e) {
            pair[e] = static_cast<Out>(Gate::apply(params.gate, scalars, n + e, value[r][j][e], value[r][j + kHalf][e]));
          }
          *reinterpret_cast<cutlass::Array<Out, 2>*>(params.out + m * params.n + n) = pair;
        }
      }
    }
  };

  template <bool ReferenceSrc, class... Args>
  CUTLASS_DEVICE auto get_consumer_store_callbacks(fusion::ConsumerStoreArgs<Args...> const& args) {
    static_assert(decltype(size<1>(args.epi_tile))::value == EpiN, "the subtile the weight was interleaved for");
    const int64_t first_row = get<0>(args.problem_shape_mnkl) - get<0>(args.residue_tCcD);
    const int64_t first_col = get<1>(args.problem_shape_mnkl) - get<1>(args.residue_tCcD);
    const int col_in_tile = static_cast<int>(get<1>(args.residue_cD) - get<1>(args.residue_tCcD));
    const int epi_rows = static_cast<int>(decltype(size<0>(args.epi_tile))::value);
    return ConsumerStoreCallbacks<decltype(args.tCcD)>(args.tCcD, first_row, first_col, col_in_tile, epi_rows,
                                                       params);
  }
};

// Arguments of the leaves, from the launch's pointers
inline typename Acc::Arguments acc_args() { return {}; }

template <class Node> typename Node::Arguments col_args(const void* ptr) {
  using T = typename Node::ElementInput;
  typename Node::Arguments a{};
  a.ptr_row = static_cast<const T*>(ptr);
  return a;
}

template <class Node> typename Node::Arguments full_args(const void* ptr, int64_t m, int64_t n) {
  typename Node::Arguments a{};
  a.ptr_aux = static_cast<decltype(a.ptr_aux)>(ptr);
  a.dAux = make_stride(n, _1{}, m * n);
  return a;
}

template <class T> typename Scalar<T>::Arguments scalar_args(const void* ptr) {
  typename Scalar<T>::Arguments a{};
  a.scalar_ptrs[0] = static_cast<const T*>(ptr);
  return a;
}

// -- configurations --------------------------------------------------------------------------------

// A GEMM configuration: CTA tile (M, N, K), cluster shape, mainloop and epilogue schedules.
template <int TM, int TN, int TK, int CM, int CN, bool Pingpong>
struct Config {
  static constexpr bool kPingpong = Pingpong;
  using Tile = Shape<Int<TM>, Int<TN>, Int<TK>>;
  using Cluster = Shape<Int<CM>, Int<CN>, _1>;
  using MainloopSchedule = cute::conditional_t<Pingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<Pingpong, cutlass::epilogue::TmaWarpSpecialized,
                                               cutlass::epilogue::TmaWarpSpecializedCooperative>;
};

// The kernels every GEMM module compiles, one unit each (ConfigI, I = kernel index). Cooperative
// 128x256 with a 2x1 cluster came nearest cuBLAS on the H100 (1.05-1.08x with the bias and a
// store); ping-pong overlaps one warp group's epilogue with the other's mainloop; 128x128 serves
// shapes with few 128x256 tiles (BENCHMARKS.md section 9 has what each won).
using Config0 = Config<128, 256, 64, 2, 1, false>;
using Config1 = Config<128, 128, 64, 2, 1, true>;
using Config2 = Config<128, 128, 64, 1, 2, false>;
constexpr int kNumKernels = 3;
constexpr const char* kKernelNames[kNumKernels] = {
    "cooperative 128x256x64 cluster 2x1", "pingpong 128x128x64 cluster 2x1", "cooperative 128x128x64 cluster 1x2"};

// The persistent tile scheduler's orders of visiting tiles, set at launch (no build of their own):
// which tiles run together decides how much of A and B the L2 serves.
using RasterOrder = cutlass::gemm::kernel::detail::RasterOrderOptions;
struct Schedule {
  RasterOrder raster;
  int swizzle;
  const char* name;
};
constexpr int kNumSchedules = 6;
constexpr Schedule kSchedules[kNumSchedules] = {
    {RasterOrder::Heuristic, 1, "raster heuristic"}, {RasterOrder::AlongM, 1, "raster M"},
    {RasterOrder::AlongN, 1, "raster N"},            {RasterOrder::AlongM, 2, "raster M swizzle 2"},
    {RasterOrder::AlongN, 2, "raster N swizzle 2"},  {RasterOrder::AlongN, 4, "raster N swizzle 4"}};

// A configuration index (FxGemmLaunch::config) is kernel * kNumSchedules + schedule.
constexpr int kNumConfigs = kNumKernels * kNumSchedules;

// "<kernel>, <schedule>" for every configuration, in index order; a module with a gated tree beside
// its plain one has twice the configurations, the second half "gated <kernel>, <schedule>".
inline const char* const* config_names() {
  static const char* names[2 * kNumConfigs];
  static char text[2 * kNumConfigs][112];
  static const bool filled = [] {
    for (int c = 0; c < 2 * kNumConfigs; ++c) {
      snprintf(text[c], sizeof(text[c]), "%s%s, %s", c >= kNumConfigs ? "gated " : "",
               kKernelNames[c / kNumSchedules % kNumKernels], kSchedules[c % kNumSchedules].name);
      names[c] = text[c];
    }
    return true;
  }();
  (void)filled;
  return names;
}

// A kernel unit's entry points (each unit is compiled on its own)
struct Unit {
  int32_t (*supports)(int64_t m, int64_t n, int64_t k);
  int64_t (*workspace)(int64_t m, int64_t n, int64_t k, int32_t sms);
  const char* (*launch)(const FxGemmLaunch* a, void* stream);
};

// -- the GEMM ----------------------------------------------------------------------------------------

// The epilogue subtile: CUTLASS's choice, or EpiN columns where a stage needs whole groups in one
// (rows: a warp group's 64 in ping-pong, both warp groups' 128 in the cooperative kernels).
template <class Cfg, int EpiN>
using EpilogueTileFor = cute::conditional_t<EpiN == 0, cutlass::epilogue::collective::EpilogueTileAuto,
                                            Shape<Int<Cfg::kPingpong ? 64 : 128>, Int<EpiN>>>;

// Prog (generated): Element (x, weight), Out (the output), kEpilogueN (0: CUTLASS's subtile),
// kGatedBlock (0, or a Gated tree's EpiN / 2: the GEMM runs over an interleaved weight and the
// tree stores the output itself), template <class Frame> Tree (the EVT), and
// args(const FxGemmLaunch&) -> Tree<Frame>::Arguments.
template <class Prog, class Cfg>
struct GemmFor {
  using T = typename Prog::Element;
  using Out = typename Prog::Out;
  static constexpr bool kGated = Prog::kGatedBlock > 0;
  using OutD = cute::conditional_t<kGated, void, Out>;  // the collective's D: none where the tree stores
  // The GEMM's columns: N, or the rows of a gated module's interleaved weight
  static int64_t gemm_columns(int64_t n) {
    return kGated ? 2 * ((n + Prog::kGatedBlock - 1) / Prog::kGatedBlock * Prog::kGatedBlock) : n;
  }
  using EpilogueFrame = Frame<typename Cfg::Tile, EpilogueTileFor<Cfg, Prog::kEpilogueN>, Out,
                              typename Cfg::EpilogueSchedule>;
  using EpilogueTree = typename Prog::template Tree<EpilogueFrame>;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, typename Cfg::Tile, typename Cfg::Cluster,
      EpilogueTileFor<Cfg, Prog::kEpilogueN>, float, float, void, cutlass::layout::RowMajor,
      kAlign<Out>, OutD, cutlass::layout::RowMajor, kAlign<Out>, typename Cfg::EpilogueSchedule,
      EpilogueTree>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, kAlign<T>, T,
      cutlass::layout::ColumnMajor, kAlign<T>, float, typename Cfg::Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static typename Gemm::Arguments arguments(const FxGemmLaunch& a) {
    const Schedule& schedule = kSchedules[(a.config >= 0 ? a.config : 0) % kNumSchedules];
    const int m = static_cast<int>(a.m), n = static_cast<int>(gemm_columns(a.n)), k = static_cast<int>(a.k);
    using StrideA = typename Gemm::GemmKernel::StrideA;
    using StrideB = typename Gemm::GemmKernel::StrideB;
    using StrideD = typename Gemm::GemmKernel::StrideD;
    StrideA da = make_stride(int64_t(k), _1{}, int64_t(m) * k);
    StrideB db = make_stride(int64_t(k), _1{}, int64_t(n) * k);
    StrideD dd = make_stride(int64_t(n), _1{}, int64_t(m) * n);
    cutlass::KernelHardwareInfo hw{};
    hw.device_id = a.device;
    hw.sm_count = a.sm_count;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {static_cast<const T*>(a.x), da, static_cast<const T*>(a.weight), db},
        {Prog::template args<EpilogueFrame>(a), nullptr, dd, static_cast<OutD*>(kGated ? nullptr : a.out), dd},
        hw};
    args.scheduler.raster_order = schedule.raster;
    args.scheduler.max_swizzle_size = schedule.swizzle;
    return args;
  }

  static bool supports(int64_t m, int64_t n, int64_t k) {
    if (m > INT32_MAX || gemm_columns(n) > INT32_MAX || k > INT32_MAX) return false;
    FxGemmLaunch a{};
    a.m = m;
    a.n = n;
    a.k = k;
    a.sm_count = 1;
    return Gemm::can_implement(arguments(a)) == cutlass::Status::kSuccess;
  }

  static int64_t workspace_bytes(int64_t m, int64_t n, int64_t k, int32_t sm_count) {
    FxGemmLaunch a{};
    a.m = m;
    a.n = n;
    a.k = k;
    a.sm_count = sm_count;
    return static_cast<int64_t>(Gemm::get_workspace_size(arguments(a)));
  }

  static const char* launch(const FxGemmLaunch& a, void* stream) {
    typename Gemm::Arguments args = arguments(a);
    Gemm gemm;
    cutlass::Status status = gemm.initialize(args, a.workspace, static_cast<cudaStream_t>(stream));
    if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
    status = gemm.run(static_cast<cudaStream_t>(stream));
    if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
    const cudaError_t error = cudaGetLastError();
    return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
  }
};

}  // namespace fxg

// The macros below expand inside the generated module's own namespace (NS).
// One configuration's entry points (a unit of its own); NAME tells a module's trees apart.
#define FX_DEFINE_GEMM_UNIT(PROG, INDEX, NAME)                                                          \
  int32_t supports_##NAME(int64_t m, int64_t n, int64_t k) {                                            \
    return fxg::GemmFor<PROG, fxg::Config##INDEX>::supports(m, n, k) ? 1 : 0;                         \
  }                                                                                                    \
  int64_t workspace_##NAME(int64_t m, int64_t n, int64_t k, int32_t sms) {                              \
    return fxg::GemmFor<PROG, fxg::Config##INDEX>::workspace_bytes(m, n, k, sms);                     \
  }                                                                                                    \
  const char* launch_##NAME(const FxGemmLaunch* a, void* stream) {                                     \
    return fxg::GemmFor<PROG, fxg::Config##INDEX>::launch(*a, stream);                                \
  }
#define FX_DEFINE_GEMM_CONFIG(PROG, INDEX) FX_DEFINE_GEMM_UNIT(PROG, INDEX, INDEX)
#define FX_DEFINE_GATED_GEMM_CONFIG(PROG, INDEX) FX_DEFINE_GEMM_UNIT(PROG, INDEX, gated_##INDEX)

#define FX_DECLARE_GEMM_UNIT(NAME)                                                                     \
  int32_t supports_##NAME(int64_t, int64_t, int64_t);                                                  \
  int64_t workspace_##NAME(int64_t, int64_t, int64_t, int32_t);                                        \
  const char* launch_##NAME(const FxGemmLaunch*, void*);
#define FX_GEMM_UNIT(NAME) fxg::Unit{&supports_##NAME, &workspace_##NAME, &launch_##NAME}

// The module's FxGemmInfo, which dispatches a configuration to its unit (kUnits, in order).
#define FX_DEFINE_GEMM_INFO(PROG, ENTRY, GATED_BLOCK)                                                  \
  constexpr int kNumUnits = static_cast<int>(sizeof(kUnits) / sizeof(kUnits[0]));                      \
  const fxg::Unit* unit_of(int32_t config) {                                                            \
    return config < 0 || config >= kNumUnits * fxg::kNumSchedules ? nullptr                             \
                                                                 : &kUnits[config / fxg::kNumSchedules]; \
  }                                                                                                     \
  int32_t supports(int64_t m, int64_t n, int64_t k, int32_t config) {                                   \
    const fxg::Unit* unit = unit_of(config);                                                            \
    return m >= 1 && unit != nullptr && PROG::supports(n, k) ? unit->supports(m, n, k) : 0;             \
  }                                                                                                     \
  int64_t workspace(int64_t m, int64_t n, int64_t k, int32_t sms, int32_t config) {                     \
    const fxg::Unit* unit = unit_of(config);                                                            \
    return unit != nullptr ? unit->workspace(m, n, k, sms) : 0;                                         \
  }                                                                                                     \
  const char* launch(const FxGemmLaunch* a, void* stream) {                                             \
    const fxg::Unit* unit = unit_of(a->config);                                                         \
    return unit != nullptr ? unit->launch(a, stream) : "fxfuse: no such GEMM configuration";            \
  }                                                                                                     \
  const FxGemmInfo kInfo = {FX_ABI_VERSION,   PROG::kDtype,                 PROG::kOutDtype,             \
                            PROG::kNumParams, PROG::kParamKinds,            PROG::kParamDtypes,          \
                            GATED_BLOCK,      fxg::kNumConfigs,             kNumUnits * fxg::kNumSchedules, \
                            fxg::config_names(), &supports,                 &workspace,                  \
                            &launch};                                                                   \
  extern "C" const FxGemmInfo* ENTRY() { return &kInfo; }

#define FX_DEFINE_GEMM_MODULE(PROG, ENTRY)                                                              \
  FX_DECLARE_GEMM_UNIT(0)                                                                               \
  FX_DECLARE_GEMM_UNIT(1)                                                                               \
  FX_DECLARE_GEMM_UNIT(2)                                                                               \
  static_assert(fxg::kNumKernels == 3, "one unit a kernel");                                            \
  const fxg::Unit kUnits[] = {FX_GEMM_UNIT(0), FX_GEMM_UNIT(1), FX_GEMM_UNIT(2)};                       \
  FX_DEFINE_GEMM_INFO(PROG, ENTRY, 0)

// A program with a second GEMM: PROG reads its output (computed by cuBLAS) as an operand of the
// output's shape, GATED runs it in the kernel (fxg::Gated); the selection measures both.
#define FX_DEFINE_DUAL_GEMM_MODULE(PROG, GATED, ENTRY)                                                  \
  FX_DECLARE_GEMM_UNIT(0)                                                                               \
  FX_DECLARE_GEMM_UNIT(1)                                                                               \
  FX_DECLARE_GEMM_UNIT(2)                                                                               \
  FX_DECLARE_GEMM_UNIT(gated_0)                                                                         \
  FX_DECLARE_GEMM_UNIT(gated_1)                                                                         \
  FX_DECLARE_GEMM_UNIT(gated_2)                                                                         \
  static_assert(fxg::kNumKernels == 3, "one unit a kernel");                                            \
  const fxg::Unit kUnits[] = {FX_GEMM_UNIT(0),       FX_GEMM_UNIT(1),       FX_GEMM_UNIT(2),             \
                              FX_GEMM_UNIT(gated_0), FX_GEMM_UNIT(gated_1), FX_GEMM_UNIT(gated_2)};     \
  FX_DEFINE_GEMM_INFO(PROG, ENTRY, GATED::kGatedBlock)
