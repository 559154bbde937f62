// Element types and 16-byte memory access for the row kernels: dtype traits, the loads and
// stores of a chunk (VEC elements, 16 bytes of T), aligned or not, and a fast division by a
// row count. Device facts every row kernel shares are defined here once.
#pragma once

#include <math.h>
#include <stdint.h>

#include <type_traits>

#include "epilogue_ops.cuh"
#include "fx_abi.h"
#include "fx_port.cuh"

#if !defined(FX_EMULATE)
#include <cuda_runtime.h>
#endif

namespace fx {

// ---------------------------------------------------------------------------------------------
// Element types and memory access

template <typename T>
struct DType;
template <>
struct DType<float> {
  static constexpr int kVec = 4;
  static constexpr int32_t kCode = FX_F32;
};
template <>
struct DType<__nv_bfloat16> {
  static constexpr int kVec = 8;
  static constexpr int32_t kCode = FX_BF16;
};
template <>
struct DType<__half> {
  static constexpr int kVec = 8;
  static constexpr int32_t kCode = FX_F16;
};

// x rounded to T and back: what a norm of a T input sees and returns (eager's dtype arithmetic)
template <typename T>
FX_DEVICE float round_to(float x) {
  if constexpr (DType<T>::kCode == FX_BF16) {
    return fx_round_bf16(x);
  } else if constexpr (DType<T>::kCode == FX_F16) {
    return fx_round_fp16(x);
  } else {
    return x;
  }
}

FX_DEVICE float bf16_bits_to_float(uint32_t h) { return bits_to_float(h << 16); }
FX_DEVICE float f16_bits_to_float(uint32_t h) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(h)));
}
FX_DEVICE uint32_t float_to_bf16_bits(float f) { return __bfloat16_as_ushort(__float2bfloat16_rn(f)); }
FX_DEVICE uint32_t float_to_f16_bits(float f) { return __half_as_ushort(__float2half_rn(f)); }

// encode_rounded(f): the bits of an f that is already a value of the type (round_to<T>'s
// result). bfloat16 is the high half of the float -- no second conversion instruction, which
// runs at a quarter of the arithmetic rate.
struct Bf16Codec {
  static FX_DEVICE float decode(uint32_t h) { return bf16_bits_to_float(h); }
  static FX_DEVICE uint32_t encode(float f) { return float_to_bf16_bits(f); }
  static FX_DEVICE uint32_t encode_rounded(float f) { return float_to_bits(f) >> 16; }
};
struct F16Codec {
  static FX_DEVICE float decode(uint32_t h) { return f16_bits_to_float(h); }
  static FX_DEVICE uint32_t encode(float f) { return float_to_f16_bits(f); }
  static FX_DEVICE uint32_t encode_rounded(float f) { return float_to_f16_bits(f); }
};

// Loads and stores of one element or one 16-byte chunk; `i` counts elements.
template <typename T>
struct Mem;

template <>
struct Mem<float> {
  static FX_DEVICE float load(const void* base, int64_t i) { return static_cast<const float*>(base)[i]; }
  static FX_DEVICE void store(void* base, int64_t i, float v) { static_cast<float*>(base)[i] = v; }
  static FX_DEVICE void load_vec(const void* base, int64_t i, float* v) {
    const float4 q = *reinterpret_cast<const float4*>(static_cast<const float*>(base) + i);
    v[0] = q.x;
    v[1] = q.y;
    v[2] = q.z;
    v[3] = q.w;
  }
  static FX_DEVICE void store_vec(void* base, int64_t i, const float* v) {
    float4 q;
    q.x = v[0];
    q.y = v[1];
    q.z = v[2];
    q.w = v[3];
    *reinterpret_cast<float4*>(static_cast<float*>(base) + i) = q;
  }
  static FX_DEVICE void store_rounded(void* base, int64_t i, float v) { store(base, i, v); }
  static FX_DEVICE void store_vec_rounded(void* base, int64_t i, const float* v) { store_vec(base, i, v); }
  template <int VEC>
  static FX_DEVICE void store_chunk_rounded(void* base, int64_t i, const float* v) {
    static_assert(VEC == 4, "a chunk of float is 16 bytes");
    store_vec(base, i, v);
  }
};

template <class Codec>
struct Mem16 {
  static FX_DEVICE float load(const void* base, int64_t i) {
    return Codec::decode(static_cast<const uint16_t*>(base)[i]);
  }
  static FX_DEVICE void store(void* base, int64_t i, float v) {
    static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(Codec::encode(v));
  }
  static FX_DEVICE void load_vec(const void* base, int64_t i, float* v) {
    const uint4 q = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(base) + i);
    const uint32_t w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[2 * k] = Codec::decode(w[k] & 0xffffu);
      v[2 * k + 1] = Codec::decode(w[k] >> 16);
    }
  }
  // 4 values (8 bytes): a chunk of a chain that widens to float32 (chunk_elements)
  static FX_DEVICE void load_vec4(const void* base, int64_t i, float* v) {
    const uint2 q = *reinterpret_cast<const uint2*>(static_cast<const uint16_t*>(base) + i);
    const uint32_t w[2] = {q.x, q.y};
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      v[2 * k] = Codec::decode(w[k] & 0xffffu);
      v[2 * k + 1] = Codec::decode(w[k] >> 16);
    }
  }
  static FX_DEVICE void store_vec(void* base, int64_t i, const float* v) { store_bits<false>(base, i, v); }
  // stores of values already rounded to the type (Codec::encode_rounded)
  static FX_DEVICE void store_rounded(void* base, int64_t i, float v) {
    static_cast<uint16_t*>(base)[i] = static_cast<uint16_t>(Codec::encode_rounded(v));
  }
  static FX_DEVICE void store_vec_rounded(void* base, int64_t i, const float* v) { store_bits<true>(base, i, v); }
  // a chunk of VEC rounded values: 16 bytes, or 8 (a chain that widens: chunk_elements)
  template <int VEC>
  static FX_DEVICE void store_chunk_rounded(void* base, int64_t i, const float* v) {
    static_assert(VEC == 8 || VEC == 4, "a chunk is 8 or 4 values");
    if constexpr (VEC == 8) {
      store_bits<true>(base, i, v);
    } else {
      uint2 q;
      q.x = encode<true>(v[0]) | (encode<true>(v[1]) << 16);
      q.y = encode<true>(v[2]) | (encode<true>(v[3]) << 16);
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(base) + i) = q;
    }
  }

  template <bool kRounded>
  static FX_DEVICE uint32_t encode(float f) {
    return kRounded ? Codec::encode_rounded(f) : Codec::encode(f);
  }
  template <bool kRounded>
  static FX_DEVICE void store_bits(void* base, int64_t i, const float* v) {
    uint32_t w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = encode<kRounded>(v[2 * k]) | (encode<kRounded>(v[2 * k + 1]) << 16);
    uint4 q;
    q.x = w[0];
    q.y = w[1];
    q.z = w[2];
    q.w = w[3];
    *reinterpret_cast<uint4*>(static_cast<uint16_t*>(base) + i) = q;
  }
};

