// The in-GEMM back end: a CUTLASS 3.x Hopper GEMM (TMA loads, WGMMA, warp-specialized persistent
// kernel) whose epilogue applies a program's chain to the float32 accumulators before anything is
// stored, so the M x N output is written once and never read back.
//
// The epilogue is a CUTLASS epilogue visitor tree (EVT) composed by the code generator
// (fxfuse/cuda/gemm_codegen.py) from typed stages, one header each kind:
//   gemm_stages.cuh      the leaves (accumulator, column vectors, operands of the output's shape,
//                        scalars), the pointwise node and what register-only nodes share
//   gemm_group_norm.cuh  fxg::GroupNorm<Post, EpiN>: GroupNorm of groups inside the epilogue
//                        subtile, statistics in registers, then the rest of the chain
//   gemm_gated.cuh       fxg::Gated<Gate, EpiN, Out>: a second GEMM on the same x in the same
//                        kernel (a gated MLP), combined with the GEMM's columns and stored by it
//   gemm_row_reduce.cuh  fxg::RowReduce<Frame, Kind, EpiN>: per (row, N-tile) partials of a row
//                        reduction; fxg::finalize_rows then writes one value a row (no M x N store)
//   gemm_batch_norm.cuh  fxg::ColumnMoments<EpiN>: a training BatchNorm's column statistics beside
//                        the store of its input; then a finalize and one normalizing pass
//   gemm_row_statistics.cuh  fxg::RowStatistics<EpiN, Kind>: per (row, subtile) partials of a
//                        LayerNorm, RMSNorm, softmax or log_softmax beside the store of its input;
//                        then one pass a row (row_statistics.cuh) maps the rows in place
// This header assembles the GEMM around a program's tree from a Config (tile, cluster, mainloop
// and epilogue schedules) by fxg::GemmFor; a program module compiles one unit per Config (and
// tree) so that ninja builds them in parallel; each runs under several tile orders chosen at
// launch, and the runtime runs the configuration measured fastest for the call's shape bucket.
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
#include <cutlass/gemm/collective/collective_builder.hpp>
#include <cutlass/gemm/device/gemm_universal_adapter.h>
#include <cutlass/gemm/kernel/gemm_universal.hpp>
#include <cutlass/kernel_hardware_info.h>

#include "fx_abi.h"
#include "gemm_batch_norm.cuh"
#include "gemm_gated.cuh"
#include "gemm_group_norm.cuh"
#include "gemm_launch.cuh"
#include "gemm_row_reduce.cuh"
#include "gemm_row_statistics.cuh"
#include "gemm_stages.cuh"

namespace fxg {

using namespace cute;

// -- configurations --------------------------------------------------------------------------------

// A GEMM configuration: CTA tile (M, N, K), cluster shape, mainloop and epilogue schedules. TK is
// the tile's K for 16-bit elements; 32-bit ones (float32 as TF32) take half as many, so that a
// pipeline stage holds the same bytes. Pdl: the kernel and those after it are launched as
// programmatic dependents (gemm_launch.cuh; its unit defines CUTLASS_ENABLE_GDC_FOR_SM90). (CUTLASS's
// stream-K scheduler, CTAs sharing a tile's K loop at decode sizes, measured 1.8-2.0x cuBLAS there:
// BENCHMARKS.md section 30.)
template <int TM, int TN, int TK, int CM, int CN, bool Pingpong, bool Pdl = false>
struct Config {
  static constexpr bool kPingpong = Pingpong;
  static constexpr bool kPdl = Pdl;
  static constexpr bool kSwapped = false;
  static constexpr int kTileOrders = 6;  // kSchedules: the persistent scheduler's orders
  static constexpr int kTileM = TM, kTileN = TN;
  template <class T> static constexpr int kTileK = TK * 2 / static_cast<int>(sizeof(T));
  template <class T> using TileFor = Shape<Int<TM>, Int<TN>, Int<kTileK<T>>>;
  using Cluster = Shape<Int<CM>, Int<CN>, _1>;
  using MainloopSchedule = cute::conditional_t<Pingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpong,
                                               cutlass::gemm::KernelTmaWarpSpecializedCooperative>;
  using EpilogueSchedule = cute::conditional_t<Pingpong, cutlass::epilogue::TmaWarpSpecialized,
                                               cutlass::epilogue::TmaWarpSpecializedCooperative>;

