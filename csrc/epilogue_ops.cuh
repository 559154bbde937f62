// The pointwise vocabulary as device functions: one per row of fxfuse/vocabulary.py, and its
// derivative (`_bwd`: the gradient of the operand from the output's gradient g, the operand and the
// output y), as eager's CUDA backward kernels compute it.
//
// Each follows eager PyTorch's own CUDA formula (float opmath) so that NaN/Inf behave as in
// torch: comparisons are written so a NaN operand falls through to the NaN-producing branch, and
// maximum/minimum/clamp propagate NaN explicitly. Full-precision libm calls only (expf, erff,
// tanhf, log1pf, expm1f), but for the in-GEMM epilogue's exponential (fx_expf, below); never build
// this with --use_fast_math.
//
// The header is also valid host C++ (FX_FN is plain `inline` there) so the CPU tests can compile
// the very same formulas with g++ and compare them with torch on special values.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <math.h>

#if defined(__CUDACC__)
#define FX_FN __device__ __forceinline__
#else
#define FX_FN inline
#endif

FX_FN bool fx_isnan(float x) { return x != x; }

// expf, or, in a build under the correctness rule (FX_RULE_MATH: the in-GEMM epilogue, which
// computes in float32 from the accumulator and rounds once, so its results must be within 1e-2 of
// eager's, not equal to them), the hardware's exponential: 2 + 1.2 |x| ulp (2^-16 relative at |x| =
// 80, far finer than a 16-bit output's rounding), in two instructions where libm's takes about 15.
// Flushed to zero (ex2.approx.ftz, what __expf is under --use_fast_math): a result under 2^-126 is
// 0, off by less than 1.2e-38; __expf's own scaling of such results cost three instructions more an
// exponential. NaN and the infinities' limits are kept. The functions below take it only where the
// exponential ends in a denominator or its argument stays below 20 (an approximate exp overflows a
// hair before expf). The row kernels, which round where eager rounds and so must compute eager's
// bits (an op a few ulps off, rounded and carried through the chain, breaks the rule:
// fxfuse/cuda/build.py), and the host build (the tests against torch) use libm's. (tanh.approx.f32
// was not taken: 2^-11 relative is half precision, and x - tanh(x) would turn it into an absolute
// error of that size.)
FX_FN float fx_expf(float x) {
#if defined(FX_RULE_MATH) && defined(__CUDA_ARCH__)
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x * 1.4426950408889634f));
  return y;
#else
  return expf(x);
#endif
}

// a / b where the activations above divide by 1 + exp(...) (or n (n + 2) + 2): under the rule the
// hardware's reciprocal, 2 ulp, times a (__fdividef without its scaling of a denormal b, which
// these denominators, at least 1, never are: three instructions less a division where a is not
// 1; 0 where |b| passes 2^126, whose true quotient is as tiny), in two instructions where IEEE
// division takes about ten and a branch to its slow path
FX_FN float fx_activation_div(float a, float b) {
#if defined(FX_RULE_MATH) && defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return a * r;
#else
  return a / b;
#endif
}

FX_FN float fx_relu(float x) { return x < 0.0f ? 0.0f : x; }

FX_FN float fx_leaky_relu(float x, float slope) { return x > 0.0f ? x : x * slope; }

// torch: x * 0.5 * (1 + erf(x * M_SQRT1_2))
FX_FN float fx_gelu(float x) {
  const float kAlpha = 0.70710678118654752440f;
  return x * 0.5f * (1.0f + erff(x * kAlpha));
}

// torch: 0.5 * x * (1 + tanh(kBeta * (x + kKappa * x^3))), kBeta = sqrt(2 / pi)
FX_FN float fx_gelu_tanh(float x) {
  const float kBeta = 0.7978845608028654f;
  const float kKappa = 0.044715f;
  const float x_cube = x * x * x;
  const float inner = kBeta * (x + kKappa * x_cube);
#if defined(FX_RULE_MATH)
  // the same function as x / (1 + exp(-2 inner)): one fast exponential for tanhf, and no
  // cancellation where tanh(inner) nears -1
  return fx_activation_div(x, 1.0f + fx_expf(-2.0f * inner));
#else
  return 0.5f * x * (1.0f + tanhf(inner));
#endif
}

