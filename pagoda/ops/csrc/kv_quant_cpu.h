// Quantized KV cache codes, shared by the cache write (fused_ops_cpu.cpp) and the paged
// attention reads (paged_attention_cpu.cpp). The formats and their rounding are
// pagoda/ops/kv_quant.py's, code for code:
//   int8:  code = round-half-even(x / scale) in [-127, 127], scale = amax / 127
//   fp8:   e4m3fn bits of x / scale clamped to [-448, 448] (round to nearest even,
//          subnormals kept), scale = amax / 448
// with amax = max |x| over one (token, kv head) row in float32; amax 0 -> scale 0, codes 0.
// This CPU has no fp8 instructions: encoding is bit arithmetic on the float32 bits, decoding
// a 256-entry table (scalar) or, in the AVX-512 reads, the bit trick of fp8_bits_as_f32.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace pagoda_kvq {

constexpr float kInt8Max = 127.0f;
constexpr float kFp8Max = 448.0f;

// The e4m3fn code of f, |f| <= 448 (no NaN or overflow can come in).
inline uint8_t fp8_encode(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  const uint32_t sign = (bits >> 24) & 0x80u;
  const float a = std::fabs(f);
  uint32_t mag;
  if (a < 0.015625f) {
    // Below the smallest normal (2^-6): subnormal steps of 2^-9; 8 steps is the smallest
    // normal's code (0x08), so the carry needs no special case.
    mag = static_cast<uint32_t>(std::nearbyint(a * 512.0f));
  } else {
    uint32_t abits;
    std::memcpy(&abits, &a, sizeof(abits));
    // Round the float32 mantissa to 3 bits, nearest even; a carry moves into the exponent.
    const uint32_t rounded = abits + 0x7FFFFu + ((abits >> 20) & 1u);
    mag = (rounded >> 20) - (120u << 3);  // float exponent bias 127 -> e4m3 bias 7
  }
  return static_cast<uint8_t>(sign | mag);
}

struct Fp8Table {
  float v[256];
  Fp8Table() {
    for (int c = 0; c < 256; ++c) {
      const int e = (c >> 3) & 0xF, m = c & 7;
      const float mag = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                               : std::ldexp(1.0f + m / 8.0f, e - 7);
      // NOTE: 0x7F / 0xFF are NaN in e4m3fn; the encoder never writes them.
      v[c] = (c & 0x80) ? -mag : mag;
    }
  }
};

inline float fp8_decode(uint8_t c) {
  static const Fp8Table table;
  return table.v[c];
}

// An fp8 code's bits placed as a float32 (sign at bit 31, exponent and mantissa at bits
// 26..20) is the code's value times 2^-120: the AVX-512 reads widen a code this way in
// three ops (sign-extend, shift, and) and multiply the scale by kFp8Unit instead.
constexpr float kFp8Unit = 0x1p120f;

// Quantize one row of n values (any type convertible to float) into codes and a scale.
template <typename T, typename Code>
inline float quantize_row(const T* x, Code* codes, int64_t n) {
  constexpr bool kInt8 = std::is_same_v<Code, int8_t>;
  constexpr float kMax = kInt8 ? kInt8Max : kFp8Max;
  float amax = 0.0f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float scale = amax / kMax;
  const float div = scale == 0.0f ? 1.0f : scale;
  for (int64_t i = 0; i < n; ++i) {
    const float y = std::min(kMax, std::max(-kMax, static_cast<float>(x[i]) / div));
    if constexpr (kInt8) {
      codes[i] = static_cast<int8_t>(std::nearbyint(y));
    } else {
      codes[i] = fp8_encode(y);
    }
  }
  return scale;
}

}  // namespace pagoda_kvq
