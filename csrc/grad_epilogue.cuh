// The backward kernel of a pointwise program (norm and reduction programs: row_grad.cuh): one pass over the
// saved GEMM output y and the output's gradient g that writes the GEMM output's gradient dy and,
// in the same pass, the column sums the rest of the backward needs -- sum over rows of dy (the
// bias gradient) and of each parameter's gradient -- so that no later kernel reads dy again.
//
// `Prog::grad(x, g, p, dx, dp)` (generated, fxfuse/cuda/gradient.py) gives one element's
// gradients. Layout: a block is kGradCols threads along a row (one 16-byte chunk each) times
// kGradLanes rows; it walks a chunk of `rows` rows, the lanes taking every kGradLanes-th row, and
// keeps its column sums in registers. The lanes' sums meet in shared memory, are added in lane
// order by lane 0 and written to partial[s][chunk][column]: deterministic, no atomics. A second
// kernel adds the chunks in chunk order into sums[s][column] (with one chunk the first kernel
// writes the sums directly).
#pragma once

namespace fx {

constexpr int kGradCols = 32;
constexpr int kGradLanes = 8;
constexpr int kGradBlock = kGradCols * kGradLanes;

template <int P>
struct GradArgs {
  const void* y;
  const void* g;
  void* dy;
  float* partial;  // [1 + num_params][chunks][n]
  const void* pptr[P];
  int32_t pdtype[P];
  int32_t pkind[P];  // FxParamKind: FX_PARAM_COL (N values) or FX_PARAM_SCALAR
  int32_t prows[P];  // a head table's rows, as Args (set_params fills both; no backward reads one)
  int64_t m;
  int64_t chunks;    // chunks of rows
  int64_t rows;      // rows a chunk (a multiple of kGradLanes)
  int32_t n;
  int32_t col_blocks;
};

template <class Prog, typename T, int VEC>
FX_DEVICE void grad_body(const GradArgs<Prog::kParamSlots>& a, const Thread& t, float* smem) {
  constexpr int P = Prog::kNumParams;
  constexpr int S = 1 + P;
  constexpr int kSlots = Prog::kParamSlots;
  const int cl = t.tid() % kGradCols;
  const int lane = t.tid() / kGradCols;
  const int64_t block_col = t.bid() % a.col_blocks;
  const int64_t chunk = t.bid() / a.col_blocks;
  const int64_t c0 = (block_col * kGradCols + cl) * VEC;
  const bool active = c0 < a.n;  // VEC > 1 only when n is a multiple of VEC: whole chunks

  float pv[kSlots][VEC];
#pragma unroll
  for (int k = 0; k < kSlots; ++k)
#pragma unroll
    for (int e = 0; e < VEC; ++e) pv[k][e] = 0.0f;
  if (active) {
#pragma unroll
    for (int k = 0; k < P; ++k)
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        pv[k][e] = load_param(a.pptr[k], a.pdtype[k], a.pkind[k] == FX_PARAM_COL ? c0 + e : 0);
  }
  float sums[S][VEC];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int e = 0; e < VEC; ++e) sums[s][e] = 0.0f;