  // "cooperative 128x256x64 cluster 2x1": the schedule, the tile for elements of T, the cluster
  template <class T> static void name(char* out, size_t size) {
    snprintf(out, size, "%s %dx%dx%d cluster %dx%d%s", Pingpong ? "pingpong" : "cooperative", TM, TN, kTileK<T>, CM,
             CN, Pdl ? " PDL" : "");
  }
};

// A GEMM for few rows (decode): the operands swapped, out^T = weight . x^T, so that the weight's
// rows (the output's columns) run along the tile's TM = 64 and x's few rows along its narrow TN.
// With 128-row tiles over 1 or 16 rows the WGMMA computed mostly padding and the N/128 tiles
// of the weight left SMs idle: 1.7-2.0x cuBLAS; this is at cuBLAS's speed (its own decode kernels
// swap the same way: BENCHMARKS.md section 37). One CTA a tile, one consumer warp group (no
// persistent scheduler: every tile is one wave's, so it has no tile orders).
template <int TM, int TN, int TK>
struct Swapped {
  static constexpr bool kPingpong = false;
  static constexpr bool kPdl = false;
  static constexpr bool kSwapped = true;
  static constexpr int kTileOrders = 1;
  static constexpr int kTileM = TM, kTileN = TN;
  template <class T> static constexpr int kTileK = TK * 2 / static_cast<int>(sizeof(T));
  template <class T> using TileFor = Shape<Int<TM>, Int<TN>, Int<kTileK<T>>>;
  using Cluster = Shape<_1, _1, _1>;
  using MainloopSchedule = cutlass::gemm::KernelTmaWarpSpecialized;
  using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;

  // "swapped 64x16x128": the output's columns by its rows by K, for elements of T
  template <class T> static void name(char* out, size_t size) {
    snprintf(out, size, "swapped %dx%dx%d", TM, TN, kTileK<T>);
  }
};

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

// A module's kernels (fxfuse/cuda/gemm_codegen.py chooses them; one unit each). A configuration
// index (FxGemmLaunch::config) is kernel * kNumSchedules + schedule; a module with a gated tree
// beside its plain one has twice the configurations, the second half "gated <kernel>, <schedule>".
// A kernel without tile orders (kTileOrders 1: fxg::Swapped) covers no call at schedules past its
// first, named "one CTA a tile".
template <class... Kernels>
struct Menu {
  static constexpr int kNumKernels = static_cast<int>(sizeof...(Kernels));
  static constexpr int kNumConfigs = kNumKernels * kNumSchedules;
  template <int I> using At = cute::tuple_element_t<I, cute::tuple<Kernels...>>;