// torch: x / (1 + exp(-x))
FX_FN float fx_silu(float x) { return fx_activation_div(x, 1.0f + fx_expf(-x)); }

// torch: 1 / (1 + exp(-x))
FX_FN float fx_sigmoid(float x) { return fx_activation_div(1.0f, 1.0f + fx_expf(-x)); }

FX_FN float fx_tanh(float x) { return tanhf(x); }

// tanh(softplus(x)) = tanh(log1p(exp(x))), which Mish and its derivative take: with n = exp(x) it
// is n (n + 2) / (n (n + 2) + 2), one exponential in place of three transcendental calls, within a
// few ulp of torch's. From x = 20 on it rounds to 1 in float32, as torch's does (and n (n + 2)
// would overflow from 44 on). Computed for every x and selected, not branched around: an early
// return made nvcc put each value's exponential and reciprocal in a branch of its own, so an
// epilogue's values ran one after another instead of overlapping (a NaN x stays NaN either way).
FX_FN float fx_tanh_softplus(float x) {
  const float n = fx_expf(x >= 20.0f ? 20.0f : x);
  const float p = n * (n + 2.0f);
  const float t = fx_activation_div(p, p + 2.0f);
  return x >= 20.0f ? 1.0f : t;
}

// torch (CPU and CUDA): x * tanh(log1p(exp(x))); +inf gives inf, -inf gives -inf * 0 = NaN
FX_FN float fx_mish(float x) { return x * fx_tanh_softplus(x); }

// torch: NaN passes through, else min(max(x, lo), hi)
FX_FN float fx_clamp(float x, float lo, float hi) {
  if (fx_isnan(x)) return x;
  const float a = x < lo ? lo : x;
  return a > hi ? hi : a;
}

// torch: hardtanh is clamp in the forward (it differs in the gradient at the bounds)
FX_FN float fx_hardtanh(float x, float lo, float hi) { return fx_clamp(x, lo, hi); }

FX_FN float fx_clamp_min(float x, float lo) { return fx_isnan(x) ? x : (x < lo ? lo : x); }

FX_FN float fx_clamp_max(float x, float hi) { return fx_isnan(x) ? x : (x > hi ? hi : x); }

// min(max(v, 0), 6) with NaN falling through both comparisons
FX_FN float fx_relu6_(float v) { return v < 0.0f ? 0.0f : (v > 6.0f ? 6.0f : v); }

// torch: x * min(max(x + 3, 0), 6) / 6
FX_FN float fx_hardswish(float x) { return x * fx_relu6_(x + 3.0f) / 6.0f; }

// torch: min(max(x + 3, 0), 6) / 6
FX_FN float fx_hardsigmoid(float x) { return fx_relu6_(x + 3.0f) / 6.0f; }

// torch elu kernel with scale = input_scale = 1: x > 0 ? x : expm1(x) * alpha (both sides
// computed, then selected, as in fx_tanh_softplus)
FX_FN float fx_elu(float x, float alpha) {
  const float below = expm1f(x) * alpha;
  return x > 0.0f ? x : below;
}

// torch selu = elu with negcoef = alpha * scale, poscoef = scale (coefficients formed in double)
FX_FN float fx_selu(float x) {
  const float kScale = 1.0507009873554804934193349852946f;
  const float kNegCoef = 1.7580993175506592f;  // float(alpha) * float(scale), as torch forms it
  const float below = expm1f(x) * kNegCoef;
  return x > 0.0f ? x * kScale : below;
}

// torch: (x * beta) > threshold ? x : log1p(exp(x * beta)) / beta
FX_FN float fx_softplus(float x, float beta, float threshold) {
  const float xb = x * beta;
  return xb > threshold ? x : log1pf(expf(xb)) / beta;  // (libm's: the threshold may pass 88)
}