  const int64_t r_end = (chunk + 1) * a.rows < a.m ? (chunk + 1) * a.rows : a.m;
  if (active) {
    for (int64_t r = chunk * a.rows + lane; r < r_end; r += kGradLanes) {
      const int64_t i = r * a.n + c0;
      float x[VEC], g[VEC], d[VEC];
      if constexpr (VEC > 1) {
        Mem<T>::load_vec(a.y, i, x);
        Mem<T>::load_vec(a.g, i, g);
      } else {
        x[0] = Mem<T>::load(a.y, i);
        g[0] = Mem<T>::load(a.g, i);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float p[kSlots], dp[kSlots];
#pragma unroll
        for (int k = 0; k < kSlots; ++k) {
          p[k] = pv[k][e];
          dp[k] = 0.0f;
        }
        float dx;
        Prog::grad(x[e], g[e], p, dx, dp);
        d[e] = round_to<T>(dx);  // the stored gradient is what eager sums for the bias
        sums[0][e] += d[e];
#pragma unroll
        for (int k = 0; k < P; ++k) sums[1 + k][e] += dp[k];
      }
      if constexpr (VEC > 1) {
        Mem<T>::store_vec_rounded(a.dy, i, d);
      } else {
        Mem<T>::store_rounded(a.dy, i, d[0]);
      }
    }
  }
  // the lanes' sums, one sum at a time through kGradBlock * VEC floats of shared memory
#pragma unroll
  for (int s = 0; s < S; ++s) {
#pragma unroll
    for (int e = 0; e < VEC; ++e) smem[(lane * kGradCols + cl) * VEC + e] = sums[s][e];
    t.sync();
    if (lane == 0 && active) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float total = smem[cl * VEC + e];
        for (int l = 1; l < kGradLanes; ++l) total += smem[(l * kGradCols + cl) * VEC + e];
        a.partial[(s * a.chunks + chunk) * a.n + c0 + e] = total;
      }
    }
    t.sync();
  }
}

// sums[i] = the sum over chunks of partial[s][chunk][c], i = s * n + c: a block is 32 columns
// times kGradSumsParts fixed ranges of chunks, each range added in order, then the ranges in
// order (deterministic); a warp reads 32 consecutive columns of a chunk at a time.
struct GradSumsArgs {
  const float* partial;
  float* sums;
  int64_t chunks;
  int64_t n;
  int64_t total;  // (1 + num_params) * n
};
constexpr int kGradSumsCols = 32;
constexpr int kGradSumsParts = 8;
constexpr int kGradSumsBlock = kGradSumsCols * kGradSumsParts;

FX_DEVICE void grad_sums_body(const GradSumsArgs& a, const Thread& t, float* parts) {
  const int lane = t.tid() % kGradSumsCols;
  const int part = t.tid() / kGradSumsCols;
  const int64_t i = static_cast<int64_t>(t.bid()) * kGradSumsCols + lane;
  const int64_t per = (a.chunks + kGradSumsParts - 1) / kGradSumsParts;
  const int64_t k0 = part * per;
  const int64_t k1 = k0 + per < a.chunks ? k0 + per : a.chunks;
  float total = 0.0f;
  if (i < a.total) {
    const float* p = a.partial + (i / a.n) * a.chunks * a.n + i % a.n;
    for (int64_t k = k0; k < k1; ++k) total += p[k * a.n];
  }
  parts[t.tid()] = total;
  t.sync();
  if (part != 0 || i >= a.total) return;
  float sum = parts[lane];
  for (int q = 1; q < kGradSumsParts; ++q) sum += parts[q * kGradSumsCols + lane];
  a.sums[i] = sum;
}

#if !defined(FX_EMULATE)
template <class Prog, typename T, int VEC>
__global__ void __launch_bounds__(kGradBlock) grad_kernel(const __grid_constant__ GradArgs<Prog::kParamSlots> a) {
  __shared__ float smem[kGradBlock * VEC];
  const Thread t;
  grad_body<Prog, T, VEC>(a, t, smem);
}

// a template only so that every unit of a module may define it (one definition at link time)
template <int kBlock = kGradSumsBlock>
__global__ void __launch_bounds__(kBlock) grad_sums_kernel(const __grid_constant__ GradSumsArgs a) {
  __shared__ float parts[kBlock];
  grad_sums_body(a, Thread(), parts);
}
#endif

// The row programs' backward (row_grad.cuh): the apply kernel's plan where a group norm's
// statistics take the forward's shuffle path (every group norm of the suite; others fall back).
template <class Prog, typename T>
struct RowGradLauncher {
  using Rows = Launcher<Prog, T>;
  static constexpr int VEC = Rows::VEC;