  // "<kernel>, <schedule>" for every configuration of a module of elements T, in index order
  template <class T> static const char* const* config_names() {
    static const char* names[2 * kNumConfigs];
    static char text[2 * kNumConfigs][112];
    static const bool filled = [] {
      char kernels[kNumKernels][64];
      int i = 0;
      ((Kernels::template name<T>(kernels[i], sizeof(kernels[i])), ++i), ...);
      const int orders[kNumKernels] = {Kernels::kTileOrders...};
      for (int c = 0; c < 2 * kNumConfigs; ++c) {
        const int kernel = c / kNumSchedules % kNumKernels;
        snprintf(text[c], sizeof(text[c]), "%s%s, %s", c >= kNumConfigs ? "gated " : "", kernels[kernel],
                 orders[kernel] > 1 ? kSchedules[c % kNumSchedules].name : "one CTA a tile");
        names[c] = text[c];
      }
      return true;
    }();
    (void)filled;
    return names;
  }
};

// A kernel unit's entry points (each unit is compiled on its own)
struct Unit {
  int32_t tile_orders;  // schedules of kSchedules the kernel runs under (its first tile_orders)
  int32_t (*supports)(int64_t m, int64_t n, int64_t k);
  int64_t (*workspace)(int64_t m, int64_t n, int64_t k, int32_t sms);
  const char* (*launch)(const FxGemmLaunch* a, void* stream);
};

// -- the GEMM ----------------------------------------------------------------------------------------

// The epilogue subtile: CUTLASS's choice, or EpiN columns where a stage needs whole groups in one
// (rows: a warp group's 64 in ping-pong, both warp groups' 128 in the cooperative kernels), or the
// whole tile of a swapped kernel (its groups run along the tile's rows).
template <class Cfg, int EpiN>
using EpilogueTileFor = cute::conditional_t<
    EpiN == 0, cutlass::epilogue::collective::EpilogueTileAuto,
    cute::conditional_t<Cfg::kSwapped, Shape<Int<Cfg::kTileM>, Int<Cfg::kTileN>>,
                        Shape<Int<Cfg::kPingpong ? 64 : 128>, Int<EpiN>>>>;

// Prog (generated): Element (x, weight), Out (the output), kEpilogueN (0: CUTLASS's subtile),
// kGatedBlock (0, or a Gated tree's EpiN / 2: the GEMM runs over an interleaved weight and the
// tree stores the output itself), kReduceKind (-1, or the fxg::ReduceKind of a RowReduce tree:
// the kernel writes partials and fxg::finalize_rows the output, with Prog::Finalize), kBatchTrain
// (a ColumnMoments tree: the kernel stores the norm's input and its column partials, then
// fxg::launch_batch_norm normalises with Prog::NormAffine, NormPost and kNormEps), kRowStatistic
// (-1, or the fxg::RowStatistic of a RowStatistics tree, a norm or softmax over the row: the kernel
// stores the map's input and its (row, subtile) partials, then fxg::launch_row_statistics maps the
// rows with the same three), template <class
// Frame> Tree (the EVT), and args(const FxGemmLaunch&, float* partials) -> Tree<Frame>::Arguments.
template <class Prog, class Cfg>
struct GemmFor {
  using T = typename Prog::Element;
  using Out = typename Prog::Out;
  static constexpr bool kGated = Prog::kGatedBlock > 0;
  static constexpr bool kReduces = Prog::kReduceKind >= 0;
  static constexpr bool kBatchTrain = Prog::kBatchTrain;
  static constexpr bool kRowMap = Prog::kRowStatistic >= 0;
  using Tile = typename Cfg::template TileFor<T>;
  static constexpr int kTileN = decltype(size<1>(Tile{}))::value;
  // the collective's D: none where the tree stores; a training BatchNorm's standardized deviations
  using Stored = cute::conditional_t<kBatchTrain, DeviationOf<Out>,
                                     cute::conditional_t<kRowMap, RowStoredOf<Out, Prog::kRowStatistic>, Out>>;
  using OutD = cute::conditional_t<kGated || kReduces, void, Stored>;
  // The GEMM's columns: N, or the rows of a gated module's interleaved weight
  static int64_t gemm_columns(int64_t n) {
    return kGated ? 2 * ((n + Prog::kGatedBlock - 1) / Prog::kGatedBlock * Prog::kGatedBlock) : n;
  }
  // a swapped GEMM (few rows) takes the trees of pointwise stages and group norms
  // (fxg::GroupNormFor); the other register nodes read the accumulators by the output's rows
  static_assert(!Cfg::kSwapped || !(kGated || kReduces || kBatchTrain || kRowMap),
                "a swapped GEMM's tree is pointwise, or a group norm's");
  using EpilogueFrame = Frame<Tile, EpilogueTileFor<Cfg, Prog::kEpilogueN>, Stored,
                              typename Cfg::EpilogueSchedule, Cfg::kSwapped>;
  using EpilogueTree = typename Prog::template Tree<EpilogueFrame>;
  using LayoutD = OutputLayout<EpilogueFrame>;
  // CUTLASS's TMA epilogue as its builder assembles it, with the Frame's dispatch policy
  using Epilogue = typename cutlass::epilogue::collective::detail::Sm90TmaBuilderImpl<
      Tile, typename EpilogueFrame::Descriptor::EpilogueTile, float, float, void, LayoutD,
      kAlign<Out>, OutD, LayoutD, kAlign<Out>, EpilogueTree,
      typename EpilogueFrame::DispatchPolicy>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, T, cutlass::layout::RowMajor, kAlign<T>, T,
      cutlass::layout::ColumnMajor, kAlign<T>, float, Tile, typename Cfg::Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Cfg::MainloopSchedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue,
                                                      cutlass::gemm::PersistentScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  // A row reduction's partials, after CUTLASS's workspace: [parts][M][N-tiles] float32; a
  // training BatchNorm's column statistics (batch_norm_floats)
  static int64_t partial_floats(int64_t m, int64_t n) {
    if constexpr (kReduces) {
      return kPartialParts<Prog::kReduceKind> * row_tiles<kTileN>(n) * m;
    } else if constexpr (kBatchTrain) {
      return batch_norm_floats(m, n);
    } else if constexpr (kRowMap) {
      return row_statistics_floats<Prog::kEpilogueN, Prog::kRowStatistic>(m, n);
    } else {
      return 0;
    }
  }
  static int64_t partials_offset(const FxGemmLaunch& a) {
    return (static_cast<int64_t>(Gemm::get_workspace_size(arguments(a, nullptr))) + 255) / 256 * 256;
  }