FX_FN float fx_abs(float x) { return fabsf(x); }

FX_FN float fx_exp(float x) { return expf(x); }  // (libm's: see fx_expf)

FX_FN float fx_expm1(float x) { return expm1f(x); }

FX_FN float fx_log(float x) { return logf(x); }

FX_FN float fx_log1p(float x) { return log1pf(x); }

FX_FN float fx_erf(float x) { return erff(x); }

// torch (log_sigmoid_forward): min(0, x) - log1p(exp(-|x|)), std::min(0, NaN) being 0
FX_FN float fx_log_sigmoid(float x) {
  const float lo = x < 0.0f ? x : 0.0f;
  return lo - log1pf(fx_expf(-fabsf(x)));
}

// torch.sign: (0 < x) - (x < 0); NaN gives 0
FX_FN float fx_sign(float x) { return static_cast<float>((0.0f < x) - (x < 0.0f)); }

FX_FN float fx_floor(float x) { return floorf(x); }

FX_FN float fx_ceil(float x) { return ceilf(x); }

// torch.round: to the nearest integer, halves to even (nearbyint)
FX_FN float fx_round(float x) { return nearbyintf(x); }

FX_FN float fx_trunc(float x) { return truncf(x); }

// torch celu: the elu kernel with negcoef = alpha, poscoef = 1 and negiptcoef = 1 / alpha (formed
// in double, as torch forms it; alpha is a constant of the generated code, so this folds)
FX_FN float fx_celu_input_scale(float alpha) { return static_cast<float>(1.0 / static_cast<double>(alpha)); }

FX_FN float fx_celu(float x, float alpha) {
  const float below = expm1f(x * fx_celu_input_scale(alpha)) * alpha;
  return x <= 0.0f ? below : x;
}

// torch.threshold: x <= threshold ? value : x (NaN passes)
FX_FN float fx_threshold(float x, float threshold, float value) { return x <= threshold ? value : x; }

// torch hardshrink: 0 inside [-lambd, lambd], x elsewhere (NaN passes)
FX_FN float fx_hardshrink(float x, float lambd) { return (x >= -lambd && x <= lambd) ? 0.0f : x; }

// torch softshrink: x - lambd above, x + lambd below, x * 0 inside (NaN stays NaN)
FX_FN float fx_softshrink(float x, float lambd) {
  return x > lambd ? x - lambd : (x < -lambd ? x + lambd : x * 0.0f);
}

// Comparisons as the expressions compute them: 1 where the comparison holds, else 0 (NaN compares
// false); pick(c, v) is v where c is nonzero, else 0 (torch.where(c, a, b) = pick(c, a) +
// pick(1 - c, b): an infinite or NaN value not picked never reaches the sum)
FX_FN float fx_gt(float a, float b) { return a > b ? 1.0f : 0.0f; }
FX_FN float fx_ge(float a, float b) { return a >= b ? 1.0f : 0.0f; }
FX_FN float fx_lt(float a, float b) { return a < b ? 1.0f : 0.0f; }
FX_FN float fx_le(float a, float b) { return a <= b ? 1.0f : 0.0f; }
FX_FN float fx_pick(float c, float v) { return c != 0.0f ? v : 0.0f; }

// torch.maximum / torch.minimum propagate NaN from either side
FX_FN float fx_maximum(float a, float b) {
  if (fx_isnan(a)) return a;
  if (fx_isnan(b)) return b;
  return a > b ? a : b;
}

FX_FN float fx_minimum(float a, float b) {
  if (fx_isnan(a)) return a;
  if (fx_isnan(b)) return b;
  return a < b ? a : b;
}

// torch.prelu: x where positive, else weight * x (NaN: weight * NaN)
FX_FN float fx_prelu(float x, float w) { return x > 0.0f ? x : w * x; }

