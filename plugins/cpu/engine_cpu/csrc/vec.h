// AVX512 (and, at the end, AVX2) helpers shared by the engine-cpu kernels.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>
#include <cstdint>
#include <type_traits>

namespace engine_cpu {

// exp(v) = 2^k * exp(g), k = round(v log2 e), g = v - k ln 2 in [-0.35, 0.35];
// Taylor to g^7 (relative error below 1e-8 there). Inputs below -87 give ~0.
inline __m512 exp512(__m512 v) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f), ln2 = _mm512_set1_ps(0.69314718055994531f);
  v = _mm512_min_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  __m512 k = _mm512_roundscale_ps(_mm512_mul_ps(v, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 g = _mm512_fnmadd_ps(k, ln2, v);
  __m512 p = _mm512_set1_ps(1.f / 5040);
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 720));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, g, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, k);
}

// 16 bf16 <-> 16 fp32 (round to nearest even on the way down, as torch does; NaN stays NaN)
inline __m512 load_bf16(const void* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
}
inline __m256i to_bf16_bits(__m512 v) {
#if defined(__AVX512BF16__)
  // the instruction rounds to nearest even too; NaNs become torch's canonical one
  const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(v);
  return _mm256_mask_mov_epi16(rounded, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm256_set1_epi16(0x7fc0));
#else
  __m512i bits = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(bits, _mm512_set1_epi32(0x7fff)), lsb), 16);
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  rounded = _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
  return _mm512_cvtepi32_epi16(rounded);
#endif
}
inline void store_bf16(void* p, __m512 v) { _mm256_storeu_si256(static_cast<__m256i*>(p), to_bf16_bits(v)); }
// what storing to bf16 and loading back gives
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16_bits(v)), 16));
}

// silu(g) * u of bf16 values g and u (as fp32), as silu_and_mul and amx_gated_linear compute it:
// g / (1 + e^-g) with the reciprocal from its 14-bit estimate and one Newton step (a division's
// throughput is a sixteenth of a multiply's), rounded to bf16, times u; the caller rounds. The
// products and sums use the rounding-mode forms, which -ffast-math cannot reorder or fuse, so
// every kernel inlining this gets the same bits.
inline __m512 silu_mul(__m512 g, __m512 u) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 den = _mm512_add_round_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), g)), kNearest);
  const __m512 est = _mm512_rcp14_ps(den);
  const __m512 inv = _mm512_mul_round_ps(est, _mm512_fnmadd_ps(den, est, _mm512_set1_ps(2.f)), kNearest);
  return _mm512_mul_round_ps(round_bf16(_mm512_mul_round_ps(g, inv, kNearest)), u, kNearest);
}

// run(std::integral_constant<int, D>{}) for the head sizes of the packed cache (16..256)
template <typename F>
inline void with_head_size(int64_t head_size, F&& run) {
  switch (head_size) {
    case 16: run(std::integral_constant<int, 16>{}); break;
    case 32: run(std::integral_constant<int, 32>{}); break;
    case 64: run(std::integral_constant<int, 64>{}); break;
    case 128: run(std::integral_constant<int, 128>{}); break;
    default: run(std::integral_constant<int, 256>{}); break;
  }
}

}  // namespace engine_cpu
#endif

#if defined(__AVX2__)
#include <immintrin.h>

namespace engine_cpu {

// 8 lanes summed as ((0+4)+(2+6)) + ((1+5)+(3+7)): a fixed tree
inline float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps(quarter, quarter, 1)));
}

}  // namespace engine_cpu
#endif