  static typename Gemm::Arguments arguments(const FxGemmLaunch& a, float* partials) {
    const Schedule& schedule = kSchedules[(a.config >= 0 ? a.config : 0) % kNumSchedules];
    const int m = static_cast<int>(a.m), n = static_cast<int>(gemm_columns(a.n)), k = static_cast<int>(a.k);
    // x (m, k) and the weight (n, k) are both K-major: A and B of the GEMM, or B and A where swapped
    const T* x = static_cast<const T*>(a.x);
    const T* weight = static_cast<const T*>(a.weight);
    const auto x_stride = make_stride(int64_t(k), _1{}, int64_t(m) * k);
    const auto weight_stride = make_stride(int64_t(k), _1{}, int64_t(n) * k);
    typename Gemm::GemmKernel::StrideD dd{};
    if constexpr (Cfg::kSwapped) {
      dd = make_stride(_1{}, int64_t(n), int64_t(m) * n);  // out^T, (n, m) column-major
    } else {
      dd = make_stride(int64_t(n), _1{}, int64_t(m) * n);
    }
    cutlass::KernelHardwareInfo hw{};
    hw.device_id = a.device;
    hw.sm_count = a.sm_count;
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {m, n, k, 1},
        {x, x_stride, weight, weight_stride},
        {Prog::template args<EpilogueFrame>(a, partials), nullptr, dd, static_cast<OutD*>(kGated || kReduces ? nullptr : a.out), dd},
        hw};
    if constexpr (Cfg::kSwapped) {
      args.problem_shape = {n, m, k, 1};
      args.mainloop = {weight, weight_stride, x, x_stride};
    } else {
      args.scheduler.raster_order = schedule.raster;
      args.scheduler.max_swizzle_size = schedule.swizzle;
    }
    return args;
  }

