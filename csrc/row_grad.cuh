// The backward kernel of a norm program: pre | norm | post, the norm a group, layer or RMS norm
// and pre and post pointwise (fxfuse/cuda/codegen.py). One pass over the saved GEMM output y and
// the output's gradient g, in the forward's row layout (Row, the apply kernel's plan): a thread
// recomputes its chunks of the row -- pre's values, the norm's statistics by the forward's own
// code (the same bits), the norm's output z -- then, with the gradients in float32:
//
//   gz    = post'(z) g                                    (Prog::grad_post)
//   gw    = gz w,  xhat = (v - mean) rstd
//   dv    = rstd (gw - mean(gw) - xhat mean(gw xhat))     (RMS norm: no mean(gw) term)
//   dy    = pre'(y) dv, rounded once to T at the store     (Prog::grad_pre)
//
// the means over the group (shuffles) or the row (Row::allreduce). The column sums the rest of
// the backward needs -- of dy (the bias), of gz xhat and gz (the norm's weight and bias) and of
// each pre/post parameter's gradient -- stay in registers: a block takes one segment of the row
// and a strip of rows, and writes its sums to partial[s][chunk][column] (chunk: the block's strip
// and row slot); grad_sums_kernel adds the chunks in order. Deterministic, no atomics.
#pragma once

namespace fx {

enum GradKind : int { kNoGrad = 0, kPointwiseGrad = 1, kNormGrad = 2 };
enum NormCode : int { kGroupNorm = 0, kLayerNorm = 1, kRmsNorm = 2 };

// Program parameters of MASK at chunk i's VEC columns (a scalar in every slot)
template <class Prog, uint32_t MASK, class R>
FX_DEVICE void chunk_params(const R& r, int i, float (&p)[Prog::kParamSlots][R::VEC]) {
#pragma unroll
  for (int k = 0; k < Prog::kNumParams; ++k) {
    if (!(MASK & (1u << k))) continue;
    if (Prog::kColParams & (1u << k)) {
      r.chunk_of(r.a.pptr[k], r.a.pdtype[k], i, p[k]);
    } else {
      const float s = load_param(r.a.pptr[k], r.a.pdtype[k], 0);
#pragma unroll
      for (int e = 0; e < R::VEC; ++e) p[k][e] = s;
    }
  }
}

template <class Prog, int VEC>
FX_DEVICE void slot_params(const float (&p)[Prog::kParamSlots][VEC], int e, float (&out)[Prog::kParamSlots]) {
#pragma unroll
  for (int k = 0; k < Prog::kParamSlots; ++k) out[k] = p[k][e];
}

template <class Prog, typename T, int ITEMS, bool ALIGNED>
FX_DEVICE void norm_grad_body(const Args<Prog::kParamSlots>& a, const Thread& t, float* dyn, float* red) {
  using R = Row<Prog, T, ITEMS, ALIGNED>;
  using U = typename Prog::NormU;
  using Out = typename Prog::Out;
  constexpr int VEC = R::VEC;
  static_assert(VEC == DType<T>::kVec, "norm programs take 16 bytes of T a chunk");
  constexpr int OUT_VEC = DType<Out>::kVec < VEC ? DType<Out>::kVec : VEC;
  constexpr int P = Prog::kNumParams;
  constexpr int S = 1 + P;
  constexpr int kSlots = Prog::kParamSlots;
  constexpr int W = Prog::kNormW;
  constexpr int B = Prog::kNormB;
  const int lt = t.tid() % a.rt;
  const int lr = t.tid() / a.rt;
  float* scratch = dyn + static_cast<int64_t>(lr) * a.scratch_stride;
  const int seg = t.bid() % a.segs;
  const int64_t strip = t.bid() / a.segs;
  const int64_t strips = t.gdim() / a.segs;
  const int gs = Prog::kNormKind == kGroupNorm ? a.n / Prog::kNormGroups : a.n;
  const float inv_count = 1.0f / static_cast<float>(gs);

  float sums[S][ITEMS][VEC];
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) sums[s][i][e] = 0.0f;

