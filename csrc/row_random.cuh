// Dropout masks: a counter-based hash of (seed, row, column), the bits fxfuse/masks.py computes
// in torch ops (the reference; the emulator tests compare the two). Wellons' lowbias32:
//   key  = mix(seed0 ^ mix(seed1 ^ 0x9E3779B9))      per call
//   rk   = mix(row_lo ^ mix(row_hi ^ key))           per row of the (M, N) output
//   bits = mix(rk ^ column * 0x9E3779B1)             per element
// and an element is kept when bits >> 8 (24 bits) is at least round(p * 2^24).
#pragma once

#include <stdint.h>

#include "fx_port.cuh"

namespace fx {

FX_DEVICE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  x ^= x >> 16;
  return x;
}

// The per-call key of a seed parameter (two int64 values below 2^31).
FX_DEVICE uint32_t dropout_key(const void* seed) {
  const int64_t* s = static_cast<const int64_t*>(seed);
  return mix32(static_cast<uint32_t>(s[0]) ^ mix32(static_cast<uint32_t>(s[1]) ^ 0x9E3779B9u));
}

FX_DEVICE uint32_t dropout_row_key(uint32_t key, int64_t row) {
  const uint64_t r = static_cast<uint64_t>(row);
  return mix32(static_cast<uint32_t>(r) ^ mix32(static_cast<uint32_t>(r >> 32) ^ key));
}

FX_DEVICE bool dropout_keeps(uint32_t row_key, int col, uint32_t threshold) {
  return (mix32(row_key ^ (static_cast<uint32_t>(col) * 0x9E3779B1u)) >> 8) >= threshold;
}

}  // namespace fx