// softmax / log_softmax over a dim of one value: exp(x - x) / exp(x - x) and (x - x) - log(1),
// so 1 and 0, NaN where x is not finite (inf - inf), as torch's
FX_FN float fx_softmax_of_one(float x) { return (x - x) + 1.0f; }
FX_FN float fx_log_softmax_of_one(float x) { return x - x; }

// Rounding points (vocabulary rows bf16 / fp16): where eager rounds a bfloat16 / float16 chain's
// intermediate result, x.to(dtype).float(); round to nearest even, NaN stays NaN.
FX_FN float fx_round_bf16(float x) { return __bfloat162float(__float2bfloat16_rn(x)); }

FX_FN float fx_round_fp16(float x) { return __half2float(__float2half_rn(x)); }

// ---------------------------------------------------------------------------------------------
// Derivatives: f_bwd(g, operand(s), y, attrs...) is the operand's gradient, as eager's CUDA
// backward kernel for f computes it (float opmath). The generated backward kernel
// (fxfuse/cuda/gradient.py) chains them in reverse order, in the row modules, which build
// without FX_RULE_MATH: fx_expf and fx_sigmoid are libm's exponential and IEEE division there.

// threshold_backward(g, y, 0): NaN y passes the gradient
FX_FN float fx_relu_bwd(float g, float x, float y) { (void)x; return y <= 0.0f ? 0.0f : g; }

FX_FN float fx_leaky_relu_bwd(float g, float x, float y, float slope) { (void)y; return x > 0.0f ? g : g * slope; }

// gelu_backward(approximate="none")
FX_FN float fx_gelu_bwd(float g, float x, float y) {
  (void)y;
  const float kBeta = 0.3989422804014327f;  // M_2_SQRTPI * M_SQRT1_2 * 0.5
  const float kAlpha = 0.70710678118654752440f;
  const float cdf = 0.5f * (1.0f + erff(x * kAlpha));
  const float pdf = fx_expf(-0.5f * x * x) * kBeta;
  return g * (cdf + x * pdf);
}

// gelu_backward(approximate="tanh")
FX_FN float fx_gelu_tanh_bwd(float g, float x, float y) {
  (void)y;
  const float kBeta = 0.7978845608028654f;  // M_SQRT2 * M_2_SQRTPI * 0.5
  const float kKappa = 0.044715f;
  const float x_sq = x * x;
  const float x_cube = x_sq * x;
  const float inner = kBeta * (x + kKappa * x_cube);
  const float tanh_inner = tanhf(inner);
  const float left = 0.5f * x;
  const float right = 1.0f + tanh_inner;
  const float left_derivative = 0.5f * right;
  const float tanh_derivative = 1.0f - tanh_inner * tanh_inner;
  const float inner_derivative = kBeta * (1.0f + 3.0f * kKappa * x_sq);
  const float right_derivative = left * tanh_derivative * inner_derivative;
  return g * (left_derivative + right_derivative);
}

FX_FN float fx_silu_bwd(float g, float x, float y) {
  (void)y;
  const float s = fx_sigmoid(x);
  return g * s * (1.0f + x * (1.0f - s));
}

// sigmoid_backward(g, y) and tanh_backward(g, y) read the output
FX_FN float fx_sigmoid_bwd(float g, float x, float y) { (void)x; return g * (1.0f - y) * y; }

FX_FN float fx_tanh_bwd(float g, float x, float y) { (void)x; return g * (1.0f - y * y); }

FX_FN float fx_mish_bwd(float g, float x, float y) {
  (void)y;
  const float s = fx_sigmoid(x);
  const float t = fx_tanh_softplus(x);
  return g * (t + x * s * (1.0f - t * t));
}

// clamp's gradient flows where lo <= x <= hi (NaN x: none); hardtanh's is zero at the bounds
// themselves and passes for NaN x (hardtanh_backward)
FX_FN float fx_clamp_bwd(float g, float x, float y, float lo, float hi) {
  (void)y;
  return (x >= lo && x <= hi) ? g : 0.0f;
}

FX_FN float fx_hardtanh_bwd(float g, float x, float y, float lo, float hi) {
  (void)y;
  return (x <= lo || x >= hi) ? 0.0f : g;
}