  for (int64_t r0 = strip * a.rpc; r0 < a.m; r0 += strips * a.rpc) {  // block-uniform
    R r(a, t, red, scratch, lt, lr, (r0 + lr) * a.segs + seg);
    r.load();
    const int64_t base = r.row * a.n;

    // the output's gradient (then gw, then dy), loaded with y: both in flight at once
    float g[ITEMS][VEC];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      const int c0 = r.col(i, 0);
      if constexpr (ALIGNED) {
        if (r.active && c0 < a.n) {
#pragma unroll
          for (int k = 0; k < VEC; k += OUT_VEC) Mem<Out>::load_vec(a.g, base + c0 + k, g[i] + k);
        } else {
#pragma unroll
          for (int e = 0; e < VEC; ++e) g[i][e] = 0.0f;
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) g[i][e] = (r.active && c0 + e < a.n) ? Mem<Out>::load(a.g, base + c0 + e) : 0.0f;
      }
    }


    // pre's values, as the norm takes them
    float y[Prog::kHasPre ? ITEMS : 1][VEC];
    if constexpr (Prog::kHasPre) {
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        float p[kSlots][VEC];
        chunk_params<Prog, Prog::kPreParams>(r, i, p);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          float pe[kSlots];
          slot_params<Prog>(p, e, pe);
          y[i][e] = r.v[i][e];
          r.v[i][e] = round_to<U>(Prog::pre(y[i][e], pe));
        }
      }
    }

    float mean[ITEMS], rstd[ITEMS];
    if constexpr (Prog::kNormKind == kGroupNorm) {
      r.template group_moments_by_lanes<U>(round_to<U>(Prog::kNormEps), gs, gs / VEC, mean, rstd);
    } else if constexpr (Prog::kNormKind == kLayerNorm) {
      float m, s;
      r.layer_moments(Prog::kNormEps, m, s);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        mean[i] = m;
        rstd[i] = s;
      }
    } else {
      const float s = r.rms_scale(Prog::kNormEps);
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        mean[i] = 0.0f;
        rstd[i] = s;
      }
    }

    // through post and the norm's affine part; the two means' summands
    float s1[ITEMS], s2[ITEMS];
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float w[VEC], b[VEC], p[kSlots][VEC];
      if constexpr (W >= 0) r.template col_chunk<W>(i, w);
      if constexpr (B >= 0) r.template col_chunk<B>(i, b);
      if constexpr (Prog::kHasPost) chunk_params<Prog, Prog::kPostParams>(r, i, p);
      s1[i] = s2[i] = 0.0f;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const bool valid = r.active && r.col(i, e) < a.n;
        const float xhat = (r.v[i][e] - mean[i]) * rstd[i];
        float gz = g[i][e];
        if constexpr (Prog::kHasPost) {
          float z = xhat;  // the forward's normalise()
          if constexpr (W >= 0 && B >= 0) {
            z = fx_fma(z, w[e], b[e]);
          } else if constexpr (W >= 0) {
            z = z * w[e];
          } else if constexpr (B >= 0) {
            z = z + b[e];
          }
          float pe[kSlots], dp[kSlots];
          slot_params<Prog>(p, e, pe);
#pragma unroll
          for (int k = 0; k < kSlots; ++k) dp[k] = 0.0f;
          Prog::grad_post(round_to<U>(z), g[i][e], pe, gz, dp);
          gz = round_to<U>(gz);  // eager's norm takes the gradient of its U output
          if (valid)
#pragma unroll
            for (int k = 0; k < P; ++k)
              if (Prog::kPostParams & (1u << k)) sums[1 + k][i][e] += dp[k];
        }
        float gw = gz;
        if constexpr (W >= 0) gw = gz * w[e];
        if (valid) {
          if constexpr (W >= 0) sums[1 + W][i][e] += gz * xhat;
          if constexpr (B >= 0) sums[1 + B][i][e] += gz;
          s1[i] += gw;
          s2[i] += gw * xhat;
        }
        r.v[i][e] = xhat;
        g[i][e] = gw;
      }
    }
    if constexpr (Prog::kNormKind == kGroupNorm) {
      r.group_sums(s1, gs / VEC);
      r.group_sums(s2, gs / VEC);
    } else {
      float t1 = 0.0f, t2 = 0.0f;
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        t1 += s1[i];
        t2 += s2[i];
      }
      t1 = r.allreduce(t1, OpAdd());
      t2 = r.allreduce(t2, OpAdd());
