// The row kernel template: one pass over the GEMM output that applies a whole epilogue program.
//
// A generated program module defines `struct Prog` (its stages as calls on a Row, see
// fxfuse/cuda/codegen.py) and instantiates FX_DEFINE_PROGRAM(Prog, T, entry). Everything that does
// not depend on the program (layout, loads and stores, statistics, launch plans) lives here once.
//
// Layout. A row of N values is split into chunks of VEC elements (16 bytes of T); the `rt` threads
// of a row own chunks lt, lt + rt, lt + 2 rt, ... (ITEMS of them), so every load instruction of a
// warp is contiguous and coalesced. Rows live in registers from load to store: v[ITEMS][VEC].
// A block holds `rpc` rows (several when a row needs fewer than 256 threads) and walks the rows
// with a block-uniform stride, so every barrier is reached by every thread; rows past M are
// "inactive": they load nothing, store nothing, and still take part in barriers. A row-local
// program (no statistic wider than a warp: pointwise chains, group norms of small groups, batch
// norms) cuts wide rows into `segs` segments of a few chunks a thread instead: many small blocks.
//
// Statistics are fp32: warp shuffles, then one slot a warp in shared memory, summed in a fixed
// order (deterministic). Group norms of up to 32 values follow eager's own Welford tree, bit for
// bit; larger groups whose chunks sit in a power of two of threads sum by shuffles, others write
// per-chunk partial sums of their row to shared memory and let one thread a group add them in
// order. BatchNorm training runs three kernels: column moments per strip of rows (Welford, on the
// values the preceding stages produce; a row-local program's rows cut into warp-wide segments, so
// that a short, wide output fills the device), a fixed-order Chan combine per column, then the row
// kernel.
//
// Files: row_memory.cuh (element types, memory access), row_args.cuh (kernel arguments),
// row_core.cuh (the row; its stages there and in row_norms.cuh, row_reductions.cuh,
// row_pooling.cuh, row_rotary.cuh), row_kernels.cuh (kernel bodies), this file (launch
// plans, the kernels, the exported entry points), row_grad.cuh and grad_epilogue.cuh (backward).
#pragma once

#include "row_kernels.cuh"