FX_FN float fx_clamp_min_bwd(float g, float x, float y, float lo) { (void)y; return x >= lo ? g : 0.0f; }

FX_FN float fx_clamp_max_bwd(float g, float x, float y, float hi) { (void)y; return x <= hi ? g : 0.0f; }

FX_FN float fx_hardswish_bwd(float g, float x, float y) {
  (void)y;
  if (x <= -3.0f) return 0.0f;
  if (x < 3.0f) return g * ((x / 3.0f) + 0.5f);
  return g;
}

FX_FN float fx_hardsigmoid_bwd(float g, float x, float y) {
  (void)y;
  return (x > -3.0f && x < 3.0f) ? g * (1.0f / 6.0f) : 0.0f;
}

// elu_backward(g, alpha, scale=1, input_scale=1, is_result=false, x)
FX_FN float fx_elu_bwd(float g, float x, float y, float alpha) {
  (void)y;
  return x <= 0.0f ? g * 1.0f * alpha * expf(x * 1.0f) : g * 1.0f;
}

// selu's gradient is elu_backward with selu's alpha and scale
FX_FN float fx_selu_bwd(float g, float x, float y) {
  (void)y;
  const float kScale = 1.0507009873554804934193349852946f;
  const float kNegCoef = 1.7580993175506592f;
  return x <= 0.0f ? g * 1.0f * kNegCoef * expf(x * 1.0f) : g * kScale;
}

FX_FN float fx_softplus_bwd(float g, float x, float y, float beta, float threshold) {
  (void)y;
  const float z = expf(x * beta);
  return (x * beta) > threshold ? g : g * z / (z + 1.0f);
}

// g * sgn(x), sgn(NaN) = 0
FX_FN float fx_abs_bwd(float g, float x, float y) {
  (void)y;
  const float sign = static_cast<float>((0.0f < x) - (x < 0.0f));
  return g * sign;
}

FX_FN float fx_exp_bwd(float g, float x, float y) { (void)x; return g * y; }

FX_FN float fx_expm1_bwd(float g, float x, float y) { (void)x; return g * (y + 1.0f); }

FX_FN float fx_log_bwd(float g, float x, float y) { (void)y; return g / x; }

FX_FN float fx_log1p_bwd(float g, float x, float y) { (void)y; return g / (x + 1.0f); }

// derivatives.yaml: 2 / sqrt(pi) * exp(-x^2) * g
FX_FN float fx_erf_bwd(float g, float x, float y) {
  (void)y;
  const float kTwoOverSqrtPi = 1.12837916709551257390f;
  return kTwoOverSqrtPi * fx_expf(-(x * x)) * g;
}

// log_sigmoid_backward (CUDA)
FX_FN float fx_log_sigmoid_bwd(float g, float x, float y) {
  (void)y;
  const bool negative = x < 0.0f;
  const float max_deriv = negative ? 1.0f : 0.0f;
  const float sign = negative ? 1.0f : -1.0f;
  const float z = fx_expf(-fabsf(x));
  return g * (max_deriv - sign * fx_activation_div(z, 1.0f + z));
}

// sign, floor, ceil, round, trunc: zeros_like(grad), a NaN gradient included
FX_FN float fx_sign_bwd(float g, float x, float y) { (void)g; (void)x; (void)y; return 0.0f; }

FX_FN float fx_floor_bwd(float g, float x, float y) { (void)g; (void)x; (void)y; return 0.0f; }

FX_FN float fx_ceil_bwd(float g, float x, float y) { (void)g; (void)x; (void)y; return 0.0f; }

FX_FN float fx_round_bwd(float g, float x, float y) { (void)g; (void)x; (void)y; return 0.0f; }

FX_FN float fx_trunc_bwd(float g, float x, float y) { (void)g; (void)x; (void)y; return 0.0f; }