#pragma unroll
      for (int i = 0; i < ITEMS; ++i) {
        s1[i] = t1;
        s2[i] = t2;
      }
    }

    // through the normalisation and pre; the store
#pragma unroll
    for (int i = 0; i < ITEMS; ++i) {
      float p[kSlots][VEC];
      if constexpr (Prog::kHasPre) chunk_params<Prog, Prog::kPreParams>(r, i, p);
      const float m1 = Prog::kNormKind == kRmsNorm ? 0.0f : s1[i] * inv_count;
      const float m2 = s2[i] * inv_count;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const bool valid = r.active && r.col(i, e) < a.n;
        const float dv = round_to<U>(rstd[i] * (g[i][e] - m1 - r.v[i][e] * m2));  // eager's norm returns U
        float dx = dv;
        if constexpr (Prog::kHasPre) {
          float pe[kSlots], dp[kSlots];
          slot_params<Prog>(p, e, pe);
#pragma unroll
          for (int k = 0; k < kSlots; ++k) dp[k] = 0.0f;
          Prog::grad_pre(y[i][e], dv, pe, dx, dp);
          if (valid)
#pragma unroll
            for (int k = 0; k < P; ++k)
              if (Prog::kPreParams & (1u << k)) sums[1 + k][i][e] += dp[k];
        }
        const float d = round_to<T>(dx);  // the stored gradient is what eager sums for the bias
        if (valid) sums[0][i][e] += d;
        g[i][e] = d;
      }
      if (!r.active) continue;
      const int c0 = r.col(i, 0);
      if constexpr (ALIGNED) {
        if (c0 < a.n) Mem<T>::store_vec_rounded(a.dy, base + c0, g[i]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e)
          if (c0 + e < a.n) Mem<T>::store_rounded(a.dy, base + c0 + e, g[i][e]);
      }
    }
  }

  // this slot's column sums: chunk (strip, row slot) of partial
  const R r(a, t, red, scratch, lt, lr, seg);  // row 0 of the segment: its columns
  const int64_t chunk = strip * a.rpc + lr;
#pragma unroll
  for (int s = 0; s < S; ++s)
#pragma unroll
    for (int i = 0; i < ITEMS; ++i)
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        const int c = r.col(i, e);
        if (c < a.n) a.partial[(s * a.chunks + chunk) * a.n + c] = sums[s][i][e];
      }
}

#if !defined(FX_EMULATE)
// One 16-byte chunk a thread: blocks of at most 256 threads (the plans), three an SM (80
// registers a thread, where the whole state would take 128 and allow two)
template <int ITEMS>
constexpr int norm_grad_min_blocks() { return ITEMS == 1 ? 3 : 1; }

template <class Prog, typename T, int ITEMS, bool ALIGNED>
__global__ void __launch_bounds__(ITEMS == 1 ? 256 : kMaxBlock, norm_grad_min_blocks<ITEMS>()) norm_grad_kernel(const __grid_constant__ Args<Prog::kParamSlots> a) {
  __shared__ float red[FX_RED_FLOATS];
  const Thread t;
  norm_grad_body<Prog, T, ITEMS, ALIGNED>(a, t, fx_dynamic_smem, red);
}
#endif

}  // namespace fx
