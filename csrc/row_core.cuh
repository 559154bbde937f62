// One row in registers (fx::Row) and the stages a program applies to it: pointwise stages,
// norms (group, layer, RMS, batch), row reductions and row maps, each reading and writing the
// register-resident row; statistics in float32 by shuffles and a fixed-order shared-memory sum.
#pragma once

#include "row_args.cuh"
#include "row_random.cuh"

namespace fx {

// ---------------------------------------------------------------------------------------------
// One row in registers, and the stages a program applies to it

// PARAMS_T: every column and full parameter of the call is of T's dtype (the apply kernel's launch
// checks), so they are read by typed loads; otherwise each is converted by its dtype, read at run
// time, by selects: about five instructions a value a parameter more (on an H200, S20's LayerNorm
// weight and bias: its pass 9 % slower, S21's RMSNorm weight 7 %).
template <class Prog, typename T, int ITEMS, bool ALIGNED, bool PARAMS_T = false>
struct Row {
  static constexpr int VEC = chunk_elements<Prog, T>();
  using A = Args<Prog::kParamSlots>;

  const A& a;
  const Thread& t;
  float* red;      // FX_RED_FLOATS floats of shared memory for cross-warp reductions
  float* scratch;  // this row's scratch_stride floats of dynamic shared memory
  int lt;          // thread index within the row (segment)
  int lr;          // row (segment) index within the block
  int64_t row;
  int n;           // the row's width: the GEMM's, until a pooling narrows it (Pool stages)
  int first;       // the segment's first column
  bool active;
  float v[ITEMS][VEC];

  // Segment `seg` of row `row_` (a segment is rt threads of ITEMS chunks: whole groups of a
  // row-local program, see Launcher::apply_plan); rows at M or past it are inactive.
  FX_DEVICE Row(const A& a_, const Thread& t_, float* red_, float* scratch_, int lt_, int lr_, int64_t row_, int seg)
      : a(a_), t(t_), red(red_), scratch(scratch_), lt(lt_), lr(lr_), row(row_), n(a_.n),
        first(seg * a_.rt * ITEMS * VEC), active(row_ < a_.m) {}

  FX_DEVICE int col(int i, int e) const { return first + (i * a.rt + lt) * VEC + e; }