  // A row-local program (a group norm of small groups, an eval-mode BatchNorm) takes one chunk a
  // thread, whatever its forward takes: the kernel's state (a column sum a parameter, the
  // gradient, the row) spills at more
  static bool plan(int64_t m, int64_t n, Plan* p) {
    if (m < 1 || !Prog::groups_ok(n) || !Rows::apply_plan(n, p, 1)) return false;
    if (p->items == 1 && p->block > 256) return false;  // the kernel's launch bounds
    if (Prog::kGradKind != kNormGrad || Prog::kNormKind != kGroupNorm) return true;
    const int64_t gs = n / Prog::kNormGroups;
    const int64_t lanes = gs / VEC;
    return gs % VEC == 0 && lanes >= 1 && (lanes & (lanes - 1)) == 0 && p->rt % lanes == 0;
  }

  // Strips of rows a segment: the blocks an SM holds at once, 512 threads (768 at one chunk a
  // thread: row_grad_min_blocks) -- each strip's column sums cost a write and a read of n floats
  // a sum, so no more -- and at most one a row slot
  static int64_t strips(int64_t m, const Plan& p, int32_t sm_count) {
    const int64_t threads = p.items == 1 ? 768 : 512;
    const int64_t per_sm = threads / p.block > 0 ? threads / p.block : 1;
    const int64_t want = (sm_count > 0 ? sm_count : 1) * per_sm / p.segs;
    const int64_t rows = ceil_div(m, p.rpc);
    return want < 1 ? 1 : (want < rows ? want : rows);
  }

  static int64_t chunks(int64_t m, int64_t n, int32_t sm_count) {
    Plan p;
    if (m < 1 || n < 1) return 0;
    return plan(m, n, &p) ? strips(m, p, sm_count) * p.rpc : -1;
  }

  static const char* launch(const FxGradLaunch* L, void* stream) {
    Plan p;
    if (L->m < 1 || L->n < 1) return nullptr;
    if (!plan(L->m, L->n, &p)) return "fxfuse: row width outside the backward kernel's range";
    Args<Prog::kParamSlots> a = {};
    a.y = L->y;
    a.g = L->g;
    a.dy = L->dy;
    set_params<Prog>(a, L->params);
    a.m = L->m;
    a.n = static_cast<int32_t>(L->n);
    a.flags = L->flags;
    Rows::with_plan(a, p);
    const int64_t strips_ = strips(L->m, p, L->sm_count);
    a.chunks = strips_ * p.rpc;
    a.partial = a.chunks == 1 ? L->sums : L->partial;
    const auto aligned16 = [](const void* q) { return reinterpret_cast<uintptr_t>(q) % 16 == 0; };
    const bool aligned = L->n % VEC == 0 && aligned16(L->y) && aligned16(L->g) && aligned16(L->dy) &&
                         aligned16(a.partial);
    const Launch l{strips_ * p.segs, p.block, 0, stream};
    return Rows::with_items(p.items, [&](auto items) {
      return ItemsUnit<Prog, T, decltype(items)::value>::grad_rows(a, aligned, l);
    });
  }
};

// Adds the chunks' column sums in order (sums = partial when there is one chunk)
inline const char* launch_grad_sums(const FxGradLaunch* L, int64_t chunks, int num_params, void* stream) {
  if (chunks <= 1) return nullptr;
  const GradSumsArgs s = {L->partial, L->sums, chunks, L->n, (1 + num_params) * L->n};
  const int64_t sums_grid = ceil_div(s.total, kGradSumsCols);
#if !defined(FX_EMULATE)
  return launch_kernel(&grad_sums_kernel<>, sums_grid, kGradSumsBlock, 0, stream, s);
#else
  return emulate_kernel(sums_grid, kGradSumsBlock, kGradSumsBlock * sizeof(float),
                        [&s](const Thread& t, float* dyn, float*) { grad_sums_body(s, t, dyn); });
#endif
}

template <class Prog, typename T>
struct GradLauncher {
  static constexpr int VEC = DType<T>::kVec;
  static constexpr bool kRowGrad = has_row_grad<Prog>();

