// Pooling along the features, a stage of fx::Row (row_core.cuh declares it): windows of the row
// through its shared-memory scratch.
#pragma once

#include "row_core.cuh"

namespace fx {

// Pooling along the features (a Pool stage): windows of K values, S apart, every one inside the
// row; the row narrows to (n - K) / S + 1 values, the mean of each window (Max: its max, NaN where
// it holds one, as eager's), which later stages and the store see. Through the row's scratch
// (n floats: Prog::scratch_floats); whole rows a segment (Prog::row_local is false).
FX_ROW_TEMPLATE
template <bool Max, int K, int S>
FX_DEVICE void FX_ROW::pool() {
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

FX_ROW_TEMPLATE
template <int K, int S>
FX_DEVICE void FX_ROW::pool_avg() { pool<false, K, S>(); }

FX_ROW_TEMPLATE
template <int K, int S>
FX_DEVICE void FX_ROW::pool_max() { pool<true, K, S>(); }

}  // namespace fx