namespace fx {

// ---------------------------------------------------------------------------------------------
// Launching. Kernels of one chunk count (ITEMS) are compiled in their own translation unit
// (FX_ITEMS_UNIT, see codegen) so that a module's units build in parallel; the main unit holds
// the plan, the combine kernel and the exported entry points.

// Threads a block at most: rows wider than 256 chunks take 512 threads (N = 32768 at 64 floats a
// thread); the bound gives the compiler 128 registers a thread.
constexpr int kMaxBlock = 512;

// Column and full parameters: the ones a row reads a chunk at a time (Row::col_chunk, full_chunk)
constexpr bool is_vector_param(int32_t kind) { return kind == FX_PARAM_COL || kind == FX_PARAM_FULL; }

template <class Prog>
constexpr bool has_vector_params() {
  for (int k = 0; k < Prog::kNumParams; ++k)
    if (is_vector_param(Prog::kParamKinds[k])) return true;
  return false;
}

// Full parameters of a program (operands of the output's shape: a residual), whose chunks a row
// holds beside its own values
template <class Prog>
constexpr int full_params() {
  int count = 0;
  for (int k = 0; k < Prog::kNumParams; ++k) count += Prog::kParamKinds[k] == FX_PARAM_FULL;
  return count;
}

#if !defined(FX_EMULATE)
extern __shared__ float fx_dynamic_smem[];

// Blocks of kMaxBlock threads an SM must fit: two for the kernels of one 16-byte chunk a thread
// (at most 64 registers a thread), one above (128 registers for up to 64 floats a thread).
template <int ITEMS, int VEC>
constexpr int min_blocks() { return ITEMS * VEC <= 8 ? 2 : 1; }

// The apply kernel's blocks of kMaxBlock threads an SM must fit, by the values a thread holds (its
// row's, and its full parameters'): three up to 16 where its parameters are read by typed loads
// (42 registers a thread), two up to 16 of its row (64), one above (128). The pass is
// latency-bound, one row a block waiting on its loads and its reductions' barrier, and more rows
// in flight hide it. On an H200 at 4096 x 4096, 16 values a thread in 256 threads: S20's
// LayerNorm + SiLU took 96 registers and 43.4 us, 31.2 at 40; S21's RMSNorm + SiLU 30.5 us, 23.0
// at 40; a residual + LayerNorm (32 values) 39.1 us at 64, 40.5 at 40 (spills); parameters
// converted by their dtype at run time spill at 40 (BENCHMARKS.md section 31).
template <class Prog, int ITEMS, int VEC, bool PARAMS_T>
constexpr int apply_min_blocks() {
  const bool typed = PARAMS_T || !has_vector_params<Prog>();
  return typed && ITEMS * VEC * (1 + full_params<Prog>()) <= 16 ? 3 : ITEMS * VEC <= 16 ? 2 : 1;
}

template <class Prog, typename T, int ITEMS, bool ALIGNED, bool PARAMS_T>
__global__ void __launch_bounds__(kMaxBlock, apply_min_blocks<Prog, ITEMS, chunk_elements<Prog, T>(), PARAMS_T>())
    apply_kernel(const __grid_constant__ Args<Prog::kParamSlots> a) {
  __shared__ float red[FX_RED_FLOATS];
  const Thread t;
  apply_body<Prog, T, ITEMS, ALIGNED, PARAMS_T>(a, t, fx_dynamic_smem, red);
}

// The statistics kernel's blocks of one chunk a thread are 256 threads (Launcher::stats_plan):
// three a SM leave it 85 registers, its walk's rows and sums without spills.
template <class Prog, typename T, int ITEMS, bool ALIGNED>
__global__ void __launch_bounds__(ITEMS == 1 ? 256 : kMaxBlock, ITEMS == 1 ? 3 : min_blocks<ITEMS, chunk_elements<Prog, T>()>())
    stats_kernel(const __grid_constant__ Args<Prog::kParamSlots> a) {
  __shared__ float red[FX_RED_FLOATS];
  const Thread t;
  stats_body<Prog, T, ITEMS, ALIGNED>(a, t, fx_dynamic_smem, red);
}

template <class Prog>
__global__ void __launch_bounds__(kCombineBlock) combine_kernel(const __grid_constant__ Args<Prog::kParamSlots> a) {
  __shared__ Moments parts[kCombineBlock];
  const Thread t;
  combine_body<Prog>(a, t, parts);
}

// kernel<<<grid, block, smem, stream>>>(args), opting in to more than 48 KiB of shared memory
template <typename A>
inline const char* launch_kernel(void (*kernel)(A), int64_t grid, int block, size_t smem, void* stream,
                                 const A& args) {
  if (grid <= 0) return nullptr;
  if (smem > 48 * 1024) {
    const cudaError_t e = cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel),
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
    if (e != cudaSuccess) return cudaGetErrorString(e);
  }
  kernel<<<static_cast<unsigned>(grid), block, smem, static_cast<cudaStream_t>(stream)>>>(args);
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : cudaGetErrorString(e);
}
#else
// The emulator's launch: body(thread, dynamic smem, static smem) for every thread of the grid
template <class Body>
inline const char* emulate_kernel(int64_t grid, int block, size_t smem, const Body& body) {
  static thread_local std::string message;
  if (grid <= 0) return nullptr;
  try {
    emulate_launch(grid, block, smem, body);
  } catch (const std::exception& e) {
    message = e.what();
    return message.c_str();
  }
  return nullptr;
}
#endif

}  // namespace fx

#include "row_grad.cuh"