  // Every element of the row becomes s: a row reduction's value, broadcast back against
  // per-column values (its stores and later stages mask the columns past the row's end)
  FX_DEVICE void fill(float s) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) v[i][e] = s;
  }

  FX_DEVICE void load() {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) load_chunk(i, v[i]);
  }

  // chunk i of the row's GEMM output (zeros past the row's end and for inactive rows)
  FX_DEVICE void load_chunk(int i, float (&out)[VEC]) const {
    const int64_t base = row * a.n;
    const int c0 = col(i, 0);
    if constexpr (ALIGNED) {
      if (active && c0 < a.n) {
        if constexpr (VEC == DType<T>::kVec) {
          Mem<T>::load_vec(a.y, base + c0, out);
        } else {
          Mem<T>::load_vec4(a.y, base + c0, out);
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) out[e] = 0.0f;
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) out[e] = (active && c0 + e < a.n) ? Mem<T>::load(a.y, base + c0 + e) : 0.0f;
    }
  }

  // The output is of the program's type Out: T, or float for a chain that widened; a chunk of it
  // is one 16-byte vector, or two (chunk_elements).
  using Out = typename Prog::Out;
  static constexpr int OUT_VEC = DType<Out>::kVec;
  static_assert(VEC % OUT_VEC == 0, "the output type is T or float");

  FX_DEVICE void store_rows() const { store_rows_to<Out>(a.out); }

  // The keep() stage: the row's values as they are here, the program's second output (Prog::Kept)
  FX_DEVICE void store_kept() const { store_rows_to<typename Prog::Kept>(a.kept); }

  template <class U>
  FX_DEVICE void store_rows_to(void* dst) const {
    constexpr int U_VEC = DType<U>::kVec;
    static_assert(VEC % U_VEC == 0, "the stored type is T or float");
    if (!active) return;
    const int64_t base = row * n;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = col(i, 0);
      if constexpr (ALIGNED) {
        if (c0 < n)
#pragma unroll
          for (int k = 0; k < VEC; k += U_VEC) Mem<U>::store_vec(dst, base + c0 + k, v[i] + k);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (c0 + e < n) Mem<U>::store(dst, base + c0 + e, v[i][e]);
      }
    }
  }

  FX_DEVICE void store_scalar(float s) const {
    if (active && lt == 0) Mem<Out>::store(a.out, row, s);
  }

  template <int K>
  FX_DEVICE float scalar_param() const {
    return load_param(a.pptr[K], a.pdtype[K], 0);
  }

  // Row parameter K (M values, one a row: a per-row scale) at this row; zero for inactive rows.
  template <int K>
  FX_DEVICE float row_param() const {
    return active ? load_param(a.pptr[K], a.pdtype[K], row) : 0.0f;
  }

  // Column parameter K at chunk i's VEC columns, clamped to the row like map()'s columns: one or
  // two 16-byte loads when the row is aligned (the runtime aligns parameters to 16 bytes).
  template <int K>
  FX_DEVICE void col_chunk(int i, float (&p)[VEC]) const {
    const int c0 = col(i, 0);
    if constexpr (ALIGNED) {
      param_vec_at<K>(c0 < a.n ? c0 : a.n - VEC, p);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int c = c0 + e;
        p[e] = param_at<K>(c < a.n ? c : a.n - 1);
      }
    }
  }

  // Parameter K's element `at`, and its VEC elements from `at` on (a multiple of VEC; parameters
  // are 16-byte aligned): typed loads where PARAMS_T, else converted by the parameter's dtype
  template <int K>
  FX_DEVICE float param_at(int64_t at) const {
    if constexpr (PARAMS_T) {
      return Mem<T>::load(a.pptr[K], at);
    } else {
      return load_param(a.pptr[K], a.pdtype[K], at);
    }
  }

  template <int K>
  FX_DEVICE void param_vec_at(int64_t at, float (&p)[VEC]) const {
    if constexpr (!PARAMS_T) {
      load_param_vec<VEC>(a.pptr[K], a.pdtype[K], at, p);
    } else if constexpr (VEC == DType<T>::kVec) {
      Mem<T>::load_vec(a.pptr[K], at, p);
    } else {
      Mem<T>::load_vec4(a.pptr[K], at, p);
    }
  }

  // Full parameter K (M x N, the output's shape: a residual, a gate; or P x N broadcast along the
  // leading dims, prows[K] = P: row r mod P) at chunk i of this row: read like the GEMM output (16
  // bytes at a time when the row is aligned; the runtime aligns the tensor's start, and ALIGNED
  // rows of T are aligned rows of every parameter dtype), zeros past the row's end and for inactive
  // rows.
  template <int K>
  FX_DEVICE void full_chunk(int i, float (&p)[VEC]) const {
    const int64_t base = (a.prows[K] > 0 ? row % a.prows[K] : row) * a.n;
    const int c0 = col(i, 0);
    if constexpr (ALIGNED) {
      if (active && c0 < a.n) {
        param_vec_at<K>(base + c0, p);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) p[e] = 0.0f;
      }
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        p[e] = (active && c0 + e < a.n) ? param_at<K>(base + c0 + e) : 0.0f;
    }
  }

  FX_DEVICE void chunk_of(const void* ptr, int32_t dtype, int i, float (&p)[VEC]) const {
    const int c0 = col(i, 0);
    if constexpr (ALIGNED) {
      load_param_vec<VEC>(ptr, dtype, c0 < a.n ? c0 : a.n - VEC, p);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int c = c0 + e;
        p[e] = load_param(ptr, dtype, c < a.n ? c : a.n - 1);
      }
    }
  }

  // f(chunk i's VEC values, i) for every chunk: the generated pointwise stages, which load each
  // column parameter once a chunk
  template <class F>
  FX_DEVICE void map_chunks(F f) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) f(v[i], i);
  }

  // v = f(v, column) on every element slot. Slots past the row's end (and rows past M) compute on
  // don't-care values that are never stored or reduced; their column is clamped to n - 1 so that
  // f only reads in bounds. No predicates: the common case is branch-free.
  template <class F>
  FX_DEVICE void map(F f) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int c = col(i, e);
        v[i][e] = f(v[i][e], c < n ? c : n - 1);
      }
  }

  // op over the row, the same value in every thread of the row: shuffles, then across warps a slot
  // a warp and one barrier. Consecutive reductions take alternate sets of slots (Thread::red_set,
  // counted alike in every thread of the block, as every thread reaches every reduction), so a
  // reduction's writes never meet the reads of the one before it, which the barrier of the
  // one between has waited out: none waits for the slowest warp's reads before going on.
  template <class Op>
  FX_DEVICE float allreduce(float x, Op op) const {
    const int width = a.rt < 32 ? a.rt : 32;
    for (int off = width >> 1; off > 0; off >>= 1) x = op(x, t.shfl_xor(x, off));
    if (a.rt <= 32) return x;
    const int wpr = a.rt >> 5;
    float* slots = red + FX_RED_ITEMS_FLOATS + 16 * t.red_set;
    t.red_set ^= 1;
    if ((t.tid() & 31) == 0) slots[t.tid() >> 5] = x;
    t.sync();
    const int first = lr * wpr;
    float r = slots[first];
    for (int w = 1; w < wpr; ++w) r = op(r, slots[first + w]);
    return r;
  }

  // op over f(element) of the row, from `init`. Slots past the row's end are left out a chunk at a
  // time where rows are whole chunks (ALIGNED), one compare a chunk, not one a value; an inactive
  // row's result is never used (its stores are skipped), so it is not masked at all.
  template <class Op, class F>
  FX_DEVICE float reduce(float init, Op op, F f) const {
    float acc = init;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = col(i, 0);
      if constexpr (ALIGNED) {
        if (c0 < n)
#pragma unroll
          for (int e = 0; e < VEC; ++e) acc = op(acc, f(v[i][e]));
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (c0 + e < n) acc = op(acc, f(v[i][e]));
      }
    }
    return allreduce(acc, op);
  }

  FX_DEVICE float reduce_sum() const { return reduce(0.0f, OpAdd(), [](float x) { return x; }); }
  FX_DEVICE float reduce_mean() const { return reduce_sum() / static_cast<float>(n); }
  FX_DEVICE float reduce_max() const { return reduce(-INFINITY, OpMax(), [](float x) { return x; }); }
  FX_DEVICE float reduce_min() const { return reduce(INFINITY, OpMin(), [](float x) { return x; }); }

  // torch.logsumexp: the max is replaced by 0 where it is infinite
  FX_DEVICE float reduce_logsumexp() const {
    float m = reduce_max();
    if (fabsf(m) == INFINITY) m = 0.0f;
    const float s = reduce(0.0f, OpAdd(), [m](float x) { return fx_expf(x - m); });
    return logf(s) + m;
  }

  // torch.linalg.vector_norm(ord=2): the square root of the row's sum of squares
  FX_DEVICE float reduce_vector_norm() const { return sqrtf(reduce(0.0f, OpAdd(), [](float x) { return x * x; })); }

  // exp(x - m) <= 1: the rule's exponential (fx_expf) cannot overflow where libm's does not;
  // under the rule one reciprocal a row and a product a value, in place of an IEEE division each
  FX_DEVICE void softmax() {
    const float m = reduce_max();
    map([m](float x, int) { return fx_expf(x - m); });
    const float s = reduce_sum();
#if defined(FX_RULE_MATH)
    const float r = 1.0f / s;
    map([r](float x, int) { return x * r; });
#else
    map([s](float x, int) { return x / s; });
#endif
  }

  // torch.var / torch.std: the squared deviations from the row's mean m over max(0, n - correction)
  FX_DEVICE float reduce_var_about(float m, float correction) const {
    const float d = fmaxf(0.0f, static_cast<float>(n) - correction);
    return reduce(0.0f, OpAdd(), [m](float x) { return (x - m) * (x - m); }) / d;
  }

  FX_DEVICE float reduce_var(float correction) const { return reduce_var_about(reduce_mean(), correction); }

  FX_DEVICE float reduce_std(float correction) const { return sqrtf(reduce_var(correction)); }

  // F.normalize(p=2): the row over clamp_min(its norm, eps) (a NaN norm stays NaN, as clamp_min's)
  FX_DEVICE static float normalize_divisor(float norm, float eps) { return norm < eps ? eps : norm; }

  FX_DEVICE void normalize(float eps) {
    const float d = normalize_divisor(reduce_vector_norm(), eps);
    map([d](float x, int) { return x / d; });
  }

  FX_DEVICE void log_softmax() {
    const float m = reduce_max();
    const float s = reduce(0.0f, OpAdd(), [m](float x) { return fx_expf(x - m); });
    const float log_s = logf(s);
    map([m, log_s](float x, int) { return (x - m) - log_s; });
  }

  // Every norm ends here: v = (v - shift) * scale * w + b (the last two as one fma, as eager's CUDA
  // norms compile), its output for U (norm_output: rounded to U as eager's norm of a U input
  // returns it, or under the rule float32 until the store). U, every norm's first
  // template argument, is the dtype the norm computes for: T, or float once the chain widened
  // (a float32 norm of autocast or type promotion). `shift_scale(i, shift, scale)` fills chunk
  // i's VEC shifts and scales.
  template <typename U, int W, int B, class F>
  FX_DEVICE void normalise(F shift_scale) {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float shift[VEC], scale[VEC], w[VEC], b[VEC];
      shift_scale(i, shift, scale);
      if constexpr (W >= 0) col_chunk<W>(i, w);
      if constexpr (B >= 0) col_chunk<B>(i, b);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float y = (v[i][e] - shift[e]) * scale[e];
        if constexpr (W >= 0 && B >= 0) {
          y = fx_fma(y, w[e], b[e]);  // eager: (x - mean) * rstd * w + b, contracted
        } else if constexpr (W >= 0) {
          y = y * w[e];
        } else if constexpr (B >= 0) {
          y = y + b[e];
        }
        v[i][e] = norm_output<U>(y);
      }
    }
  }

  // shift and scale the same for a whole chunk
  template <typename U, int W, int B, class F>
  FX_DEVICE void normalise_by_chunk(F shift_scale_of_chunk) {
    normalise<U, W, B>([&](int i, float* shift, float* scale) {
      float sh, sc;
      shift_scale_of_chunk(i, sh, sc);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        shift[e] = sh;
        scale[e] = sc;
      }
    });
  }

  // The row's values into its scratch (n floats: Prog::scratch_floats), each at its column, for a
  // stage that reads other columns' (pooling, a rotary embedding's partners); whole rows a segment.
  FX_DEVICE void to_scratch() {
    if (active) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (col(i, e) < n) scratch[col(i, e)] = v[i][e];
    }
    t.sync();
  }

  // Pooling along the features (a Pool stage): windows of K values, S apart, every one inside the
  // row; the row narrows to (n - K) / S + 1 values, the mean of each window (Max: its max, NaN where
  // it holds one, as eager's), which later stages and the store see. Through the row's scratch
  // (n floats: Prog::scratch_floats); whole rows a segment (Prog::row_local is false).
  template <bool Max, int K, int S>
  FX_DEVICE void pool() {
    to_scratch();
    const int width = (n - K) / S + 1;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int c = col(i, e);
        if (!active || c >= width) {
          v[i][e] = 0.0f;  // past the narrowed row: never stored or reduced
          continue;
        }
        const float* w = scratch + c * S;
        float acc = Max ? -INFINITY : 0.0f;
        for (int k = 0; k < K; ++k) {
          if constexpr (Max) {
            if (w[k] > acc || w[k] != w[k]) acc = w[k];  // eager's max pooling: a NaN wins
          } else {
            acc += w[k];
          }
        }
        v[i][e] = Max ? acc : acc / static_cast<float>(K);
      }
    t.sync();  // the scratch is free again (a later stage, the next row)
    n = width;
  }
  template <int K, int S>
  FX_DEVICE void pool_avg() { pool<false, K, S>(); }
  template <int K, int S>
  FX_DEVICE void pool_max() { pool<true, K, S>(); }

  // Attention's rotary embedding (a Rotary stage) of every head of D columns: y * cos + rot(y) *
  // sin, rot(y)[j] = -y[j + D/2] for j < D/2 and y[j - D/2] after, cos and sin the head tables C and
  // S (P rows of D values; row r reads table row r mod P). Each product and the sum rounded to U as
  // eager's three ops round them. Row-local where the heads pair by lanes (rotary_in_lanes), else
  // whole rows a segment.
  template <typename U, int D, int C, int S>
  FX_DEVICE void rotary() {
    static_assert(D % 2 == 0, "heads of an even width");
    if constexpr (rotary_in_lanes(D, D, VEC)) {
      if (a.rt % (D / VEC) == 0) {  // the same for the whole block: no lane skips the shuffles
        rotary_by_lanes<U, D, C, S>();
        return;
      }
    }
    rotary_by_scratch<U, D, C, S>();
  }

  // One rotated value: y * cos + partner * sin (the partner signed), each product and the sum
  // rounded to U as eager's three ops round them
  template <typename U>
  FX_DEVICE static float rotated(float y, float partner, float cs, float sn) {
    return round_to<U>(round_to<U>(y * cs) + round_to<U>(partner * sn));
  }

  // A head is HEAD_CHUNKS whole chunks on consecutive lanes of one item (rt a multiple of them), so
  // the partner chunk of lane l is lane l ^ HEAD_CHUNKS / 2's: one shuffle a value, the tables read
  // a chunk at a time (their rows start 16-byte aligned: D a multiple of VEC).
  template <typename U, int D, int C, int S>
  FX_DEVICE void rotary_by_lanes() {
    constexpr int HALF_CHUNKS = D / VEC / 2;
    const int64_t table_row = active ? (row % a.prows[C]) * D : 0;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float partner[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) partner[e] = t.shfl_xor(v[i][e], HALF_CHUNKS);
      const int c0 = col(i, 0);
      if (!active || c0 >= n) continue;  // (after the shuffles: every lane takes part)
      const int j0 = c0 % D;
      float cs[VEC], sn[VEC];
      load_param_vec<VEC>(a.pptr[C], a.pdtype[C], table_row + j0, cs);
      load_param_vec<VEC>(a.pptr[S], a.pdtype[S], table_row + j0, sn);
      const float sign = j0 < D / 2 ? -1.0f : 1.0f;
#pragma unroll
      for (int e = 0; e < VEC; ++e)
        v[i][e] = rotated<U>(v[i][e], sign * partner[e], cs[e], sn[e]);
    }
  }

  // Any other layout: the partner through the row's scratch (n floats), the tables an element at a
  // time.
  template <typename U, int D, int C, int S>
  FX_DEVICE void rotary_by_scratch() {
    to_scratch();
    if (active) {
      const int64_t table_row = (row % a.prows[C]) * D;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const int c = col(i, e);
          if (c >= n) continue;
          const int j = c % D;
          const float partner = j < D / 2 ? -scratch[c + D / 2] : scratch[c - D / 2];
          const float cs = load_param(a.pptr[C], a.pdtype[C], table_row + j);
          const float sn = load_param(a.pptr[S], a.pdtype[S], table_row + j);
          v[i][e] = rotated<U>(v[i][e], partner, cs, sn);
        }
    }
    t.sync();  // the scratch is free again (a later stage, the next row)
  }

  // Dropout in training: v / (1 - p) where the mask keeps the element, v * 0 elsewhere (NaN and
  // Inf become NaN, as in eager's product); the mask is a hash of (seed parameter K, row, column)
  // (row_random.cuh), so the backward recomputes it from the seed.
  template <int K>
  FX_DEVICE void dropout(uint32_t threshold, float scale) {
    const uint32_t rk = dropout_row_key(dropout_key(a.pptr[K]), row);
    map([rk, threshold, scale](float x, int c) { return x * (dropout_keeps(rk, c, threshold) ? scale : 0.0f); });
  }

  // A norm's input: the value rounded to T (eager's norm sees a T tensor). The code generator
  // calls it before a norm whose input is not already a T value (fxfuse/cuda/codegen.py).
  FX_DEVICE void round_input() {
    if constexpr (DType<T>::kCode != FX_F32) map([](float x, int) { return round_to<T>(x); });
  }

  // The row's mean and 1/sqrt(biased variance + eps), two passes (layer_norm and its backward)
  FX_DEVICE void layer_moments(float eps, float& mean, float& rstd) const {
    const float n = static_cast<float>(a.n);
    mean = reduce_sum() / n;
    const float m = mean;
    const float var = reduce(0.0f, OpAdd(), [m](float x) { return (x - m) * (x - m); }) / n;
    rstd = fx_rsqrt(var + eps);
  }

  // 1/sqrt(mean(x^2) + eps) of the row (rms_norm and its backward)
  FX_DEVICE float rms_scale(float eps) const {
    const float ms = reduce(0.0f, OpAdd(), [](float x) { return x * x; }) / static_cast<float>(a.n);
    return fx_rsqrt(ms + eps);
  }

  // F.layer_norm over the row: biased variance (two-pass), (x - mean) * rstd * w + b
  template <typename U, int W, int B>
  FX_DEVICE void layer_norm(float eps) {
    float mean, rstd;
    layer_moments(eps, mean, rstd);
    normalise_by_chunk<U, W, B>([mean, rstd](int, float& sh, float& sc) {
      sh = mean;
      sc = rstd;
    });
  }

  // F.rms_norm: x * rsqrt(mean(x^2) + eps) * w
  template <typename U, int W>
  FX_DEVICE void rms_norm(float eps) {
    const float r = rms_scale(eps);
    normalise_by_chunk<U, W, -1>([r](int, float& sh, float& sc) {
      sh = 0.0f;
      sc = r;
    });
  }

  // Group norm over groups of n/G consecutive columns of the row, two passes (mean, then the mean
  // of squared deviations) in fp32 like eager's CUDA kernel, whose eps is a T and which (up to
  // torch 2.11) normalises with mean and 1/std rounded to T: FX_GROUP_NORM_ROUNDS_STATS.
  //  - a group of `lanes` whole chunks held by consecutive threads (lanes a power of two dividing
  //    the row's threads; every suite shape): shuffle sums, no shared memory;
  //  - other whole-chunk groups: per-chunk partial sums in shared memory, one thread a group;
  //  - a group size that is not a multiple of 16 bytes of T: the row staged in shared memory.
  template <typename U, int G, int W, int B>
  FX_DEVICE void group_norm(float eps) {
    const float eps_t = round_to<U>(eps);
    const int gs = a.n / G;
    const int lanes = gs / VEC;
    if (group_in_lanes(a.n, G, VEC) || (gs % VEC == 0 && (lanes & (lanes - 1)) == 0 && a.rt % lanes == 0)) {
      group_norm_by_lanes<U, W, B>(eps_t, gs, lanes);
    } else if (gs % VEC == 0) {
      group_norm_by_chunk<U, G, W, B>(eps_t, gs);
    } else {
      group_norm_staged<U, G, W, B>(eps_t, gs);
    }
  }

  template <typename U>
  FX_DEVICE void group_stats(float& mean, float& rstd) const {
    if (a.flags & FX_GROUP_NORM_ROUNDS_STATS) {
      mean = round_to<U>(mean);
      rstd = round_to<U>(rstd);
    }
  }

  // s[i] = the sum of s[i] over the `lanes` consecutive threads holding chunk i's group (lanes a
  // power of two; above 32, whole warps through shared memory), in a fixed order.
  FX_DEVICE void group_sums(float (&s)[ITEMS], int lanes) const {
    const int width = lanes < 32 ? lanes : 32;
    for (int off = width >> 1; off > 0; off >>= 1)
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) s[i] += t.shfl_xor(s[i], off);
    if (lanes <= 32) return;
    const int warps = t.bdim() >> 5;
    const int warp = t.tid() >> 5;
    if ((t.tid() & 31) == 0)
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) red[i * warps + warp] = s[i];
    t.sync();
    const int per = lanes >> 5;
    const int first = warp / per * per;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float r = red[i * warps + first];
      for (int w = 1; w < per; ++w) r += red[i * warps + first + w];
      s[i] = r;
    }
    t.sync();
  }

  template <typename U, int W, int B>
  FX_DEVICE void group_norm_by_lanes(float eps, int gs, int lanes) {
    float mean[ITEMS], rstd[ITEMS];
    group_moments_by_lanes<U>(eps, gs, lanes, mean, rstd);
    normalise_by_chunk<U, W, B>([&](int i, float& sh, float& sc) {
      sh = mean[i];
      sc = rstd[i];
    });
  }

  // mean[i] and rstd[i] of chunk i's group, the group's chunks held by `lanes` consecutive
  // threads (group_norm and its backward): eager's Welford tree for groups of up to 32 values,
  // else two shuffle-summed passes; rounded where eager rounds them (group_stats).
  template <typename U>
  FX_DEVICE void group_moments_by_lanes(float eps, int gs, int lanes, float (&mean)[ITEMS], float (&rstd)[ITEMS]) const {
    if (gs <= 32) {
      group_moments_as_eager_warp<U>(eps, gs, lanes, mean, rstd);
      return;
    }
    const float count = static_cast<float>(gs);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += v[i][e];
      mean[i] = col(i, 0) < a.n ? s : 0.0f;  // whole groups lie past the end (n % gs == 0)
    }
    group_sums(mean, lanes);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      mean[i] /= count;
      float s = 0.0f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) s += (v[i][e] - mean[i]) * (v[i][e] - mean[i]);
      rstd[i] = col(i, 0) < a.n ? s : 0.0f;
    }
    group_sums(rstd, lanes);
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      rstd[i] = fx_rsqrt(rstd[i] / count + eps);
      group_stats<U>(mean[i], rstd[i]);
    }
  }

  // Eager's own statistics for a group of at most 32 values (torch's CUDA group norm, a group of
  // fewer than 512 values: one warp, value j in lane j, lanes past the group empty): Welford
  // states combined by a shuffle-down tree, offsets 16 ... 1, lane 0's result. Here value j of a
  // group sits in thread j / VEC, slot j % VEC: the tree's levels of offset >= VEC are butterflies
  // between threads, the rest run in registers, and every thread of the group ends with lane 0's
  // state bit for bit (the lower side of each pair is combined first, as lane 0 combines). Levels
  // at or above the group size only meet empty lanes (no-ops). A one-ulp difference in a statistic
  // rounded to bf16 can grow past 1e-2 through a bf16 chain (S04), so the order is eager's.
  template <typename U>
  FX_DEVICE void group_moments_as_eager_warp(float eps, int gs, int lanes, float (&mean)[ITEMS],
                                             float (&rstd)[ITEMS]) const {
    const int r = lt % lanes;  // this thread's place in its group
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float m[VEC], s[VEC];
#pragma unroll
      for (int e = 0; e < VEC; ++e) welford_leaf(v[i][e], m[e], s[e]);
      float count = 1.0f;  // values behind each side of the next combine (a power of two)
      for (int lx = lanes >> 1; lx >= 1; lx >>= 1, count *= 2.0f) {
        const bool lower = (r & lx) == 0;
#pragma unroll
        for (int e = 0; e < VEC; ++e) {  // selects, not branches: the pair's halves differ
          const float om = t.shfl_xor(m[e], lx);
          const float os = t.shfl_xor(s[e], lx);
          float am = lower ? m[e] : om, as = lower ? s[e] : os;
          welford_combine(am, as, lower ? om : m[e], lower ? os : s[e], count);
          m[e] = am;
          s[e] = as;
        }
      }
#pragma unroll
      for (int off = VEC >> 1; off >= 1; off >>= 1, count *= 2.0f)
#pragma unroll
        for (int e = 0; e < off; ++e) welford_combine(m[e], s[e], m[e + off], s[e + off], count);
      mean[i] = m[0];
      rstd[i] = fx_rsqrt(s[0] / static_cast<float>(gs) + eps);
      group_stats<U>(mean[i], rstd[i]);
    }
  }

  // WelfordOps::reduce of one value into the empty state, as torch compiles it
  static FX_DEVICE void welford_leaf(float x, float& mean, float& m2) {
    mean = 0.0f + x;
    m2 = fx_fma(x, x - mean, 0.0f);
  }

  // WelfordOps::combine of (mean, m2) with (mb, m2b), both sides holding `count` values, as torch
  // compiles it: nb / n is exactly 0.5 and a.nf a power of two, so the two contracted
  // multiply-adds are  mean + delta * 0.5  and  (m2 + m2b) + (delta * delta * count) * 0.5.
  static FX_DEVICE void welford_combine(float& mean, float& m2, float mb, float m2b, float count) {
    const float delta = mb - mean;
    m2 = fx_fma(delta * delta * count, 0.5f, m2 + m2b);
    mean = fx_fma(delta, 0.5f, mean);
  }

  template <typename U, int G, int W, int B>
  FX_DEVICE void group_norm_by_chunk(float eps, int gs) {
    const int per_group = gs / VEC;
    const float count = static_cast<float>(gs);
    float mean[ITEMS], rstd[ITEMS];
    chunk_partials([](float x, int) { return x; });
    t.sync();
    chunk_combine<G>(per_group, [count](float s) { return s / count; });
    t.sync();
    chunk_group_values(gs, per_group, mean);
    t.sync();
    chunk_partials([&mean](float x, int i) { return (x - mean[i]) * (x - mean[i]); });
    t.sync();
    chunk_combine<G>(per_group, [count, eps](float s) { return fx_rsqrt(s / count + eps); });
    t.sync();
    chunk_group_values(gs, per_group, rstd);
    t.sync();
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) group_stats<U>(mean[i], rstd[i]);
    normalise_by_chunk<U, W, B>([&](int i, float& sh, float& sc) {
      sh = mean[i];
      sc = rstd[i];
    });
  }

  template <class F>
  FX_DEVICE void chunk_partials(F f) {
    if (!active) return;
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = col(i, 0);
      if (c0 < a.n) {
        float s = 0.0f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) s += f(v[i][e], i);
        scratch[c0 / VEC] = s;
      }
    }
  }

  template <int G, class F>
  FX_DEVICE void chunk_combine(int per_group, F finish) {
    if (!active) return;
    for (int g = lt; g < G; g += a.rt) {
      float s = 0.0f;
      for (int k = 0; k < per_group; ++k) s += scratch[g * per_group + k];
      scratch[g * per_group] = finish(s);
    }
  }

  // out[i] = the value chunk_combine left for chunk i's group; chunks past the end use the last
  // chunk's group (n % VEC == 0 here), as map() clamps columns
  FX_DEVICE void chunk_group_values(int gs, int per_group, float (&out)[ITEMS]) const {
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = col(i, 0) < a.n ? col(i, 0) : a.n - VEC;
      out[i] = scratch[(c0 / gs) * per_group];
    }
  }

  template <typename U, int G, int W, int B>
  FX_DEVICE void group_norm_staged(float eps, int gs) {
    if (active) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i)
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (col(i, e) < a.n) scratch[col(i, e)] = v[i][e];
    }
    t.sync();
    if (active) {
      const float count = static_cast<float>(gs);
      for (int g = lt; g < G; g += a.rt) {
        float* x = scratch + g * gs;
        float s = 0.0f;
        for (int k = 0; k < gs; ++k) s += x[k];
        float mean = s / count;
        float ss = 0.0f;
        for (int k = 0; k < gs; ++k) ss += (x[k] - mean) * (x[k] - mean);
        float rstd = fx_rsqrt(ss / count + eps);
        group_stats<U>(mean, rstd);
        for (int k = 0; k < gs; ++k) x[k] = (x[k] - mean) * rstd;
      }
    }
    t.sync();
    map([this](float, int c) { return scratch[c]; });
    t.sync();
    normalise_by_chunk<U, W, B>([](int, float& sh, float& sc) {
      sh = 0.0f;
      sc = 1.0f;
    });
  }

  // BatchNorm with running statistics: (x - rm) / sqrt(rv + eps) * w + b
  template <typename U, int W, int B, int RM, int RV>
  FX_DEVICE void batch_norm_eval(float eps) {
    normalise<U, W, B>([this, eps](int i, auto& shift, auto& scale) {
      running_shift_scale<RM, RV>(i, eps, shift, scale);
    });
  }

  // An eval BatchNorm's shift and scale at chunk i: the running mean and 1 / sqrt(rv + eps)
  // (the forward's, and the backward's: row_grad.cuh's norm_dv)
  template <int RM, int RV>
  FX_DEVICE void running_shift_scale(int i, float eps, float (&shift)[VEC], float (&scale)[VEC]) const {
    float rv[VEC];
    col_chunk<RM>(i, shift);
    col_chunk<RV>(i, rv);
#pragma unroll
    for (int e = 0; e < VEC; ++e) scale[e] = 1.0f / sqrtf(rv[e] + eps);
  }

  // BatchNorm with the batch statistics of the combine kernel: (x - mean) * scale + bias, the
  // weight folded into the scale there (eager: (x - mean) * rstd * w + b, contracted)
  template <typename U, int W, int B>
  FX_DEVICE void batch_norm_train() {
    static_assert(W == Prog::kBatchWeight && B == Prog::kBatchBias, "the combine folds this stage's weight and bias");
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float m[VEC], s[VEC], b[VEC];
      chunk_of(a.bn_mean, FX_F32, i, m);
      chunk_of(a.bn_scale, FX_F32, i, s);
      if constexpr (B >= 0) chunk_of(a.bn_bias, FX_F32, i, b);
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const float y = B >= 0 ? fx_fma(v[i][e] - m[e], s[e], b[e]) : (v[i][e] - m[e]) * s[e];
        v[i][e] = norm_output<U>(y);
      }
    }
  }
};

}  // namespace fx