// elu_backward(g, alpha, scale=1, input_scale=1/alpha, is_result=false, x)
FX_FN float fx_celu_bwd(float g, float x, float y, float alpha) {
  (void)y;
  const float negiptcoef = fx_celu_input_scale(alpha);
  return x <= 0.0f ? g * negiptcoef * alpha * expf(x * negiptcoef) : g;
}

// threshold_backward(g, x, threshold)
FX_FN float fx_threshold_bwd(float g, float x, float y, float threshold, float value) {
  (void)y; (void)value;
  return x <= threshold ? 0.0f : g;
}

// shrink_backward: zero inside [-lambd, lambd]
FX_FN float fx_hardshrink_bwd(float g, float x, float y, float lambd) {
  (void)y;
  return (x >= -lambd && x <= lambd) ? 0.0f : g;
}

FX_FN float fx_softshrink_bwd(float g, float x, float y, float lambd) {
  (void)y;
  return (x >= -lambd && x <= lambd) ? 0.0f : g;
}

// torch.maximum/minimum: the gradient goes to the larger (smaller) operand, half to each on a tie,
// all of it to both where either is NaN
FX_FN float fx_maximum_bwd(float g, float a, float b, float y) {
  (void)y;
  const float h = a == b ? g / 2.0f : g;
  return a < b ? 0.0f : h;
}

FX_FN float fx_maximum_bwd_other(float g, float a, float b, float y) {
  (void)y;
  const float h = a == b ? g / 2.0f : g;
  return a > b ? 0.0f : h;
}

// softmax's backward over one value, y (g - g y), and log_softmax's, g - exp(y) g: 0, NaN where
// y is NaN
FX_FN float fx_softmax_of_one_bwd(float g, float x, float y) {
  (void)x;
  return y * (g - g * y);
}

FX_FN float fx_log_softmax_of_one_bwd(float g, float x, float y) {
  (void)x;
  return g - expf(y) * g;
}

// torch.prelu's backward: g (x > 0) or weight * g to x; 0 or x * g to the weight
FX_FN float fx_prelu_bwd(float g, float x, float w, float y) {
  (void)y;
  return x > 0.0f ? g : w * g;
}

FX_FN float fx_prelu_bwd_other(float g, float x, float w, float y) {
  (void)y;
  return x > 0.0f ? 0.0f : x * g;
}

FX_FN float fx_minimum_bwd(float g, float a, float b, float y) {
  (void)y;
  const float h = a == b ? g / 2.0f : g;
  return a > b ? 0.0f : h;
}

FX_FN float fx_minimum_bwd_other(float g, float a, float b, float y) {
  (void)y;
  const float h = a == b ? g / 2.0f : g;
  return a < b ? 0.0f : h;
}

// No gradient flows through a comparison (whatever g is), nor to torch.where's condition
#define FX_NO_GRADIENT(name)                                                                  \
  FX_FN float name(float g, float a, float b, float y) { (void)g; (void)a; (void)b; (void)y; return 0.0f; }
FX_NO_GRADIENT(fx_gt_bwd)
FX_NO_GRADIENT(fx_gt_bwd_other)
FX_NO_GRADIENT(fx_ge_bwd)
FX_NO_GRADIENT(fx_ge_bwd_other)
FX_NO_GRADIENT(fx_lt_bwd)
FX_NO_GRADIENT(fx_lt_bwd_other)
FX_NO_GRADIENT(fx_le_bwd)
FX_NO_GRADIENT(fx_le_bwd_other)
FX_NO_GRADIENT(fx_pick_bwd)
#undef FX_NO_GRADIENT

FX_FN float fx_pick_bwd_other(float g, float c, float v, float y) {
  (void)v;
  (void)y;
  return c != 0.0f ? g : 0.0f;
}

// A rounding point's gradient is the incoming one rounded (eager hands a bf16/fp16 gradient on)
FX_FN float fx_round_bf16_bwd(float g, float x, float y) { (void)x; (void)y; return fx_round_bf16(g); }

FX_FN float fx_round_fp16_bwd(float g, float x, float y) { (void)x; (void)y; return fx_round_fp16(g); }