  // CUTLASS's size queries of an (m, n, k) problem, on a launch without data: null tensors and a
  // table of null parameters (the tree's arguments read a.params[i], a null table would be
  // dereferenced)
  template <class Query>
  static auto query_sizes(int64_t m, int64_t n, int64_t k, int32_t sm_count, Query const& query) {
    FxParam none[Prog::kNumParams + 1] = {};
    FxGemmLaunch a{};
    a.params = none;
    a.num_params = Prog::kNumParams;
    a.m = m;
    a.n = n;
    a.k = k;
    a.sm_count = sm_count;
    return query(a);
  }

  static bool supports(int64_t m, int64_t n, int64_t k) {
    if (kBatchTrain && m < 2) return false;  // no unbiased variance of one row (eager raises)
    if (m > INT32_MAX || gemm_columns(n) > INT32_MAX || k > INT32_MAX) return false;
    return query_sizes(m, n, k, 1, [](const FxGemmLaunch& a) {
      return Gemm::can_implement(arguments(a, nullptr)) == cutlass::Status::kSuccess;
    });
  }

  static int64_t workspace_bytes(int64_t m, int64_t n, int64_t k, int32_t sm_count) {
    return query_sizes(m, n, k, sm_count,
                       [](const FxGemmLaunch& a) { return partials_offset(a) + 4 * partial_floats(a.m, a.n); });
  }

  static const char* launch(const FxGemmLaunch& a, void* stream) {
    float* partials = kReduces || kBatchTrain || kRowMap ? reinterpret_cast<float*>(static_cast<char*>(a.workspace) + partials_offset(a)) : nullptr;
    typename Gemm::Arguments args = arguments(a, partials);
    Gemm gemm;
    cutlass::Status status = gemm.initialize(args, a.workspace, static_cast<cudaStream_t>(stream));
    if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
    status = gemm.run(static_cast<cudaStream_t>(stream), nullptr, Cfg::kPdl);
    if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
    if constexpr (kReduces) {
      constexpr int kRowsABlock = kFinalizeThreads / 32;
      launch_after(Cfg::kPdl, finalize_rows<typename Prog::Finalize, Prog::kReduceKind, Out>,
                   dim3(static_cast<unsigned>((a.m + kRowsABlock - 1) / kRowsABlock)), dim3(kFinalizeThreads), 0,
                   static_cast<cudaStream_t>(stream), static_cast<const float*>(partials), static_cast<Out*>(a.out),
                   a.m, a.n, row_tiles<kTileN>(a.n), Prog::Finalize::args(a));
    }
    if constexpr (kRowMap) {
      launch_row_statistics<typename Prog::NormAffine, typename Prog::NormPost, Out, Prog::kRowStatistic,
                            Prog::kEpilogueN>(
          partials, static_cast<Out*>(a.out), a.m, a.n, Prog::kNormEps, Prog::NormPost::args(a),
          static_cast<cudaStream_t>(stream), Cfg::kPdl);
    }
    if constexpr (kBatchTrain) {
      launch_batch_norm<typename Prog::NormAffine, typename Prog::NormPost>(
          partials, static_cast<Out*>(a.out), a.stats, a.m, a.n, Prog::kNormEps, Prog::NormPost::args(a),
          static_cast<cudaStream_t>(stream), Cfg::kPdl);
    }
    const cudaError_t error = cudaGetLastError();
    return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
  }
};

}  // namespace fxg

// The macros below expand inside the generated module's own namespace (NS), which also defines
// `Menu` (an fxg::Menu) and, in main.cu, kUnits: FX_GEMM_UNIT(NAME) for each unit in index order.
// One configuration's entry points (a unit of its own); NAME tells a module's trees apart.
#define FX_DEFINE_GEMM_UNIT(PROG, KERNEL, NAME)                                                         \
  extern const int32_t tile_orders_##NAME = KERNEL::kTileOrders;                                        \
  int32_t supports_##NAME(int64_t m, int64_t n, int64_t k) {                                            \
    return fxg::GemmFor<PROG, KERNEL>::supports(m, n, k) ? 1 : 0;                                       \
  }                                                                                                    \
  int64_t workspace_##NAME(int64_t m, int64_t n, int64_t k, int32_t sms) {                              \
    return fxg::GemmFor<PROG, KERNEL>::workspace_bytes(m, n, k, sms);                                   \
  }                                                                                                    \
  const char* launch_##NAME(const FxGemmLaunch* a, void* stream) {                                     \
    return fxg::GemmFor<PROG, KERNEL>::launch(*a, stream);                                              \
  }