  // Rows a chunk: enough blocks for about eight a multiprocessor, at least one row a lane.
  static int64_t rows_per_chunk(int64_t m, int64_t n, int32_t sm_count) {
    const int64_t col_blocks = ceil_div(ceil_div(n, VEC), kGradCols);
    const int64_t want = ceil_div(int64_t{8} * (sm_count > 0 ? sm_count : 1), col_blocks);
    int64_t rows = ceil_div(ceil_div(m, want), kGradLanes) * kGradLanes;
    return rows < kGradLanes ? kGradLanes : rows;
  }

  // -1 where the kernel does not cover (m, n): the caller falls back to the reference
  static int64_t chunks(int64_t m, int64_t n, int32_t sm_count) {
    if constexpr (kRowGrad) return RowGradLauncher<Prog, T>::chunks(m, n, sm_count);
    if (Prog::kGradKind != kPointwiseGrad) return -1;
    if (m < 1 || n < 1) return 0;
    return ceil_div(m, rows_per_chunk(m, n, sm_count));
  }

  static const char* launch(const FxGradLaunch* L, void* stream) {
    if constexpr (kRowGrad) {
      if (L->num_params != Prog::kNumParams) return "fxfuse: wrong number of parameters";
      if (const char* error = RowGradLauncher<Prog, T>::launch(L, stream)) return error;
      return launch_grad_sums(L, chunks(L->m, L->n, L->sm_count), Prog::kNumParams, stream);
    } else if constexpr (Prog::kGradKind != kPointwiseGrad) {
      (void)L;
      (void)stream;
      return "fxfuse: this program has no generated backward";
    } else {
      if (L->num_params != Prog::kNumParams) return "fxfuse: wrong number of parameters";
      if (L->m < 1 || L->n < 1) return nullptr;
      GradArgs<Prog::kParamSlots> a = {};
      a.y = L->y;
      a.g = L->g;
      a.dy = L->dy;
      set_params<Prog>(a, L->params);
      for (int k = 0; k < Prog::kNumParams; ++k) a.pkind[k] = Prog::kParamKinds[k];
      a.m = L->m;
      a.n = static_cast<int32_t>(L->n);
      a.rows = rows_per_chunk(L->m, L->n, L->sm_count);
      a.chunks = ceil_div(L->m, a.rows);
      a.partial = a.chunks == 1 ? L->sums : L->partial;
      const auto aligned16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
      const bool vec = L->n % VEC == 0 && aligned16(L->y) && aligned16(L->g) && aligned16(L->dy);
      const int64_t cols = vec ? ceil_div(L->n, VEC) : L->n;
      a.col_blocks = static_cast<int32_t>(ceil_div(cols, kGradCols));
      const int64_t grid = a.col_blocks * a.chunks;
      if (const char* error = launch_grad(a, vec, grid, stream)) return error;
      return launch_grad_sums(L, a.chunks, Prog::kNumParams, stream);
    }
  }

  static const char* launch_grad(const GradArgs<Prog::kParamSlots>& a, bool vec, int64_t grid, void* stream) {
#if !defined(FX_EMULATE)
    return vec ? launch_kernel(&grad_kernel<Prog, T, VEC>, grid, kGradBlock, 0, stream, a)
               : launch_kernel(&grad_kernel<Prog, T, 1>, grid, kGradBlock, 0, stream, a);
#else
    (void)stream;
    const size_t smem = static_cast<size_t>(kGradBlock) * (vec ? VEC : 1) * sizeof(float);
    return vec ? emulate_kernel(grid, kGradBlock, smem, [&a](const Thread& t, float* dyn, float*) {
      grad_body<Prog, T, VEC>(a, t, dyn);
    })
               : emulate_kernel(grid, kGradBlock, smem, [&a](const Thread& t, float* dyn, float*) {
                   grad_body<Prog, T, 1>(a, t, dyn);
                 });
#endif
  }
};

}  // namespace fx
