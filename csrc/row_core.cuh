// One row in registers (fx::Row) and the stages a program applies to it, each reading and writing
// the register-resident row: here the row's layout, loads and stores, parameters, pointwise maps,
// dropout, the reductions' primitives (statistics in float32 by shuffles and a fixed-order
// shared-memory sum) and the end every norm shares; the stages of each kind in a file of their own
// (row_norms.cuh, row_reductions.cuh, row_pooling.cuh, row_rotary.cuh), declared in the class.
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

  // Row reductions and row maps (row_reductions.cuh)
  FX_DEVICE float reduce_logsumexp() const;
  FX_DEVICE float reduce_vector_norm() const;
  FX_DEVICE void softmax();
  FX_DEVICE float reduce_var_about(float m, float correction) const;
  FX_DEVICE float reduce_var(float correction) const;
  FX_DEVICE float reduce_std(float correction) const;
  FX_DEVICE static float normalize_divisor(float norm, float eps);
  FX_DEVICE void normalize(float eps);
  FX_DEVICE void log_softmax();

  // Every norm ends here: v = (v - shift) * scale * w + b (the last two as one fma, as eager's CUDA
  // norms compile), its output rounded to U as eager's norm of a U input returns it. U, every
  // norm's first template argument, is the dtype the norm computes for: T, or float once the
  // chain widened (a float32 norm of autocast or type promotion). `shift_scale(i, shift, scale)`
  // fills chunk i's VEC shifts and scales.
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
        v[i][e] = round_to<U>(y);
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

  // Pooling along the features (row_pooling.cuh)
  template <bool Max, int K, int S>
  FX_DEVICE void pool();
  template <int K, int S>
  FX_DEVICE void pool_avg();
  template <int K, int S>
  FX_DEVICE void pool_max();

  // Attention's rotary embedding (row_rotary.cuh)
  template <typename U, int D, int C, int S>
  FX_DEVICE void rotary();
  template <typename U>
  FX_DEVICE static float rotated(float y, float partner, float cs, float sn);
  template <typename U, int D, int C, int S>
  FX_DEVICE void rotary_by_lanes();
  template <typename U, int D, int C, int S>
  FX_DEVICE void rotary_by_scratch();

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

  // Norms: layer, RMS, group, batch in eval and training (row_norms.cuh)
  FX_DEVICE void layer_moments(float eps, float& mean, float& rstd) const;
  FX_DEVICE float rms_scale(float eps) const;
  template <typename U, int W, int B>
  FX_DEVICE void layer_norm(float eps);
  template <typename U, int W>
  FX_DEVICE void rms_norm(float eps);
  template <typename U, int G, int W, int B>
  FX_DEVICE void group_norm(float eps);
  template <typename U>
  FX_DEVICE void group_stats(float& mean, float& rstd) const;
  FX_DEVICE void group_sums(float (&s)[ITEMS], int lanes) const;
  template <typename U, int W, int B>
  FX_DEVICE void group_norm_by_lanes(float eps, int gs, int lanes);
  template <typename U>
  FX_DEVICE void group_moments_by_lanes(float eps, int gs, int lanes, float (&mean)[ITEMS], float (&rstd)[ITEMS]) const;
  template <typename U>
  FX_DEVICE void group_moments_as_eager_warp(float eps, int gs, int lanes, float (&mean)[ITEMS],
                                             float (&rstd)[ITEMS]) const;
  static FX_DEVICE void welford_leaf(float x, float& mean, float& m2);
  static FX_DEVICE void welford_combine(float& mean, float& m2, float mb, float m2b, float count);
  template <typename U, int G, int W, int B>
  FX_DEVICE void group_norm_by_chunk(float eps, int gs);
  template <class F>
  FX_DEVICE void chunk_partials(F f);
  template <int G, class F>
  FX_DEVICE void chunk_combine(int per_group, F finish);
  FX_DEVICE void chunk_group_values(int gs, int per_group, float (&out)[ITEMS]) const;
  template <typename U, int G, int W, int B>
  FX_DEVICE void group_norm_staged(float eps, int gs);
  template <typename U, int W, int B, int RM, int RV>
  FX_DEVICE void batch_norm_eval(float eps);
  template <int RM, int RV>
  FX_DEVICE void running_shift_scale(int i, float eps, float (&shift)[VEC], float (&scale)[VEC]) const;
  template <typename U, int W, int B>
  FX_DEVICE void batch_norm_train();
};

}  // namespace fx

// The head of a Row member defined outside the class: the stages of a kind, each in a file of its
// own, below
#define FX_ROW_TEMPLATE template <class Prog, typename T, int ITEMS, bool ALIGNED, bool PARAMS_T>
#define FX_ROW Row<Prog, T, ITEMS, ALIGNED, PARAMS_T>

#include "row_norms.cuh"
#include "row_pooling.cuh"
#include "row_reductions.cuh"
#include "row_rotary.cuh"
