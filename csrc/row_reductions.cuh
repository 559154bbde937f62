// Row reductions and row maps, stages of fx::Row (row_core.cuh declares them): logsumexp, vector
// norm, var/std reductions of a row to one value; softmax, log_softmax and F.normalize, which map
// the row by its statistic.
#pragma once

#include "row_core.cuh"

namespace fx {

// torch.logsumexp: the max is replaced by 0 where it is infinite
FX_ROW_TEMPLATE
FX_DEVICE float FX_ROW::reduce_logsumexp() const {
  float m = reduce_max();
  if (fabsf(m) == INFINITY) m = 0.0f;
  const float s = reduce(0.0f, OpAdd(), [m](float x) { return expf(x - m); });
  return logf(s) + m;
}

// torch.linalg.vector_norm(ord=2): the square root of the row's sum of squares
FX_ROW_TEMPLATE
FX_DEVICE float FX_ROW::reduce_vector_norm() const { return sqrtf(reduce(0.0f, OpAdd(), [](float x) { return x * x; })); }

FX_ROW_TEMPLATE
FX_DEVICE void FX_ROW::softmax() {
  const float m = reduce_max();
  map([m](float x, int) { return expf(x - m); });
  const float s = reduce_sum();
  map([s](float x, int) { return x / s; });
}

// torch.var / torch.std: the squared deviations from the row's mean m over max(0, n - correction)
FX_ROW_TEMPLATE
FX_DEVICE float FX_ROW::reduce_var_about(float m, float correction) const {
  const float d = fmaxf(0.0f, static_cast<float>(n) - correction);
  return reduce(0.0f, OpAdd(), [m](float x) { return (x - m) * (x - m); }) / d;
}

FX_ROW_TEMPLATE
FX_DEVICE float FX_ROW::reduce_var(float correction) const { return reduce_var_about(reduce_mean(), correction); }

FX_ROW_TEMPLATE
FX_DEVICE float FX_ROW::reduce_std(float correction) const { return sqrtf(reduce_var(correction)); }

// F.normalize(p=2): the row over clamp_min(its norm, eps) (a NaN norm stays NaN, as clamp_min's)
FX_ROW_TEMPLATE
FX_DEVICE float FX_ROW::normalize_divisor(float norm, float eps) { return norm < eps ? eps : norm; }

FX_ROW_TEMPLATE
FX_DEVICE void FX_ROW::normalize(float eps) {
  const float d = normalize_divisor(reduce_vector_norm(), eps);
  map([d](float x, int) { return x / d; });
}

FX_ROW_TEMPLATE
FX_DEVICE void FX_ROW::log_softmax() {
  const float m = reduce_max();
  const float s = reduce(0.0f, OpAdd(), [m](float x) { return expf(x - m); });
  const float log_s = logf(s);
  map([m, log_s](float x, int) { return (x - m) - log_s; });
}

}  // namespace fx