#define FX_DECLARE_GEMM_UNIT(NAME)                                                                     \
  extern const int32_t tile_orders_##NAME;                                                             \
  int32_t supports_##NAME(int64_t, int64_t, int64_t);                                                  \
  int64_t workspace_##NAME(int64_t, int64_t, int64_t, int32_t);                                        \
  const char* launch_##NAME(const FxGemmLaunch*, void*);
#define FX_GEMM_UNIT(NAME) fxg::Unit{tile_orders_##NAME, &supports_##NAME, &workspace_##NAME, &launch_##NAME}

// The module's FxGemmInfo, which dispatches a configuration to its unit (kUnits, in order):
// GATED_BLOCK is 0, or the gated tree's block, its units after the plain tree's.
#define FX_DEFINE_GEMM_INFO(PROG, ENTRY, GATED_BLOCK)                                                  \
  constexpr int kNumUnits = static_cast<int>(sizeof(kUnits) / sizeof(kUnits[0]));                      \
  static_assert(kNumUnits == (GATED_BLOCK > 0 ? 2 : 1) * Menu::kNumKernels, "one unit a kernel and tree"); \
  const fxg::Unit* unit_of(int32_t config) {                                                            \
    return config < 0 || config >= kNumUnits * fxg::kNumSchedules ? nullptr                             \
                                                                 : &kUnits[config / fxg::kNumSchedules]; \
  }                                                                                                     \
  int32_t supports(int64_t m, int64_t n, int64_t k, int32_t config) {                                   \
    const fxg::Unit* unit = unit_of(config);                                                            \
    return m >= 1 && unit != nullptr && config % fxg::kNumSchedules < unit->tile_orders && PROG::supports(n, k) \
               ? unit->supports(m, n, k)                                                                \
               : 0;                                                                                     \
  }                                                                                                     \
  int64_t workspace(int64_t m, int64_t n, int64_t k, int32_t sms, int32_t config) {                     \
    const fxg::Unit* unit = unit_of(config);                                                            \
    return unit != nullptr ? unit->workspace(m, n, k, sms) : 0;                                         \
  }                                                                                                     \
  const char* launch(const FxGemmLaunch* a, void* stream) {                                             \
    const fxg::Unit* unit = unit_of(a->config);                                                         \
    return unit != nullptr ? unit->launch(a, stream) : "fxfuse: no such GEMM configuration";            \
  }                                                                                                     \
  const FxGemmInfo kInfo = {FX_ABI_VERSION,                                                          \
                            PROG::kDtype,                                                            \
                            PROG::kOutDtype,                                                         \
                            PROG::kOutKind,                                                          \
                            PROG::kBatchTrain ? 1 : 0,                                               \
                            PROG::kChannelsDim1 ? 1 : 0,                                             \
                            PROG::kNumParams,                                                        \
                            PROG::kParamKinds,                                                       \
                            PROG::kParamDtypes,                                                      \
                            GATED_BLOCK,                                                             \
                            Menu::kNumConfigs,                                                       \
                            kNumUnits * fxg::kNumSchedules,                                          \
                            Menu::config_names<typename PROG::Element>(),                            \
                            &supports,                                                               \
                            &workspace,                                                              \
                            &launch};                                                                \
  extern "C" const FxGemmInfo* ENTRY() { return &kInfo; }