namespace fx {

// Whether every column and full parameter of a call is of dtype `code` (Row's PARAMS_T)
template <class Prog>
inline bool vector_params_of(const FxParam* params, int32_t code) {
  for (int k = 0; k < Prog::kNumParams; ++k)
    if (is_vector_param(Prog::kParamKinds[k]) && params[k].dtype != code) return false;
  return true;
}

struct Launch {  // one kernel launch's geometry
  int64_t grid;
  int block;
  size_t smem;
  void* stream;
};

// The row kernels of one ITEMS value; defined only in that value's translation unit.
template <class Prog, typename T, int ITEMS>
struct ItemsUnit {
  using A = Args<Prog::kParamSlots>;
  static const char* stats(const A& a, bool aligned, const Launch& l);
  static const char* apply(const A& a, bool aligned, bool params_t, const Launch& l);
  static const char* grad_rows(const A& a, bool aligned, const Launch& l);  // row programs' backward
};

#if defined(FX_ITEMS_UNIT)
template <class Prog, typename T, int ITEMS>
const char* ItemsUnit<Prog, T, ITEMS>::stats(const A& a, bool aligned, const Launch& l) {
  if constexpr (!Prog::kBatchTrain) {
    return "fxfuse: statistics kernel of a program without a training BatchNorm";
  } else {
#if !defined(FX_EMULATE)
    return aligned ? launch_kernel(&stats_kernel<Prog, T, ITEMS, true>, l.grid, l.block, l.smem, l.stream, a)
                   : launch_kernel(&stats_kernel<Prog, T, ITEMS, false>, l.grid, l.block, l.smem, l.stream, a);
#else
    return aligned ? emulate_kernel(l.grid, l.block, l.smem,
                                    [&a](const Thread& t, float* dyn, float* red) {
                                      stats_body<Prog, T, ITEMS, true>(a, t, dyn, red);
                                    })
                   : emulate_kernel(l.grid, l.block, l.smem, [&a](const Thread& t, float* dyn, float* red) {
                       stats_body<Prog, T, ITEMS, false>(a, t, dyn, red);
                     });
#endif
  }
}

template <class Prog, typename T, int ITEMS>
const char* ItemsUnit<Prog, T, ITEMS>::apply(const A& a, bool aligned, bool params_t, const Launch& l) {
  // the kernel of this (aligned, params_t); a program without column or full parameters has the
  // typed one only (the two would be the same)
  const auto run = [&](auto aligned_c, auto params_c) -> const char* {
    constexpr bool kAligned = decltype(aligned_c)::value, kParamsT = decltype(params_c)::value;
#if !defined(FX_EMULATE)
    return launch_kernel(&apply_kernel<Prog, T, ITEMS, kAligned, kParamsT>, l.grid, l.block, l.smem, l.stream, a);
#else
    return emulate_kernel(l.grid, l.block, l.smem, [&a](const Thread& t, float* dyn, float* red) {
      apply_body<Prog, T, ITEMS, kAligned, kParamsT>(a, t, dyn, red);
    });
#endif
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if constexpr (has_vector_params<Prog>()) {
    if (!params_t) return aligned ? run(Yes{}, No{}) : run(No{}, No{});
  }
  return aligned ? run(Yes{}, Yes{}) : run(No{}, Yes{});
}

template <class Prog, typename T, int ITEMS>
const char* ItemsUnit<Prog, T, ITEMS>::grad_rows(const A& a, bool aligned, const Launch& l) {
  if constexpr (!has_row_grad<Prog>()) {
    return "fxfuse: row backward kernel of a program without one";
  } else {
#if !defined(FX_EMULATE)
    return aligned ? launch_kernel(&row_grad_kernel<Prog, T, ITEMS, true>, l.grid, l.block, l.smem, l.stream, a)
                   : launch_kernel(&row_grad_kernel<Prog, T, ITEMS, false>, l.grid, l.block, l.smem, l.stream, a);
#else
    return aligned ? emulate_kernel(l.grid, l.block, l.smem,
                                    [&a](const Thread& t, float* dyn, float* red) {
                                      row_grad_body<Prog, T, ITEMS, true>(a, t, dyn, red);
                                    })
                   : emulate_kernel(l.grid, l.block, l.smem, [&a](const Thread& t, float* dyn, float* red) {
                       row_grad_body<Prog, T, ITEMS, false>(a, t, dyn, red);
                     });
#endif
  }
}
#endif  // FX_ITEMS_UNIT

struct Plan {
  int items;  // 16-byte chunks a thread
  int rt;     // threads a row (a row segment)
  int rpc;    // rows (row segments) a block
  int block;  // threads a block
  int segs;   // segments a row
};

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Shared-memory floats a row needs for a group norm of `groups` groups (the max over stages)
inline int64_t group_norm_scratch(int64_t so_far, int64_t n, int vec, int64_t groups) {
  const int64_t gs = groups > 0 ? n / groups : 0;
  const int64_t need = group_in_lanes(n, groups, vec) ? 0 : (gs % vec == 0) ? ceil_div(n, vec) : n;
  return need > so_far ? need : so_far;
}

// The chunk counts a thread that a program's units cover: 1, 2, 4, ... 64 / VEC.
template <class Prog, typename T>
constexpr int max_items() { return 64 / chunk_elements<Prog, T>(); }

template <class Prog, typename T>
struct Launcher {
  static constexpr int VEC = chunk_elements<Prog, T>();
  static constexpr int kMaxItems = max_items<Prog, T>();
  using A = Args<Prog::kParamSlots>;

  // Whole rows: the fewest chunks a thread that keep a row within 256 threads; failing that,
  // within kMaxBlock threads (programs with row statistics: fewer warps a row, cheaper barriers;
  // never one chunk a thread in more than 256: the statistics kernel's launch bounds).
  static bool row_plan(int64_t n, Plan* p) {
    if (n < 1 || n > FX_MAX_N) return false;
    const int64_t chunks = ceil_div(n, VEC);
    for (int pass = 0; pass < 2; ++pass) {
      for (int items = 1; items <= kMaxItems; items *= 2) {
        const int64_t need = ceil_div(chunks, items);
        const int64_t rt = threads_for(need);
        const int64_t limit = pass == 0 ? 256 : kMaxBlock;
        if (rt > limit) continue;
        *p = Plan{items, static_cast<int>(rt), rt >= 256 ? 1 : static_cast<int>(256 / rt), 0, 1};
        p->block = p->rt * p->rpc;
        return true;
      }
    }
    return false;
  }

  // The apply kernel's plan. A row-local program (no statistic wider than a warp) is an
  // elementwise pass in all but name: Prog::kLocalItems chunks a thread (or `items`, the
  // backward's choice) and rows cut into segments of up to 256 threads (a power of two, or a multiple of
  // 32: whole groups), so that many small blocks keep loads in flight and registers few; whole
  // rows would hold 16-64 values a thread. (Segments of a warp, eight rows a block sharing their
  // columns, measured slower on an H100: S02's and S04's group norms by 5-15%, S07's BatchNorm
  // apply by 15%.)
  static bool apply_plan(int64_t n, Plan* p, int items_a_thread = 0) {
    if (!Prog::row_local(n, VEC)) return row_plan(n, p);
    if (n < 1 || n > FX_MAX_N) return false;
    const int64_t chunks = ceil_div(n, VEC);
    int items = items_a_thread ? items_a_thread : Prog::kLocalItems;
    // a power of two the units cover, and whole warps a segment (so whole groups a segment)
    if (items > kMaxItems || (items & (items - 1)) || ceil_div(chunks, items) < 32) items = 1;
    const int64_t need = ceil_div(chunks, items);
    const int64_t segs = need >= 256 ? ceil_div(chunks, 256 * items) : 1;
    // the row spread evenly over its segments (N = 11008: 2 x 192 threads, not 256 + a last
    // segment two-thirds idle, which measured half the bandwidth on an H100)
    const int64_t rt = threads_for(ceil_div(chunks, segs * items));
    *p = Plan{items, static_cast<int>(rt), rt >= 256 ? 1 : static_cast<int>(256 / rt), 0, static_cast<int>(segs)};
    p->block = p->rt * p->rpc;
    return true;
  }

  // A row-local plan whose grid leaves SMs idle (decode: 16 rows of 8192 bf16 columns take 16
  // blocks of 256 threads at four chunks a thread, 64 at one, on 132 SMs): one chunk a thread and
  // each row cut into more, smaller segments, one a block, halved down to a warp until the grid
  // covers the SMs. Segments stay whole warps, so they keep whole groups and heads (power-of-two
  // lanes, at most 32: group_in_lanes, rotary_in_lanes); a row of fewer than 64 chunks is not cut.
  static void fill_device(int64_t m, int64_t n, int32_t sm_count, Plan* p) {
    const int64_t chunks = ceil_div(n, VEC);
    if (!Prog::row_local(n, VEC) || chunks < 64 || apply_grid(m, *p) >= sm_count) return;
    for (int64_t most = 256; most >= 32; most /= 2) {
      const int64_t segs = ceil_div(chunks, most);
      const int64_t rt = threads_for(ceil_div(chunks, segs));
      *p = Plan{1, static_cast<int>(rt), 1, static_cast<int>(rt), static_cast<int>(segs)};
      if (m * segs >= sm_count) return;
    }
  }

  // Threads for `need` chunks of a row: a power of two up to a warp, else whole warps.
  static int64_t threads_for(int64_t need) {
    int64_t rt = 1;
    if (need <= 32) {
      while (rt < need) rt *= 2;
      return rt;
    }
    return ceil_div(need, 32) * 32;
  }

  static int64_t apply_grid(int64_t m, const Plan& p) {
    const int64_t g = ceil_div(m, p.rpc) * p.segs;
    return g < (int64_t{1} << 30) ? g : (int64_t{1} << 30);
  }

  // The statistics kernel's plan (stats_body): a row-local program's rows in segments of a warp,
  // a chunk a thread, 256 / rt lanes a block (a 1024 x 8192 output: 32 segments x 12 strips of
  // blocks on 132 SMs, each lane 11 rows); other programs' whole rows (row_plan: one chunk a
  // thread only within 256 threads, the kernel's launch bounds).
  static bool stats_plan(int64_t n, Plan* p) {
    if (n >= 1 && n <= FX_MAX_N && Prog::row_local(n, VEC)) {
      const int64_t chunks = ceil_div(n, VEC);
      const int64_t rt = chunks >= 32 ? 32 : threads_for(chunks);
      *p = Plan{1, static_cast<int>(rt), static_cast<int>(256 / rt), 256, static_cast<int>(ceil_div(chunks, rt))};
      return true;
    }
    return row_plan(n, p);
  }

  // The statistics kernel's strips of rows (Args::chunks): enough blocks (segs a strip) to fill the
  // device once at the occupancy its launch bounds allow (768 threads an SM), and no more strips
  // than rows for a block's lanes.
  static int64_t stats_strips(int64_t m, const Plan& p, int32_t sm_count) {
    const int64_t per_sm = 768 / p.block > 0 ? 768 / p.block : 1;
    const int64_t blocks = static_cast<int64_t>(sm_count > 0 ? sm_count : 1) * per_sm;
    const int64_t strips = blocks / p.segs > 1 ? blocks / p.segs : 1;
    const int64_t most = ceil_div(m, p.rpc);
    return strips < most ? strips : most;
  }

  static size_t smem_bytes(int64_t n, const Plan& p) {
    return static_cast<size_t>(p.rpc) * static_cast<size_t>(Prog::scratch_floats(n, VEC)) * sizeof(float);
  }

  // The statistics kernel's: the walk's scratch, then its lanes' moments (stats_body's tree)
  static size_t stats_smem_bytes(int64_t n, const Plan& p) {
    const size_t merge = p.rpc > 1 ? static_cast<size_t>(p.block) * p.items * VEC * sizeof(float) : 0;
    return smem_bytes(n, p) > merge ? smem_bytes(n, p) : merge;
  }

  static int32_t supports(int64_t m, int64_t n, int32_t smem_optin) {
    Plan stats, apply;
    if (m < 1 || !stats_plan(n, &stats) || !apply_plan(n, &apply)) return 0;
    if (Prog::kBatchTrain && m < 2) return 0;
    if (!Prog::groups_ok(n) || Prog::out_width(n) < 1) return 0;
    const size_t stats_smem = Prog::kBatchTrain ? stats_smem_bytes(n, stats) : 0;
    const size_t smem = smem_bytes(n, apply) > stats_smem ? smem_bytes(n, apply) : stats_smem;
    if (smem > static_cast<size_t>(smem_optin)) return 0;
    return 1;
  }

  static int64_t workspace_floats(int64_t m, int64_t n, int32_t sm_count) {
    Plan p;
    if (!Prog::kBatchTrain || !stats_plan(n, &p)) return 0;
    return 2 * stats_strips(m, p, sm_count) * n + 3 * n;
  }

  static const char* launch(const FxLaunch* L, void* stream) {
    Plan stats, apply;
    if (!stats_plan(L->n, &stats) || !apply_plan(L->n, &apply)) {
      return "fxfuse: row width outside the kernel's range";
    }
    if (L->num_params != Prog::kNumParams) return "fxfuse: wrong number of parameters";
    A a = {};
    a.y = L->y;
    a.out = L->out;
    a.kept = L->kept;
    a.stats = L->stats;
    set_params<Prog>(a, L->params);
    a.m = L->m;
    a.n = static_cast<int32_t>(L->n);
    a.scratch_stride = static_cast<int32_t>(Prog::scratch_floats(L->n, VEC));
    a.flags = L->flags;
    const bool out_vec = (Prog::kOutKind != FX_OUT_ROWS || reinterpret_cast<uintptr_t>(L->out) % 16 == 0) &&
                         reinterpret_cast<uintptr_t>(L->kept) % 16 == 0;
    const bool aligned = L->n % VEC == 0 && Prog::out_width(L->n) % VEC == 0 &&
                         reinterpret_cast<uintptr_t>(L->y) % 16 == 0 && out_vec;
    if constexpr (Prog::kBatchTrain) {
      with_plan(a, stats);
      a.chunks = stats_strips(L->m, stats, L->sm_count);
      float* ws = L->workspace;
      a.part_mean = ws;
      a.part_m2 = ws + a.chunks * L->n;
      a.bn_mean = ws + 2 * a.chunks * L->n;
      a.bn_scale = a.bn_mean + L->n;
      a.bn_bias = a.bn_scale + L->n;
      const Launch l{a.chunks * stats.segs, stats.block, stats_smem_bytes(L->n, stats), stream};
      if (const char* err = with_items(stats.items, [&](auto items) {
            return ItemsUnit<Prog, T, decltype(items)::value>::stats(a, aligned, l);
          }))
        return err;
      if (const char* err = combine(a, Launch{ceil_div(L->n, kCombineColumns), combine_block(a.chunks), 0, stream}))
        return err;
    }
    fill_device(L->m, L->n, L->sm_count, &apply);
    with_plan(a, apply);
    const Launch l{apply_grid(L->m, apply), apply.block, smem_bytes(L->n, apply), stream};
    const bool params_t = vector_params_of<Prog>(L->params, DType<T>::kCode);
    return with_items(apply.items, [&](auto items) {
      return ItemsUnit<Prog, T, decltype(items)::value>::apply(a, aligned, params_t, l);
    });
  }

  static void with_plan(A& a, const Plan& p) {
    a.rt = p.rt;
    a.rpc = p.rpc;
    a.segs = p.segs;
  }

  // f(std::integral_constant<int, items>) for a chunk count this element type's units cover
  template <class F>
  static const char* with_items(int items, F f) {
    switch (items) {
      case 1: return f(std::integral_constant<int, 1>{});
      case 2: return f(std::integral_constant<int, 2>{});
      case 4: return f(std::integral_constant<int, 4>{});
      case 8: return f(std::integral_constant<int, 8>{});
      case 16:
        if constexpr (kMaxItems >= 16) return f(std::integral_constant<int, 16>{});
        return "fxfuse: bad launch plan";
      default: return "fxfuse: bad launch plan";
    }
  }

  static const char* combine(const A& a, const Launch& l) {
#if !defined(FX_EMULATE)
    return launch_kernel(&combine_kernel<Prog>, l.grid, l.block, l.smem, l.stream, a);
#else
    const size_t smem = static_cast<size_t>(l.block) * sizeof(Moments);
    return emulate_kernel(l.grid, l.block, smem, [&a](const Thread& t, float* dyn, float*) {
      combine_body<Prog>(a, t, reinterpret_cast<Moments*>(dyn));
    });
#endif
  }
};

}  // namespace fx

#include "grad_epilogue.cuh"

#if defined(_WIN32)
#define FX_EXPORT __declspec(dllexport)
#else
#define FX_EXPORT __attribute__((visibility("default")))
#endif

// In the main unit: `extern "C" const FxProgramInfo* ENTRY()` for program PROG on element type T.
#define FX_DEFINE_PROGRAM(PROG, T, ENTRY)                                                              \
  extern "C" FX_EXPORT const FxProgramInfo* ENTRY() {                                                \
    static const FxProgramInfo info = {FX_ABI_VERSION,                                               \
                                       fx::DType<T>::kCode,                                          \
                                       fx::DType<typename PROG::Out>::kCode,                         \
                                       PROG::kOutKind,                                               \
                                       PROG::kKeeps ? fx::DType<typename PROG::Kept>::kCode : -1,    \
                                       PROG::kBatchTrain ? 1 : 0,                                    \
                                       PROG::kChannelsDim1 ? 1 : 0,                                  \
                                       PROG::kNumParams,                                             \
                                       PROG::kParamKinds,                                            \
                                       &fx::Launcher<PROG, T>::supports,                             \
                                       &fx::Launcher<PROG, T>::workspace_floats,                     \
                                       &fx::Launcher<PROG, T>::launch,                               \
                                       PROG::kGradKind != fx::kNoGrad ? 1 : 0,                       \
                                       &fx::GradLauncher<PROG, T>::chunks,                           \
                                       &fx::GradLauncher<PROG, T>::launch,                           \
                                       &PROG::out_width};                                            \
    return &info;                                                                                    \
  }

// In the unit of ITEMS (compiled with FX_ITEMS_UNIT defined): that unit's kernels.
#define FX_DEFINE_ITEMS_UNIT(PROG, T, ITEMS) template struct fx::ItemsUnit<PROG, T, ITEMS>;
