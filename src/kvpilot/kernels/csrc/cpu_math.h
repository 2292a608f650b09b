// Math shared by the CPU kernels: scalar functions written so that a loop calling them
// vectorizes, and the bf16 vector load.
#pragma once

#include <bit>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kvpilot_cpu {

// exp(x) for any finite x: Cephes' expf polynomial after a Cody-Waite reduction, about
// 1 ulp, clamped to [-87, 88] (exp(-87) ~ 1.6e-38, exp(88) ~ 1.7e38). n = round(x log2 e)
// comes from adding 1.5 * 2^23 (the float's low mantissa bits then hold n), so every step
// is a plain float or int operation and a loop calling it vectorizes (std::floor and
// std::exp do not, under the default math flags; the build also passes
// -fno-trapping-math so that the clamps become min/max).
inline float exp_poly(float v) {
  constexpr float kShift = 12582912.0f;  // 1.5 * 2^23
  v = v < -87.0f ? -87.0f : (v > 88.0f ? 88.0f : v);
  const float shifted = v * 1.44269504088896341f + kShift;
  const int32_t n = std::bit_cast<int32_t>(shifted) - std::bit_cast<int32_t>(kShift);
  const float fx = shifted - kShift;
  v = v - fx * 0.693359375f + fx * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * v + 1.3981999507e-3f;
  y = y * v + 8.3334519073e-3f;
  y = y * v + 4.1665795894e-2f;
  y = y * v + 1.6666665459e-1f;
  y = y * v + 5.0000001201e-1f;
  y = y * v * v + v + 1.0f;
  return y * std::bit_cast<float>((n + 127) << 23);
}

#if defined(__AVX512F__)
// 16 bf16 values at p as fp32 (exact: a bf16 is the high half of an fp32's bits).
inline __m512 load_bf16x16(const void* p) {
  const __m256i h = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

}  // namespace kvpilot_cpu