template <>
struct Mem<__nv_bfloat16> : Mem16<Bf16Codec> {};
template <>
struct Mem<__half> : Mem16<F16Codec> {};

// Elements a chunk of a program's rows, the code generator's choice (Prog::kVec): 16 bytes of T,
// or for a bf16/fp16 chain that widens to a float output, 16 bytes of float (8-byte loads, one
// whole 16-byte store a chunk) or still 16 bytes of T (two stores a chunk).
template <class Prog, typename T>
constexpr int chunk_elements() {
  static_assert(Prog::kVec == DType<T>::kVec || Prog::kVec == DType<typename Prog::Out>::kVec, "a chunk is 16 bytes");
  return Prog::kVec;
}

// A program parameter: float32, bfloat16 or float16, converted exactly to float.
FX_DEVICE float load_param(const void* p, int32_t dtype, int64_t i) {
  if (dtype == FX_BF16) return bf16_bits_to_float(load_ro(static_cast<const unsigned short*>(p) + i));
  if (dtype == FX_F16) return f16_bits_to_float(load_ro(static_cast<const unsigned short*>(p) + i));
  return load_ro(static_cast<const float*>(p) + i);
}

// VEC values of a parameter from element c on (c a multiple of VEC; the pointer 16-byte aligned).
// No branch on the dtype: the loads (a float32 parameter's second half a predicated one) and the
// conversion by selects, so that a kernel issues every parameter load of a chunk together. A
// branch a dtype around each load and conversion kept them one at a time, the row waiting on each
// (on an H100, S07's BatchNorm apply, three such parameters: 25.9 us that way, 20.1 us this).
template <int VEC>
FX_DEVICE void load_param_vec(const void* p, int32_t dtype, int64_t c, float* out) {
  static_assert(VEC == 8 || VEC == 4, "a chunk is 16 bytes of a 16-bit type or of float");
  const bool wide = dtype == FX_F32;
  const bool bf16 = dtype == FX_BF16;
  const char* at = static_cast<const char*>(p) + c * (wide ? 4 : 2);
  uint32_t w[VEC];  // float32: VEC words; 16-bit: the first VEC / 2, two values a word
  if constexpr (VEC == 8) {
    const uint4 lo = load_ro(reinterpret_cast<const uint4*>(at));
    uint4 hi = lo;
    if (wide) hi = load_ro(reinterpret_cast<const uint4*>(at + 16));
    const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) w[k] = words[k];
  } else {
    const uint2 lo = load_ro(reinterpret_cast<const uint2*>(at));
    uint2 hi = lo;
    if (wide) hi = load_ro(reinterpret_cast<const uint2*>(at + 8));
    const uint32_t words[4] = {lo.x, lo.y, hi.x, hi.y};
#pragma unroll
    for (int k = 0; k < 4; ++k) w[k] = words[k];
  }
#pragma unroll
  for (int e = 0; e < VEC; ++e) {
    const uint32_t h = e % 2 ? w[e / 2] >> 16 : w[e / 2] & 0xffffu;
    const float narrow = bf16 ? bf16_bits_to_float(h) : f16_bits_to_float(h);
    out[e] = wide ? bits_to_float(w[e]) : narrow;
  }
}

// Heads of d columns a rotary embedding pairs by lane shuffles (Row::rotary_by_lanes): whole chunks
// a head, a power of two of them from 2 (the partner chunk another lane's) up to a warp's 32. Rows
// of such heads run row-local: a local plan's threads a segment, a power of two no fewer than the
// row's chunks or whole warps, are a multiple of the head's chunks.
constexpr FX_HOST_DEVICE bool rotary_in_lanes(int64_t n, int64_t d, int vec) {
  const int64_t lanes = d / vec;
  return n % d == 0 && d % vec == 0 && lanes >= 2 && lanes <= 32 && (lanes & (lanes - 1)) == 0;
}

// Whether each group of a group norm over n columns is whole 16-byte chunks held by a power of two
// of at most 32 consecutive threads of a row (any plan's threads a row are a multiple of that
// count): its statistics take warp shuffles only.
FX_HOST_DEVICE bool group_in_lanes(int64_t n, int64_t groups, int vec) {
  const int64_t gs = n / groups;
  const int64_t lanes = gs / vec;
  return gs % vec == 0 && lanes <= 32 && (lanes & (lanes - 1)) == 0;
}

}  // namespace fx
