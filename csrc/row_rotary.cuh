// Attention's rotary embedding, a stage of fx::Row (row_core.cuh declares it): each head's partner
// columns by lane shuffles, or through the row's shared-memory scratch.
#pragma once

#include "row_core.cuh"

namespace fx {

// Attention's rotary embedding (a Rotary stage) of every head of D columns: y * cos + rot(y) *
// sin, rot(y)[j] = -y[j + D/2] for j < D/2 and y[j - D/2] after, cos and sin the head tables C and
// S (P rows of D values; row r reads table row r mod P). Each product and the sum rounded to U as
// eager's three ops round them. Row-local where the heads pair by lanes (rotary_in_lanes), else
// whole rows a segment.
FX_ROW_TEMPLATE
template <typename U, int D, int C, int S>
FX_DEVICE void FX_ROW::rotary() {
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
FX_ROW_TEMPLATE
template <typename U>
FX_DEVICE float FX_ROW::rotated(float y, float partner, float cs, float sn) {
  return round_to<U>(round_to<U>(y * cs) + round_to<U>(partner * sn));
}

// A head is HEAD_CHUNKS whole chunks on consecutive lanes of one item (rt a multiple of them), so
// the partner chunk of lane l is lane l ^ HEAD_CHUNKS / 2's: one shuffle a value, the tables read
// a chunk at a time (their rows start 16-byte aligned: D a multiple of VEC).
FX_ROW_TEMPLATE
template <typename U, int D, int C, int S>
FX_DEVICE void FX_ROW::rotary_by_lanes() {
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
FX_ROW_TEMPLATE
template <typename U, int D, int C, int S>
FX_DEVICE void FX_ROW::rotary_by_scratch() {
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

}  // namespace fx
