// Group-quantized linear layers (engine.interfaces.group_quant's layout): out = x @ W^T + bias with
// W[n, k] = scales[n, k / g] * q[n, k] - offsets[n, k / g], q stored in 4 bits (two a byte, even k
// in the low nibble), 6 (each row's low nibbles as for 4 bits, then its top 2 bits, 32 bytes per
// chunk of 128 inputs: byte i holds those of the chunk's inputs 2i, 2i + 64, 2i + 1 and 2i + 65, two
// bits each from bit 0) or 8. Two-level scales (the GGUF k-quants): int8 codes
// per group times an fp32 per super-block of S groups, expanded per output row into fp32 (each
// product exact for the k-quants, the reference's value) before the row's sums. Symmetric weights
// hold no offsets but a zero: each group's offset is zero times its scale (an fp32 product).
//
// 6 bits: the low nibbles take the 4-bit path and the top bits are or-ed in above them. A chunk's
// even inputs (the low nibbles' vector) find theirs in bits 0-1 (first 32) and 2-3 (last 32) of
// its 32 top bytes, the odd inputs in bits 4-5 and 6-7: the int8 path broadcasts the 32 bytes to
// both halves of a vector and shifts each half into place.
//
// Decode (up to kDecodeRows rows of x): a step reads every weight once, so its speed is the speed at
// which the packed bytes stream in and are unpacked in registers. Per output row and group,
//   y += s * dot(x_g, q_g) - m * sum(x_g)
// with the sums of x per group computed once per call: the integers are widened to fp32 lanes and
// multiplied with x directly, never dequantized. For 4 bits, x is first reordered per chunk of
// inputs (the even inputs of the chunk, then the odd ones), so that the low and the high nibbles of
// a load of bytes each meet a contiguous vector of x. Each row keeps two partial sums per group and
// two accumulators over alternating groups (the fma chains that bound a single row otherwise).
// AVX-512: 32 inputs (16 bytes) a step for 4 bits, 16 for 8; AVX2: 16 and 8; group sizes that do
// not hold whole steps, and the generic build, take plain C++.
//
// int8 activations (bf16 x, builds with AVX512-VNNI, when the caller allows them): each row of x is
// quantized per block of inputs (the group, at most one chunk of 128 inputs for 4 bits, 64 for 8)
// to int8 with the symmetric scale dx = max|x| / 127 (round to nearest even), and the unsigned
// weight integers meet them in vpdpbusd, four products summed in int32 a lane:
//   y += s * dx * dot_int(q_g, xq_g) - m * sum(x_g)
// with sum(x_g) the exact fp32 sum of the unquantized x, so only the s q x part carries the
// activations' rounding: at most sum_k |s q_k| dx_k / 2 (the contract the tests check). A chunk's
// 16 int32 lanes each cover one block (8 inputs a lane for 4 bits, 4 for 8), scaled in fp32 by
// their block's s * dx. This is llama.cpp's scheme (Q8 activations); it reads the same bytes and
// does a quarter of the instructions of the fp32 path. Decode rows against 4-bit groups of 32 (the
// GGUF Q4_K and Q4_0 layers) take windows of 16 groups, transposed so that a lane holds a group
// (rows_windows below): the 32000 x 512 Q4_K head 16.8 -> 13.9 ns a row on one thread at one row
// of x; at 2, 4 and 8 rows 570 -> 378, 876 -> 599 and 1535 -> 1174 us on two.
//
// More rows (prefill, large batches): with bf16 x, an AMX build and groups of whole 32-input steps,
// the same sums on AMX tiles (the integers are exact in bf16, so each product is; see amx_prefill).
// Otherwise each thread dequantizes a tile of output rows and of inputs to fp32 and multiplies it
// with the BLAS (fp32 sums as the reference, never the whole dense weight), accumulating the
// tiles' products over the inputs in fp32.
#include "kernel.h"

#include "amx.h"
#include "vec.h"

#include <ATen/ops/addmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

#if defined(ENGINE_CPU_AMX)
bool amx_supported();  // amx_linear.cpp: an AMX build, and the OS lets this process use the tiles
#endif

namespace {

constexpr int64_t kDecodeRows = 8;        // rows of x up to which the unpacking kernel runs
constexpr int64_t kTileOutputs = 64;      // output rows of a dequantized tile (prefill)
constexpr int64_t kTileInputs = 1024;     // inputs of a dequantized tile, rounded to whole groups
constexpr int64_t kDecodeGrainRows = 16;  // output rows per parallel_for grain (decode)

struct Weight {
  const uint8_t* q;  // [N, K * bits / 8]
  const void* scales;
  const void* offsets;  // [N, G]: fp32, or int8 codes with two levels; null with a zero
  const float* super_scales;
  const float* super_offsets;  // [N, G / S] (two levels) or null
  int64_t N, K, G, g, bits, S;  // S: groups a super-block (a power of two), 0 for one level
  int shift;                     // log2(S)
  int64_t zero;                  // >= 0: every offset is zero * its group's scale (no offsets)
  int64_t row_bytes() const { return K * bits / 8; }
  const uint8_t* row(int64_t n) const { return q + n * row_bytes(); }
  // the top 2 bits of a 6-bit row (32 bytes per chunk of 128 inputs, see the header)
  const uint8_t* top(int64_t n) const { return row(n) + K / 2; }
};

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// the lanes of 16 groups (from a multiple of 16) -> their super-block within the step: i >> shift
inline __m512i super_spread(int shift) {
  return _mm512_srli_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), std::min(shift, 4));
}

inline __mmask16 groups_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// groups j .. j + 15 (j a multiple of 16, lanes past G zero) of a row's two-level codes: code times
// its super-block's fp32 (the row's supers sp), one fp32 rounding as the reference
__attribute__((always_inline)) inline __m512 level16(const int8_t* codes, const float* sp, int64_t j, int64_t G, int shift, __m512i spread) {
  const int64_t left = std::min<int64_t>(16, G - j);
  const __m512 code = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(groups_mask(left), codes + j)));
  const int64_t supers_here = ((j + left - 1) >> shift) - (j >> shift) + 1;
  const __m512 sup = _mm512_permutexvar_ps(spread, _mm512_maskz_loadu_ps(groups_mask(supers_here), sp + (j >> shift)));
  return _mm512_mul_ps(sup, code);
}
#endif

// one level: each group's fp32 scale and offset; two: the codes times their super-block's fp32
inline void expand_level(const Weight& w, const void* codes, const float* supers, int64_t n, float* dst) {
  const int8_t* c = static_cast<const int8_t*>(codes) + n * w.G;
  const float* sp = supers + n * (w.G >> w.shift);
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
  const __m512i spread = super_spread(w.shift);
  for (int64_t j = 0; j < w.G; j += 16) {
    const __mmask16 mask = groups_mask(w.G - j);
    _mm512_mask_storeu_ps(dst + j, mask, level16(c, sp, j, w.G, w.shift, spread));
  }
#else
  for (int64_t j = 0; j < w.G; ++j) dst[j] = sp[j >> w.shift] * static_cast<float>(c[j]);
#endif
}

// a row's scales and offsets: pointers into the weight (one level) or expanded into s_buf, m_buf [G]
struct RowScales {
  const float* s;
  const float* m;
};

inline RowScales row_scales(const Weight& w, int64_t n, float* s_buf, float* m_buf) {
  const float* s = static_cast<const float*>(w.scales) + n * w.G;
  if (w.S) {
    expand_level(w, w.scales, w.super_scales, n, s_buf);
    s = s_buf;
  }
  if (w.zero >= 0) {
    const float zero = static_cast<float>(w.zero);
    for (int64_t j = 0; j < w.G; ++j) m_buf[j] = s[j] * zero;
    return {s, m_buf};
  }
  if (w.S == 0) return {s, static_cast<const float*>(w.offsets) + n * w.G};
  expand_level(w, w.offsets, w.super_offsets, n, m_buf);
  return {s, m_buf};
}

// value k of a row (plain C++)
inline uint32_t value_at(const Weight& w, int64_t n, int64_t k) {
  const uint8_t* q = w.row(n);
  if (w.bits == 8) return q[k];
  uint32_t v = (q[k >> 1] >> (4 * (k & 1))) & 0x0f;
  if (w.bits == 6) {
    const int64_t lane = (k & 127) >> 1;  // in the chunk's vector of even (or odd) inputs
    const int shift = 2 * static_cast<int>((lane >> 5) + 2 * (k & 1));
    v |= ((w.top(n)[(k >> 7) * 32 + (lane & 31)] >> shift) & 0x03) << 4;
  }
  return v;
}

// x in fp32, [T, K] (reordered for the 4-bit vector kernels), and its sums per group [T, G]
struct Input {
  const float* x;
  const float* sums;
  int64_t K, G;
};

// ---- plain C++: any group size, any build ----

// y[r] for R rows of x (starting at row t0) and output row n (its scales and offsets s, m)
void row_scalar(const Weight& w, const Input& in, int64_t n, const float* s, const float* m, int64_t t0, int64_t R,
                float* y) {
  for (int64_t r = 0; r < R; ++r) {
    const float* x = in.x + (t0 + r) * in.K;
    const float* xs = in.sums + (t0 + r) * in.G;
    float total = 0.f, offset = 0.f;
    for (int64_t j = 0; j < w.G; ++j) {
      float dot = 0.f;
      for (int64_t k = j * w.g; k < (j + 1) * w.g; ++k) dot += x[k] * static_cast<float>(value_at(w, n, k));
      total += s[j] * dot;
      offset += m[j] * xs[j];
    }
    y[r] = total - offset;
  }
}

// ---- AVX2: 4 bits 16 inputs a step, 8 bits 8 ----

#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kAvx2Rows = 2;  // rows of x per pass: 4 accumulators each, 16 ymm

using engine_cpu::sum8;  // vec.h

// the top bytes of the inputs k, k + 2, ... of a 6-bit row (k even), and the shifts to the top bits
// of the even input (the low nibble's) and of the odd one (see the header)
inline const uint8_t* top_bytes(const uint8_t* top, int64_t k, int& even_shift, int& odd_shift) {
  const int64_t lane = (k & 127) >> 1;
  even_shift = 2 * static_cast<int>(lane >> 5);
  odd_shift = even_shift + 4;
  return top + (k >> 7) * 32 + (lane & 31);
}

// sums[r] = dot(x_g, q_g) of the group starting at input k0, for R rows of x (two partial sums each);
// top: a 6-bit row's top bits
template <int R, int BITS>
__attribute__((always_inline)) inline void group_avx2(const uint8_t* q, const uint8_t* top, const float* x,
                                                      int64_t K, int64_t k0, int64_t g, __m256* sums) {
  __m256 p0[R], p1[R];
  for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm256_setzero_ps();
  if constexpr (BITS != 8) {
    const __m256i low = _mm256_set1_epi32(0x0f);
    for (int64_t k = k0; k < k0 + g; k += 16) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (k >> 1))));
      __m256i lo_i = _mm256_and_si256(b, low), hi_i = _mm256_srli_epi32(b, 4);
      if constexpr (BITS == 6) {
        int even_shift, odd_shift;
        const uint8_t* t = top_bytes(top, k, even_shift, odd_shift);
        const __m256i h = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(t)));
        const __m256i three = _mm256_set1_epi32(3);
        lo_i = _mm256_or_si256(lo_i, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(even_shift)), three), 4));
        hi_i = _mm256_or_si256(hi_i, _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, _mm_cvtsi32_si128(odd_shift)), three), 4));
      }
      const __m256 lo = _mm256_cvtepi32_ps(lo_i);
      const __m256 hi = _mm256_cvtepi32_ps(hi_i);
      for (int r = 0; r < R; ++r) {
        p0[r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + r * K + k), p0[r]);
        p1[r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + r * K + k + 8), p1[r]);
      }
    }
  } else {
    int64_t k = k0;
    for (; k + 16 <= k0 + g; k += 16) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
      for (int r = 0; r < R; ++r) {
        p0[r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + r * K + k), p0[r]);
        p1[r] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + r * K + k + 8), p1[r]);
      }
    }
    if (k < k0 + g) {  // g % 16 == 8
      const __m256 lo =
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + k))));
      for (int r = 0; r < R; ++r) p0[r] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x + r * K + k), p0[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm256_add_ps(p0[r], p1[r]);
}

template <int R, int BITS>
void row_avx2(const Weight& w, const Input& in, int64_t n, const float* s, const float* m, int64_t t0, float* y) {
  const uint8_t* q = w.row(n);
  const uint8_t* top = w.top(n);
  const float* x = in.x + t0 * in.K;
  const float* xs = in.sums + t0 * in.G;
  // alternate groups go to two accumulators: two independent fma chains
  __m256 a0[R], a1[R], u[R], v[R];
  float offset[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps(), offset[r] = 0.f;
  int64_t j = 0;
  for (; j + 1 < w.G; j += 2) {
    group_avx2<R, BITS>(q, top, x, in.K, j * w.g, w.g, u);
    group_avx2<R, BITS>(q, top, x, in.K, (j + 1) * w.g, w.g, v);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_fmadd_ps(u[r], _mm256_set1_ps(s[j]), a0[r]);
      a1[r] = _mm256_fmadd_ps(v[r], _mm256_set1_ps(s[j + 1]), a1[r]);
      offset[r] += m[j] * xs[r * in.G + j] + m[j + 1] * xs[r * in.G + j + 1];
    }
  }
  if (j < w.G) {
    group_avx2<R, BITS>(q, top, x, in.K, j * w.g, w.g, u);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_fmadd_ps(u[r], _mm256_set1_ps(s[j]), a0[r]);
      offset[r] += m[j] * xs[r * in.G + j];
    }
  }
  for (int r = 0; r < R; ++r) y[r] = sum8(_mm256_add_ps(a0[r], a1[r])) - offset[r];
}
#endif

// ---- AVX-512: 4 bits 32 inputs a step, 8 bits 16 ----

#if defined(__AVX512F__)
constexpr int64_t kAvx512Rows = 4;  // rows of x per pass: 4 accumulators each, 16 zmm

// 16 bytes of nibbles (inputs k .. k + 31 of a 4- or 6-bit row) -> the even inputs' values (lo) and
// the odd ones' (hi) as 16 int32 lanes each; 6 bits: with the top bits from `top` (16 bytes)
template <int BITS>
__attribute__((always_inline)) inline void unpack32_avx512(const uint8_t* q, const uint8_t* top, int64_t k,
                                                           __m512i& lo, __m512i& hi) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (k >> 1))));
  lo = _mm512_and_si512(b, _mm512_set1_epi32(0x0f));
  hi = _mm512_srli_epi32(b, 4);
  if constexpr (BITS == 6) {
    int even_shift, odd_shift;
    const uint8_t* t = top_bytes(top, k, even_shift, odd_shift);
    const __m512i h = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(t)));
    const __m512i three = _mm512_set1_epi32(3);
    lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h, _mm_cvtsi32_si128(even_shift)), three), 4));
    hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h, _mm_cvtsi32_si128(odd_shift)), three), 4));
  }
}

// sums[r] = dot(x_g, q_g) of the group starting at input k0, for R rows of x (two partial sums each)
template <int R, int BITS>
__attribute__((always_inline)) inline void group_avx512(const uint8_t* q, const uint8_t* top, const float* x,
                                                        int64_t K, int64_t k0, int64_t g, __m512* sums) {
  __m512 p0[R], p1[R];
  for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm512_setzero_ps();
  if constexpr (BITS != 8) {
    for (int64_t k = k0; k < k0 + g; k += 32) {
      __m512i lo_i, hi_i;
      unpack32_avx512<BITS>(q, top, k, lo_i, hi_i);
      const __m512 lo = _mm512_cvtepi32_ps(lo_i);
      const __m512 hi = _mm512_cvtepi32_ps(hi_i);
      for (int r = 0; r < R; ++r) {
        p0[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * K + k), p0[r]);
        p1[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * K + k + 16), p1[r]);
      }
    }
  } else {
    int64_t k = k0;
    for (; k + 32 <= k0 + g; k += 32) {
      const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + k));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes)));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1)));
      for (int r = 0; r < R; ++r) {
        p0[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * K + k), p0[r]);
        p1[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * K + k + 16), p1[r]);
      }
    }
    if (k < k0 + g) {  // g % 32 == 16
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(bytes));
      for (int r = 0; r < R; ++r) p0[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * K + k), p0[r]);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = _mm512_add_ps(p0[r], p1[r]);
}

template <int R, int BITS>
void row_avx512(const Weight& w, const Input& in, int64_t n, const float* s, const float* m, int64_t t0, float* y) {
  const uint8_t* q = w.row(n);
  const uint8_t* top = w.top(n);
  const float* x = in.x + t0 * in.K;
  const float* xs = in.sums + t0 * in.G;
  // alternate groups go to two accumulators: two independent fma chains
  __m512 a0[R], a1[R], u[R], v[R];
  float offset[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps(), offset[r] = 0.f;
  int64_t j = 0;
  for (; j + 1 < w.G; j += 2) {
    group_avx512<R, BITS>(q, top, x, in.K, j * w.g, w.g, u);
    group_avx512<R, BITS>(q, top, x, in.K, (j + 1) * w.g, w.g, v);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm512_fmadd_ps(u[r], _mm512_set1_ps(s[j]), a0[r]);
      a1[r] = _mm512_fmadd_ps(v[r], _mm512_set1_ps(s[j + 1]), a1[r]);
      offset[r] += m[j] * xs[r * in.G + j] + m[j + 1] * xs[r * in.G + j + 1];
    }
  }
  if (j < w.G) {
    group_avx512<R, BITS>(q, top, x, in.K, j * w.g, w.g, u);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm512_fmadd_ps(u[r], _mm512_set1_ps(s[j]), a0[r]);
      offset[r] += m[j] * xs[r * in.G + j];
    }
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r])) - offset[r];
}
#endif

// which kernel a weight's group size takes in this build, and the chunk of inputs its 4-bit x
// reordering works on (0: none)
enum class Path { kScalar, kAvx2, kAvx512 };

Path path_for(int64_t bits, int64_t g) {
#if defined(__AVX512F__)
  if (bits != 8 ? g % 32 == 0 : g % 16 == 0) return Path::kAvx512;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (bits != 8 ? g % 16 == 0 : g % 8 == 0) return Path::kAvx2;
#endif
  return Path::kScalar;
}

int64_t reorder_chunk(Path path, int64_t bits) {
  if (bits == 8) return 0;
  return path == Path::kAvx512 ? 32 : path == Path::kAvx2 ? 16 : 0;
}

// f(std::integral_constant<int, bits>) for the weight's storage bits
template <typename F>
inline void with_bits(int64_t bits, F&& f) {
  if (bits == 4)
    f(std::integral_constant<int, 4>{});
  else if (bits == 6)
    f(std::integral_constant<int, 6>{});
  else
    f(std::integral_constant<int, 8>{});
}

// R rows of x, one output row (its scales and offsets s, m): dispatch on the kernel, the storage
// bits and the (compile-time) row count
void row(Path path, const Weight& w, const Input& in, int64_t n, const float* s, const float* m, int64_t t0,
         int64_t R, float* y) {
#if defined(__AVX512F__)
  if (path == Path::kAvx512) {
    with_bits(w.bits, [&](auto b) {
      constexpr int B = decltype(b)::value;
      switch (R) {
        case 1: row_avx512<1, B>(w, in, n, s, m, t0, y); return;
        case 2: row_avx512<2, B>(w, in, n, s, m, t0, y); return;
        case 3: row_avx512<3, B>(w, in, n, s, m, t0, y); return;
        default: row_avx512<4, B>(w, in, n, s, m, t0, y); return;
      }
    });
    return;
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (path == Path::kAvx2) {
    with_bits(w.bits, [&](auto b) {
      constexpr int B = decltype(b)::value;
      if (R == 1)
        row_avx2<1, B>(w, in, n, s, m, t0, y);
      else
        row_avx2<2, B>(w, in, n, s, m, t0, y);
    });
    return;
  }
#endif
  row_scalar(w, in, n, s, m, t0, R, y);
}

int64_t pass_rows(Path path) {
#if defined(__AVX512F__)
  if (path == Path::kAvx512) return kAvx512Rows;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (path == Path::kAvx2) return kAvx2Rows;
#endif
  return kDecodeRows;
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const at::BFloat16* p, int64_t i) { return static_cast<float>(p[i]); }
#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) { return engine_cpu::load_bf16(p); }
#endif

// x [T, K] -> fp32 (the inputs of each `chunk` reordered: evens, then odds) and its sums per group
template <typename T>
void prepare_input(const T* x, int64_t T_, int64_t K, int64_t g, int64_t chunk, float* xf, float* sums) {
  const int64_t G = K / g;
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const T* xr = x + t * K;
      float* out = xf + t * K;
      if (chunk == 0) {
        for (int64_t k = 0; k < K; ++k) out[k] = load(xr, k);
      } else {
        for (int64_t c = 0; c < K; c += chunk)
          for (int64_t i = 0; i < chunk / 2; ++i) {
            out[c + i] = load(xr, c + 2 * i);
            out[c + chunk / 2 + i] = load(xr, c + 2 * i + 1);
          }
      }
      for (int64_t j = 0; j < G; ++j) {
        float total = 0.f;
        for (int64_t k = j * g; k < (j + 1) * g; ++k) total += load(xr, k);
        sums[t * G + j] = total;
      }
    }
  });
}

template <typename T>
void store_row(T* out, int64_t n, float v, const float* bias) {
  if (bias != nullptr) v += bias[n];
  out[n] = static_cast<T>(v);  // bf16: round to nearest even, once
}

// ---- AVX512-VNNI: int8 activations (see the header) ----

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
constexpr int64_t kVnniRows = 4;  // rows of x per pass
// output rows ahead whose bytes a pass asks the cache for: the weights stream in faster than the
// hardware prefetcher fetches them alone (the 32000 x 512 Q4_K head: 350 -> 310 us)
constexpr int64_t kPrefetchRows = 8;

// inputs per chunk: one 64-byte load of (low) weights
constexpr int64_t vnni_chunk(int64_t bits) { return bits != 8 ? 128 : 64; }

// whether the int8 path takes this weight: whole chunks, and blocks (min(g, chunk)) of whole lanes
bool vnni_fits(int64_t bits, int64_t K, int64_t g) {
  const int64_t chunk = vnni_chunk(bits), lane = bits != 8 ? 8 : 4;
  if (K % chunk != 0) return false;
  return g % chunk == 0 || (chunk % g == 0 && g % lane == 0);
}

// x quantized: xq [T, K] int8 (4 bits: each chunk's even inputs, then its odd ones); dx [T, K / chunk,
// 16]: the scale of each lane's block, per chunk (a lane covers 8 inputs for 4 bits, 4 for 8)
struct QuantInput {
  const int8_t* xq;
  const float* dx;
  const float* sums;  // [T, G_pad] exact sums of x per group, zero past G
  int64_t K, G_pad;
  const int32_t* lane_block;    // [16] each lane's block within its chunk
  const int64_t* chunk_group;  // [K / chunk] the group of each chunk's first input
};

template <typename T>
void quantize_input(const T* x, int64_t T_, int64_t K, int64_t g, int64_t bits, int64_t G_pad, int8_t* xq,
                    float* dx, float* sums) {
  const int64_t chunk = vnni_chunk(bits), block = std::min(g, chunk), G = K / g;
  const int64_t lane_inputs = bits != 8 ? 8 : 4;
  // 16 inputs a vector where groups and blocks hold whole vectors (the same values as the plain
  // loops: the scale's inverse rounded once, products rounded to nearest even; the group sums
  // add in another order)
  const bool vector = g % 16 == 0 && block % 16 == 0;
  at::parallel_for(0, T_, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(K), scale(K / block);
    std::vector<int8_t> natural(K);
    for (int64_t t = t0; t < t1; ++t) {
      const T* xr = x + t * K;
      if (vector) {
        for (int64_t k = 0; k < K; k += 16) _mm512_storeu_ps(xf.data() + k, load16(xr + k));
        for (int64_t j = 0; j < G; ++j) {
          __m512 total = _mm512_setzero_ps();
          for (int64_t k = j * g; k < (j + 1) * g; k += 16) total = _mm512_add_ps(total, _mm512_loadu_ps(xf.data() + k));
          sums[t * G_pad + j] = _mm512_reduce_add_ps(total);
        }
        for (int64_t j = G; j < G_pad; ++j) sums[t * G_pad + j] = 0.f;
        for (int64_t b = 0; b < K / block; ++b) {
          __m512 m = _mm512_setzero_ps();
          for (int64_t k = b * block; k < (b + 1) * block; k += 16) m = _mm512_max_ps(m, _mm512_abs_ps(_mm512_loadu_ps(xf.data() + k)));
          const float amax = _mm512_reduce_max_ps(m);
          const float inv = amax > 0.f ? 127.f / amax : 0.f;
          scale[b] = amax / 127.f;
          const __m512 vinv = _mm512_set1_ps(inv), hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
          for (int64_t k = b * block; k < (b + 1) * block; k += 16) {
            const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xf.data() + k), vinv),
                                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            const __m512i q = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
            _mm_storeu_si128(reinterpret_cast<__m128i*>(natural.data() + k), _mm512_cvtsepi32_epi8(q));
          }
        }
      } else {
        for (int64_t k = 0; k < K; ++k) xf[k] = load(xr, k);
        for (int64_t j = 0; j < G_pad; ++j) {
          float total = 0.f;
          if (j < G)
            for (int64_t k = j * g; k < (j + 1) * g; ++k) total += xf[k];
          sums[t * G_pad + j] = total;
        }
        for (int64_t b = 0; b < K / block; ++b) {
          float amax = 0.f;
          for (int64_t k = b * block; k < (b + 1) * block; ++k) amax = std::max(amax, std::abs(xf[k]));
          const float inv = amax > 0.f ? 127.f / amax : 0.f;
          scale[b] = amax / 127.f;
          for (int64_t k = b * block; k < (b + 1) * block; ++k)
            natural[k] = static_cast<int8_t>(std::clamp(std::nearbyint(xf[k] * inv), -127.f, 127.f));
        }
      }
      int8_t* out = xq + t * K;
      float* lanes = dx + t * (K / chunk) * 16;
      for (int64_t c = 0; c < K; c += chunk) {
        if (bits != 8) {  // the chunk's even inputs, then its odd ones: the low bytes of 16-bit pairs, then the high
          for (int64_t h = 0; h < 2; ++h) {
            const __m512i v = _mm512_loadu_si512(natural.data() + c + 64 * h);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c + 32 * h), _mm512_cvtepi16_epi8(v));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c + 64 + 32 * h),
                                _mm512_cvtepi16_epi8(_mm512_srli_epi16(v, 8)));
          }
        } else {
          std::memcpy(out + c, natural.data() + c, chunk);
        }
        for (int64_t L = 0; L < 16; ++L) lanes[c / chunk * 16 + L] = scale[(c + L * lane_inputs) / block];
      }
    }
  });
}

// 4 sums of 16 lanes -> the 4 totals (lanes 0..3)
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 a01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 a23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512 q = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23))),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(a01), _mm512_castps_pd(a23))));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(q), _mm512_extractf32x8_ps(q, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// the 16 groups from `window` (a multiple of 16; lanes past G zero) of output row `row`: their scales
// sv and offsets mv, each as the reference's fp32 value (TWO: the two-level codes times their
// super-block's float; otherwise the row's fp32 scales and offsets; a zero: zero times the scales)
template <bool TWO>
__attribute__((always_inline)) inline void window_scales(const Weight& w, int64_t row, int64_t window, __m512i spread,
                                                         __m512& sv, __m512& mv) {
  if constexpr (TWO) {
    const int64_t supers = w.G >> w.shift;
    sv = level16(static_cast<const int8_t*>(w.scales) + row * w.G, w.super_scales + row * supers, window, w.G,
                 w.shift, spread);
    if (w.zero < 0) {
      mv = level16(static_cast<const int8_t*>(w.offsets) + row * w.G, w.super_offsets + row * supers, window, w.G,
                   w.shift, spread);
      return;
    }
  } else {
    const __mmask16 mask = groups_mask(w.G - window);
    sv = _mm512_maskz_loadu_ps(mask, static_cast<const float*>(w.scales) + row * w.G + window);
    if (w.zero < 0) {
      mv = _mm512_maskz_loadu_ps(mask, static_cast<const float*>(w.offsets) + row * w.G + window);
      return;
    }
  }
  mv = _mm512_mul_ps(sv, _mm512_set1_ps(static_cast<float>(w.zero)));
}

// acc[o * R + r] += the sums of chunks [c_begin, c_end) for O output rows from n and R rows of x
// from t0 (c_begin the first chunk of a window). The chunks run in windows of 16 groups (a chunk
// never straddles one: it holds 1, 2, 4, 8 or 16 whole groups or lies within one): on entering a
// window each row's 16 scales are made once in a register and the window's offset term is taken
// (window_scales); each chunk then picks its lanes' scales with one permute.
template <int O, int R, int BITS, bool TWO>
__attribute__((always_inline)) inline void chunks_vnni(const Weight& w, const QuantInput& in, int64_t n, int64_t t0,
                                                       int64_t c_begin, int64_t c_end, __m512* acc) {
  constexpr int64_t chunk = BITS != 8 ? 128 : 64;
  const int64_t chunks = in.K / chunk;
  const __m512i lanes = _mm512_loadu_si512(in.lane_block);
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  // 6 bits: per 16-bit lane, the shift that brings a half's top bits to bits 4-5 (lower half, upper)
  const __m512i even_up = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
  const __m512i odd_down = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
  const __m512i spread = super_spread(w.shift);
  __m512 sv[O];  // the window's 16 scales of each output row
  int64_t window = -1;
  for (int64_t c = c_begin; c < c_end; ++c) {
    const int64_t j0 = in.chunk_group[c];  // the group of the chunk's first input
    if ((j0 & ~int64_t{15}) != window) {
      window = j0 & ~int64_t{15};
      __m512 xs[R];
      for (int r = 0; r < R; ++r) xs[r] = _mm512_loadu_ps(in.sums + (t0 + r) * in.G_pad + window);
      for (int o = 0; o < O; ++o) {
        __m512 mv;
        window_scales<TWO>(w, n + o, window, spread, sv[o], mv);
        // minus sum_j m_j sum(x_j) over the window's groups (the sums are zero past G)
        for (int r = 0; r < R; ++r) acc[o * R + r] = _mm512_fnmadd_ps(mv, xs[r], acc[o * R + r]);
      }
    }
    const __m512i pick = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(j0 - window)));
    __m512i xv[R][2];
    __m512 dv[R];
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = in.xq + (t0 + r) * in.K + c * chunk;
      xv[r][0] = _mm512_loadu_si512(xr);
      if constexpr (BITS != 8) xv[r][1] = _mm512_loadu_si512(xr + 64);
      dv[r] = _mm512_loadu_ps(in.dx + ((t0 + r) * chunks + c) * 16);
    }
    for (int o = 0; o < O; ++o) {
      __m512i lo, hi = _mm512_setzero_si512();
      // the same bytes kPrefetchRows rows on (past the last row: a prefetch never faults)
      _mm_prefetch(reinterpret_cast<const char*>(w.row(n + o + kPrefetchRows) + c * 64), _MM_HINT_T0);
      if constexpr (BITS == 6)
        _mm_prefetch(reinterpret_cast<const char*>(w.top(n + o + kPrefetchRows) + c * 32), _MM_HINT_T0);
      if constexpr (BITS != 8) {
        const __m512i b = _mm512_loadu_si512(w.row(n + o) + c * chunk / 2);
        lo = _mm512_and_si512(b, nibble);
        hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
        if constexpr (BITS == 6) {
          // the chunk's 32 top bytes in both halves; each half's bits shifted to bits 4-5 of its
          // bytes (even inputs: 0-1 and 2-3, odd: 4-5 and 6-7), then or-ed in above the nibbles
          const __m512i t = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.top(n + o) + c * 32)));
          const __m512i field = _mm512_set1_epi8(0x30);
          lo = _mm512_ternarylogic_epi32(lo, _mm512_sllv_epi16(t, even_up), field, 0xf8);  // lo | (t' & field)
          hi = _mm512_ternarylogic_epi32(hi, _mm512_srlv_epi16(t, odd_down), field, 0xf8);
        }
      } else {
        lo = _mm512_loadu_si512(w.row(n + o) + c * chunk);
      }
      const __m512 ws = _mm512_permutexvar_ps(pick, sv[o]);  // the scale of each lane's group
      for (int r = 0; r < R; ++r) {
        __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xv[r][0]);
        if constexpr (BITS != 8) d = _mm512_dpbusd_epi32(d, hi, xv[r][1]);
        acc[o * R + r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws, dv[r]), acc[o * R + r]);
      }
    }
  }
}

// y[o * R + r] for O output rows from n (O 1, 2 or 8) and R rows of x from t0: chunks_vnni over all
// of a row's chunks
template <int O, int R, int BITS, bool TWO>
void row_vnni(const Weight& w, const QuantInput& in, int64_t n, int64_t t0, float* y) {
  __m512 acc[O * R];
  for (int i = 0; i < O * R; ++i) acc[i] = _mm512_setzero_ps();
  chunks_vnni<O, R, BITS, TWO>(w, in, n, t0, 0, in.K / (BITS != 8 ? 128 : 64), acc);
  if constexpr (R == 1 && O % 4 == 0) {  // four rows' sums share a reduction
    for (int o = 0; o < O; o += 4) _mm_storeu_ps(y + o, reduce4(acc[o], acc[o + 1], acc[o + 2], acc[o + 3]));
  } else {
    for (int i = 0; i < O * R; ++i) y[i] = _mm512_reduce_add_ps(acc[i]);
  }
}

// ---- 4-bit weights in groups of 32, decode rows of x: a window of 16 groups a vector ----
//
// row_vnni spends, per chunk and output row, a permute and two multiplies on scales, since a chunk's
// lanes hold 4 groups (and the zmm instructions, not the bytes, bound a batch-1 step: one zmm op a
// cycle here). Where the groups are 32 inputs (16 bytes of nibbles), the 4 chunks of a window of
// 512 inputs are transposed in registers instead (8 dword permutes): lane L then holds group L's
// bytes in each of 4 steps, a group's integer sums add up in one lane, and the window's 16 scales
// meet them once:
//   y += sum_L cvt(dot_L) * s_L * dx_L - sum_L m_L * sum(x_L)
// x takes the same transpose of its chunks (once per call, in place). The even inputs' nibbles are
// masked (byte & 0x0f), the odd ones' left in place (byte & 0xf0, 16 times their value: below 256),
// each summed in its own int32 lane; the odd sum, exactly 16 times the true one, is shifted back
// before they add. The chunks past the last whole window take row_vnni's steps.
constexpr int64_t kWindowChunks = 4;  // chunks of 128 inputs a window of 16 groups of 32
constexpr int kWindowRows = 4;        // output rows through a window together

struct WindowTranspose {
  __m512i first, second, even, odd;  // the permutes' indices (see transpose_window)
};

inline WindowTranspose window_transpose() {
  alignas(64) int32_t first[16], second[16], even[16], odd[16];
  for (int i = 0; i < 16; ++i) {
    // stage 1: groups 0-7 of chunks (0, 1) (or 8-15 of (2, 3)): group i % 8, step i / 8 (first) or
    // 2 + i / 8 (second); group g sits in chunk g / 4, dwords 4 (g % 4) .. + 3
    const int g = i % 8;
    first[i] = (g / 4) * 16 + 4 * (g % 4) + i / 8;
    second[i] = first[i] + 2;
    // stage 2: lane L's group from the first pair (L < 8) or the second, at the step's half
    even[i] = i < 8 ? i : i + 8;
    odd[i] = i < 8 ? i + 8 : i + 16;
  }
  return {_mm512_load_si512(first), _mm512_load_si512(second), _mm512_load_si512(even), _mm512_load_si512(odd)};
}

// z[c]: chunk c's 16 dwords (dword t: inputs 128 c + 8 t .. + 7, group 4 c + t / 4) -> y[s]: dword L
// is group L's dword s (its inputs 32 L + 8 s .. + 7)
__attribute__((always_inline)) inline void transpose_window(const __m512i* z, __m512i* y, const WindowTranspose& t) {
  const __m512i a01 = _mm512_permutex2var_epi32(z[0], t.first, z[1]);
  const __m512i b01 = _mm512_permutex2var_epi32(z[0], t.second, z[1]);
  const __m512i a23 = _mm512_permutex2var_epi32(z[2], t.first, z[3]);
  const __m512i b23 = _mm512_permutex2var_epi32(z[2], t.second, z[3]);
  y[0] = _mm512_permutex2var_epi32(a01, t.even, a23);
  y[1] = _mm512_permutex2var_epi32(a01, t.odd, a23);
  y[2] = _mm512_permutex2var_epi32(b01, t.even, b23);
  y[3] = _mm512_permutex2var_epi32(b01, t.odd, b23);
}

// x quantized (quantize_input's chunks: 64 bytes of even inputs, then 64 of odd ones) -> each whole
// window's even and odd halves transposed as the weights' chunks, in place; the chunks past the
// last whole window stay as they are
void transpose_input_windows(int8_t* xq, int64_t T_, int64_t K) {
  const WindowTranspose t = window_transpose();
  const int64_t windows = K / (kWindowChunks * 128);
  for (int64_t r = 0; r < T_; ++r)
    for (int64_t win = 0; win < windows; ++win) {
      int8_t* base = xq + r * K + win * kWindowChunks * 128;
      for (int64_t half = 0; half < 2; ++half) {
        __m512i z[4], y[4];
        for (int c = 0; c < 4; ++c) z[c] = _mm512_loadu_si512(base + c * 128 + half * 64);
        transpose_window(z, y, t);
        for (int step = 0; step < 4; ++step) _mm512_storeu_si512(base + step * 128 + half * 64, y[step]);
      }
    }
}

// output rows n .. n + P - 1 against rows t0 .. t0 + R - 1 of x (4 bits, groups of 32; x as
// transpose_input_windows leaves it, group_dx [T, G_pad] the scale of each group of each row of x):
// the sums of output row n + p and row t0 + r of x in 16 fp32 lanes, acc[p * R + r]. The P output
// rows go through each window together (independent chains for the core to overlap), and each
// weight row's transpose and nibbles serve the R rows of x.
template <bool TWO, int P, int R>
__attribute__((always_inline)) inline void rows_windows(const Weight& w, const QuantInput& in, const float* group_dx,
                                                        const WindowTranspose& t, int64_t n, int64_t t0, __m512* acc) {
  const int64_t K = in.K, chunks = K / 128, windows = chunks / kWindowChunks;
  const __m512i low = _mm512_set1_epi8(0x0f), high = _mm512_set1_epi8(static_cast<char>(0xf0));
  const __m512i spread = super_spread(w.shift);
  for (int i = 0; i < P * R; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t win = 0; win < windows; ++win) {
    const int64_t window = win * 16;
    const int8_t* xr = in.xq + t0 * K + win * kWindowChunks * 128;
    __m512i even[P][R], odd[P][R];
    for (int p = 0; p < P; ++p) {
      const uint8_t* q = w.row(n + p) + win * kWindowChunks * 64;
      __m512i z[4], y[4];
      for (int c = 0; c < 4; ++c) {
        _mm_prefetch(reinterpret_cast<const char*>(q + kPrefetchRows * w.row_bytes() + c * 64), _MM_HINT_T0);
        z[c] = _mm512_loadu_si512(q + c * 64);
      }
      transpose_window(z, y, t);
      for (int r = 0; r < R; ++r) even[p][r] = odd[p][r] = _mm512_setzero_si512();
      for (int step = 0; step < 4; ++step) {
        const __m512i lo = _mm512_and_si512(y[step], low), hi = _mm512_and_si512(y[step], high);
        for (int r = 0; r < R; ++r) {
          even[p][r] = _mm512_dpbusd_epi32(even[p][r], lo, _mm512_loadu_si512(xr + r * K + step * 128));
          odd[p][r] = _mm512_dpbusd_epi32(odd[p][r], hi, _mm512_loadu_si512(xr + r * K + step * 128 + 64));
        }
      }
    }
    for (int p = 0; p < P; ++p) {
      __m512 sv, mv;  // the window's scales and offsets of row n + p: the offsets' term first
      window_scales<TWO>(w, n + p, window, spread, sv, mv);
      for (int r = 0; r < R; ++r)
        acc[p * R + r] = _mm512_fnmadd_ps(mv, _mm512_loadu_ps(in.sums + (t0 + r) * in.G_pad + window), acc[p * R + r]);
      for (int r = 0; r < R; ++r) {
        const __m512 dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even[p][r], _mm512_srai_epi32(odd[p][r], 4)));
        const __m512 dxv = _mm512_loadu_ps(group_dx + (t0 + r) * in.G_pad + window);
        acc[p * R + r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(sv, dxv), acc[p * R + r]);
      }
    }
  }
  if (windows * kWindowChunks < chunks)  // the chunks past the last whole window: row_vnni's steps
    chunks_vnni<P, R, 4, TWO>(w, in, n, t0, windows * kWindowChunks, chunks, acc);
}

// out = x W^T + bias for up to kDecodeRows rows of x against 4-bit groups of 32 (the windows above):
// one row of x takes 8 output rows a pass, four at a time through the windows; more rows of x take
// two output rows at a time against up to 2 rows of x, one against 3 or 4. Four sums share each
// reduction.
template <typename T>
void decode_windows(const Weight& w, QuantInput in, int8_t* xq, const float* dx, int64_t T_, const float* bias,
                    T* out) {
  transpose_input_windows(xq, T_, w.K);
  const int64_t chunks = w.K / 128;
  std::vector<float> group_dx(T_ * in.G_pad, 0.f);  // each group's x scale: its chunk's lanes, 4 a group
  for (int64_t r = 0; r < T_; ++r)
    for (int64_t j = 0; j < w.G; ++j) group_dx[r * in.G_pad + j] = dx[(r * chunks + j / 4) * 16 + (j % 4) * 4];
  const bool two = w.S > 0;
  constexpr int64_t kOutputs = 8;
  at::parallel_for(0, (w.N + kOutputs - 1) / kOutputs, kDecodeGrainRows / kOutputs, [&](int64_t b0, int64_t b1) {
    const WindowTranspose t = window_transpose();
    alignas(16) float y[kOutputs];
    __m512 acc[kOutputs];
    // P output rows from n against R rows of x from t0 -> acc
    auto run = [&](auto p_c, auto r_c, int64_t n, int64_t t0) {
      constexpr int PP = decltype(p_c)::value, RR = decltype(r_c)::value;
      two ? rows_windows<true, PP, RR>(w, in, group_dx.data(), t, n, t0, acc)
          : rows_windows<false, PP, RR>(w, in, group_dx.data(), t, n, t0, acc);
    };
    // the sums of acc[0 .. count) -> y, four to a reduction
    auto reduce = [&](int64_t count) {
      int64_t i = 0;
      for (; i + 4 <= count; i += 4) _mm_store_ps(y + i, reduce4(acc[i], acc[i + 1], acc[i + 2], acc[i + 3]));
      for (; i < count; ++i) y[i] = _mm512_reduce_add_ps(acc[i]);
    };
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kOutputs, outputs = std::min(kOutputs, w.N - n0);
      if (T_ == 1) {
        int64_t o = 0;
        for (; o + kWindowRows <= outputs; o += kWindowRows) {
          run(std::integral_constant<int, kWindowRows>{}, std::integral_constant<int, 1>{}, n0 + o, 0);
          reduce(kWindowRows);
          for (int64_t i = 0; i < kWindowRows; ++i) store_row(out, n0 + o + i, y[i], bias);
        }
        for (; o < outputs; ++o) {
          run(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{}, n0 + o, 0);
          reduce(1);
          store_row(out, n0 + o, y[0], bias);
        }
        continue;
      }
      // two output rows at a time against up to 2 rows of x, one against 3 or 4
      for (int64_t t0 = 0; t0 < T_; t0 += kVnniRows) {
        const int64_t R = std::min(kVnniRows, T_ - t0);
        for (int64_t n = n0; n < n0 + outputs;) {
          const int64_t P = R <= 2 && n + 2 <= n0 + outputs ? 2 : 1;
          switch (P * 8 + R) {
            case 17: run(std::integral_constant<int, 2>{}, std::integral_constant<int, 1>{}, n, t0); break;
            case 18: run(std::integral_constant<int, 2>{}, std::integral_constant<int, 2>{}, n, t0); break;
            case 9: run(std::integral_constant<int, 1>{}, std::integral_constant<int, 1>{}, n, t0); break;
            case 10: run(std::integral_constant<int, 1>{}, std::integral_constant<int, 2>{}, n, t0); break;
            case 11: run(std::integral_constant<int, 1>{}, std::integral_constant<int, 3>{}, n, t0); break;
            default: run(std::integral_constant<int, 1>{}, std::integral_constant<int, 4>{}, n, t0); break;
          }
          reduce(P * R);
          for (int64_t p = 0; p < P; ++p)
            for (int64_t r = 0; r < R; ++r) store_row(out + (t0 + r) * w.N, n + p, y[p * R + r], bias);
          n += P;
        }
      }
    }
  });
}

template <typename T>
void decode_int8(const Weight& w, const T* x, int64_t T_, const float* bias, T* out) {
  const int64_t chunk = vnni_chunk(w.bits), block = std::min(w.g, chunk);
  const int64_t lane_inputs = w.bits != 8 ? 8 : 4, G_pad = (w.G + 15) / 16 * 16;
  alignas(64) int32_t lane_block[16];
  for (int64_t L = 0; L < 16; ++L) lane_block[L] = static_cast<int32_t>(L * lane_inputs / block);
  std::vector<int64_t> chunk_group(w.K / chunk);
  for (int64_t c = 0; c < w.K / chunk; ++c) chunk_group[c] = c * chunk / w.g;
  std::vector<int8_t> xq(T_ * w.K);
  std::vector<float> dx(T_ * (w.K / chunk) * 16), sums(T_ * G_pad);
  quantize_input(x, T_, w.K, w.g, w.bits, G_pad, xq.data(), dx.data(), sums.data());
  const QuantInput in{xq.data(), dx.data(), sums.data(), w.K, G_pad, lane_block, chunk_group.data()};
  const bool two = w.S > 0;  // the kernel reads two-level codes itself
  if (w.bits == 4 && w.g == 32) {  // groups of 32: windows of 16 groups
    decode_windows(w, in, xq.data(), dx.data(), T_, bias, out);
    return;
  }
  // one row of x: 8 output rows a pass (more independent sums in flight; each 4 rows' reductions
  // share their shuffles): the 32000 x 512 Q6_K head 350 -> 320 us
  constexpr int64_t kOutputs = 8;
  at::parallel_for(0, (w.N + kOutputs - 1) / kOutputs, kDecodeGrainRows / kOutputs, [&](int64_t b0, int64_t b1) {
    float y[kOutputs * kVnniRows];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kOutputs, outputs = std::min(kOutputs, w.N - n0);
      const bool whole = T_ == 1 && outputs == kOutputs;
      with_bits(w.bits, [&](auto bits_c) {
        constexpr int B = decltype(bits_c)::value;
        if (whole) {
          two ? row_vnni<8, 1, B, true>(w, in, n0, 0, y) : row_vnni<8, 1, B, false>(w, in, n0, 0, y);
          for (int64_t o = 0; o < kOutputs; ++o) store_row(out, n0 + o, y[o], bias);
          return;
        }
        // up to 4 rows of x at a time, against two output rows at a time (the last one alone): the
        // pairs' sums are independent chains for the core to overlap (GPTQ g128 8192 x 512 at 2,
        // 4 and 8 rows of x: 124 -> 88, 188 -> 148 and 346 -> 291 us)
        for (int64_t t0 = 0; t0 < T_; t0 += kVnniRows) {
          const int64_t R = std::min(kVnniRows, T_ - t0);
          for (int64_t o = 0; o < outputs;) {
            const int64_t O = o + 2 <= outputs ? 2 : 1;
            auto run = [&](auto outs, auto rows) {
              constexpr int OO = decltype(outs)::value, RR = decltype(rows)::value;
              two ? row_vnni<OO, RR, B, true>(w, in, n0 + o, t0, y) : row_vnni<OO, RR, B, false>(w, in, n0 + o, t0, y);
            };
            using one = std::integral_constant<int, 1>;
            using pair = std::integral_constant<int, 2>;
            switch (O * 8 + R) {
              case 17: run(pair{}, one{}); break;
              case 18: run(pair{}, pair{}); break;
              case 19: run(pair{}, std::integral_constant<int, 3>{}); break;
              case 20: run(pair{}, std::integral_constant<int, 4>{}); break;
              case 9: run(one{}, one{}); break;
              case 10: run(one{}, pair{}); break;
              case 11: run(one{}, std::integral_constant<int, 3>{}); break;
              default: run(one{}, std::integral_constant<int, 4>{}); break;
            }
            for (int64_t i = 0; i < O; ++i)
              for (int64_t r = 0; r < R; ++r) store_row(out + (t0 + r) * w.N, n0 + o + i, y[i * R + r], bias);
            o += O;
          }
        }
      });
    }
  });
}
#endif

template <typename T>
void decode(const Weight& w, const T* x, int64_t T_, const float* bias, T* out) {
  const Path path = path_for(w.bits, w.g);
  std::vector<float> xf(T_ * w.K), sums(T_ * w.G);
  prepare_input(x, T_, w.K, w.g, reorder_chunk(path, w.bits), xf.data(), sums.data());
  const Input in{xf.data(), sums.data(), w.K, w.G};
  const int64_t rows_per_pass = pass_rows(path);
  at::parallel_for(0, w.N, kDecodeGrainRows, [&](int64_t n0, int64_t n1) {
    float y[kDecodeRows];
    std::vector<float> s_buf(w.G), m_buf(w.G);
    for (int64_t n = n0; n < n1; ++n) {
      const RowScales sm = row_scales(w, n, s_buf.data(), m_buf.data());
      for (int64_t t0 = 0; t0 < T_; t0 += rows_per_pass) {
        const int64_t R = std::min(rows_per_pass, T_ - t0);
        row(path, w, in, n, sm.s, sm.m, t0, R, y);
        for (int64_t r = 0; r < R; ++r) store_row(out + (t0 + r) * w.N, n, y[r], bias);
      }
    }
  });
}

// fp32 W[n0:n1, k0:k1] (k0, k1 whole groups) into dst [n1 - n0, k1 - k0]; s_buf, m_buf [G] scratch
void dequantize_tile(const Weight& w, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* dst, float* s_buf,
                     float* m_buf) {
  const int64_t width = k1 - k0;
  for (int64_t n = n0; n < n1; ++n) {
    const RowScales sm = row_scales(w, n, s_buf, m_buf);
    float* d = dst + (n - n0) * width;
    for (int64_t j = k0 / w.g; j < k1 / w.g; ++j) {
      const float s = sm.s[j], m = sm.m[j];
      for (int64_t k = j * w.g; k < (j + 1) * w.g; ++k) d[k - k0] = s * static_cast<float>(value_at(w, n, k)) - m;
    }
  }
}

template <typename T>
void prefill(const Weight& w, const torch::Tensor& x, const float* bias, T* out) {
  const int64_t T_ = x.size(0);
  const torch::Tensor xf = x.scalar_type() == at::kFloat ? x : x.to(at::kFloat);
  const int64_t width = std::min(w.K, std::max<int64_t>(1, kTileInputs / w.g) * w.g);
  const int64_t tiles = (w.N + kTileOutputs - 1) / kTileOutputs;
  const auto options = xf.options();
  // one tile per grain: every thread dequantizes and multiplies its own tiles (the matmul inside
  // a parallel region runs on its thread alone)
  at::parallel_for(0, tiles, 1, [&](int64_t b0, int64_t b1) {
    torch::Tensor tile = at::empty({kTileOutputs, width}, options);
    torch::Tensor y = at::empty({T_, kTileOutputs}, options);
    std::vector<float> s_buf(w.G), m_buf(w.G);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kTileOutputs, n1 = std::min(w.N, n0 + kTileOutputs), rows = n1 - n0;
      torch::Tensor yb = y.narrow(1, 0, rows);
      yb.zero_();
      for (int64_t k0 = 0; k0 < w.K; k0 += width) {
        const int64_t k1 = std::min(w.K, k0 + width);
        dequantize_tile(w, n0, n1, k0, k1, tile.data_ptr<float>(), s_buf.data(), m_buf.data());
        const torch::Tensor wt = at::from_blob(tile.data_ptr<float>(), {rows, k1 - k0}, {width, 1}, options);
        yb.addmm_(xf.narrow(1, k0, k1 - k0), wt.t());
      }
      const float* yp = y.data_ptr<float>();
      for (int64_t t = 0; t < T_; ++t)
        for (int64_t n = n0; n < n1; ++n) store_row(out + t * w.N, n, yp[t * kTileOutputs + n - n0], bias);
    }
  });
}

// ---- AMX (bf16 x, groups of whole 32-input steps): prefill on tiles ----
//
// C^T = Q X^T per group on tiles: A the weight's integers as bf16 (exact up to 255), row-major
// [32 outputs][K], B x packed [T/16][K/2][16][2] (16 rows of x a tile), so every product is
// exact and each group's sums are fp32; then y += s * C - m * sum(x_g) per group, as above.
// Tiles: 2 x 2 blocks of C (32 outputs by 32 rows of x), two A tiles and two B tiles.

#if defined(ENGINE_CPU_AMX)
constexpr int64_t kAmxOutputs = 32;  // output rows per pass (two A tiles)
constexpr int64_t kAmxRows = 32;     // rows of x per pass (two B tiles)

// W rows [n0, n0 + 32) as bf16 integers, row-major [32][K]; rows past N are zero
void unpack_rows_bf16(const Weight& w, int64_t n0, uint16_t* dst) {
  const int64_t K = w.K;
  for (int64_t r = 0; r < kAmxOutputs; ++r) {
    uint16_t* d = dst + r * K;
    if (n0 + r >= w.N) {
      std::memset(d, 0, K * sizeof(uint16_t));
      continue;
    }
    const uint8_t* q = w.row(n0 + r);
    const uint8_t* top = w.top(n0 + r);
    const int64_t low_bytes = w.bits == 8 ? K : K / 2;
    for (int64_t i = 0; i < low_bytes; i += 16) {
      if (w.bits != 8) {
        // byte i holds inputs 2i (low) and 2i + 1 (high): one 32-bit pair of bf16, low first
        __m512i lo_i, hi_i;
        if (w.bits == 6)
          unpack32_avx512<6>(q, top, 2 * i, lo_i, hi_i);
        else
          unpack32_avx512<4>(q, top, 2 * i, lo_i, hi_i);
        const __m512i lo = _mm512_castps_si512(_mm512_cvtepi32_ps(lo_i));
        const __m512i hi = _mm512_castps_si512(_mm512_cvtepi32_ps(hi_i));
        const __m512i pair =
            _mm512_or_si512(_mm512_srli_epi32(lo, 16), _mm512_and_si512(hi, _mm512_set1_epi32(-65536)));
        _mm512_storeu_si512(d + 2 * i, pair);
      } else {
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
        const __m512i v = _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(b)), 16);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), _mm512_cvtepi32_epi16(v));
      }
    }
  }
}

void amx_prefill(const Weight& w, const at::BFloat16* x, int64_t T_, const float* bias, at::BFloat16* out) {
  const int64_t K = w.K, P = K / 2, G = w.G;
  const int64_t T_pad = (T_ + kAmxRows - 1) / kAmxRows * kAmxRows;
  // x as B tiles [T_pad / 16][K / 2][16][2] (rows past T zero), and its sums per group [G][T_pad]
  std::vector<uint32_t> xb(T_pad / 16 * P * 16, 0);
  std::vector<float> sums(G * T_pad, 0.f);
  at::parallel_for(0, T_, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const at::BFloat16* xr = x + t * K;
      uint32_t* dst = xb.data() + (t / 16) * P * 16 + t % 16;
      for (int64_t p = 0; p < P; ++p) std::memcpy(dst + p * 16, xr + 2 * p, sizeof(uint32_t));
      for (int64_t j = 0; j < G; ++j) {
        float total = 0.f;
        for (int64_t k = j * w.g; k < (j + 1) * w.g; ++k) total += static_cast<float>(xr[k]);
        sums[j * T_pad + t] = total;
      }
    }
  });
  const int64_t units = (w.N + kAmxOutputs - 1) / kAmxOutputs;
  at::parallel_for(0, units, 1, [&](int64_t u0, int64_t u1) {
    engine_cpu::configure_tiles({{0, 16, 64}, {1, 16, 64}, {2, 16, 64}, {3, 16, 64},
                                 {4, 16, 64}, {5, 16, 64}, {6, 16, 64}, {7, 16, 64}});
    std::vector<uint16_t> a(kAmxOutputs * K);
    std::vector<float> unit_s(kAmxOutputs * G), unit_m(kAmxOutputs * G);  // the pass's rows' scales, offsets
    alignas(64) float c[4][16 * 16];
    alignas(64) float acc[kAmxOutputs][kAmxRows];  // [output][row of x]
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n0 = u * kAmxOutputs, outputs = std::min(kAmxOutputs, w.N - n0);
      unpack_rows_bf16(w, n0, a.data());
      for (int64_t n = 0; n < outputs; ++n) {
        const RowScales sm = row_scales(w, n0 + n, unit_s.data() + n * G, unit_m.data() + n * G);
        if (sm.s != unit_s.data() + n * G) std::memcpy(unit_s.data() + n * G, sm.s, G * sizeof(float));
        if (sm.m != unit_m.data() + n * G) std::memcpy(unit_m.data() + n * G, sm.m, G * sizeof(float));
      }
      for (int64_t t0 = 0; t0 < T_pad; t0 += kAmxRows) {
        std::memset(acc, 0, sizeof(acc));
        const uint32_t* b0 = xb.data() + (t0 / 16) * P * 16;
        const uint32_t* b1 = b0 + P * 16;
        for (int64_t j = 0; j < G; ++j) {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t k0 = j * w.g; k0 < (j + 1) * w.g; k0 += 32) {
            _tile_loadd(4, a.data() + k0, K * 2);
            _tile_loadd(5, a.data() + 16 * K + k0, K * 2);
            _tile_loadd(6, b0 + k0 / 2 * 16, 64);
            _tile_loadd(7, b1 + k0 / 2 * 16, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
          }
          _tile_stored(0, c[0], 64);
          _tile_stored(1, c[1], 64);
          _tile_stored(2, c[2], 64);
          _tile_stored(3, c[3], 64);
          for (int i = 0; i < 4; ++i) {
            const int64_t half = i % 2;  // which 16 rows of x
            const __m512 xs = _mm512_loadu_ps(sums.data() + j * T_pad + t0 + half * 16);
            for (int64_t r = 0; r < 16; ++r) {
              const int64_t n = (i / 2) * 16 + r;
              if (n >= outputs) break;
              const __m512 s = _mm512_set1_ps(unit_s[n * G + j]);
              const __m512 m = _mm512_set1_ps(unit_m[n * G + j]);
              float* dst = acc[n] + half * 16;
              const __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(c[i] + r * 16), s, _mm512_loadu_ps(dst));
              _mm512_storeu_ps(dst, _mm512_fnmadd_ps(m, xs, v));
            }
          }
        }
        // out[t0 + t, n0 + n] = acc[n][t] + bias, 16 outputs a store (gathered down acc's columns)
        const int64_t rows = std::min(kAmxRows, T_ - t0);
        const __m512i lanes = _mm512_mullo_epi32(
            _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_epi32(kAmxRows));
        for (int64_t h = 0; h < outputs; h += 16) {
          const int64_t valid = std::min<int64_t>(16, outputs - h);
          const __mmask16 mask = valid == 16 ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
          const __m512 bias_v = bias == nullptr ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(mask, bias + n0 + h);
          for (int64_t t = 0; t < rows; ++t) {
            const __m512 v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mask, lanes, &acc[h][t], 4);
            _mm256_mask_storeu_epi16(out + (t0 + t) * w.N + n0 + h, mask,
                                     engine_cpu::to_bf16_bits(_mm512_add_ps(v, bias_v)));
          }
        }
      }
    }
  });
}
#endif

}  // namespace

// out [T, N] = x [T, K] @ W^T + bias for a group-quantized W (engine.interfaces.group_quant):
// x and out fp32 or bf16 (one dtype), qweight uint8 [N, K * bits / 8], scales and offsets fp32
// [N, K / group_size] (super_group 0) or int8 codes with fp32 super_scales and super_offsets
// [N, K / group_size / super_group]; zero >= 0: no offsets (nor super_offsets), each offset zero
// times its scale; bias fp32 [N] or empty. fp32 sums; bf16 out rounded once.
// int8_activations: bf16 decode rows may be quantized to int8 (see the header) where this build has
// AVX512-VNNI.
void group_quant_linear(torch::Tensor out, torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        torch::Tensor offsets, torch::Tensor super_scales, torch::Tensor super_offsets,
                        int64_t bits, int64_t group_size, int64_t super_group, int64_t zero, torch::Tensor bias,
                        bool int8_activations) {
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "group_quant_linear: 4, 6 or 8 bits a value, not ", bits);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous(),
              "group_quant_linear: x and out must be contiguous 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "group_quant_linear: x must be fp32 or bf16, not ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "group_quant_linear: out must have x's dtype");
  const int64_t T_ = x.size(0), K = x.size(1), N = qweight.size(0), g = group_size;
  TORCH_CHECK(g > 0 && g % 2 == 0 && K % g == 0, "group_quant_linear: group_size ", g,
              " must be even and divide the ", K, " inputs");
  TORCH_CHECK(bits != 6 || K % 128 == 0, "group_quant_linear: 6-bit values come in chunks of 128 inputs, not ", K);
  const int64_t G = K / g, S = super_group;
  TORCH_CHECK(S >= 0 && (S & (S - 1)) == 0 && (S == 0 || G % S == 0), "group_quant_linear: super_group ", S,
              " must be 0 or a power of two dividing the ", G, " groups");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous() && qweight.dim() == 2 &&
                  qweight.size(1) == K * bits / 8,
              "group_quant_linear: qweight must be contiguous uint8 [N, ", K * bits / 8, "]");
  TORCH_CHECK(zero < 256, "group_quant_linear: zero ", zero, " must lie in [0, 256), or be negative for offsets");
  const auto code = S ? at::kChar : at::kFloat;
  std::vector<const torch::Tensor*> levels{&scales}, supers{&super_scales};
  if (zero < 0) levels.push_back(&offsets), supers.push_back(&super_offsets);
  for (const auto* t : levels)
    TORCH_CHECK(t->defined() && t->scalar_type() == code && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == G,
                "group_quant_linear: scales and offsets must be contiguous ", S ? "int8" : "fp32", " [", N, ", ", G,
                "]");
  if (S)
    for (const auto* t : supers)
      TORCH_CHECK(t->defined() && t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 &&
                      t->size(0) == N && t->size(1) == G / S,
                  "group_quant_linear: super_scales and super_offsets must be contiguous fp32 [", N, ", ", G / S, "]");
  TORCH_CHECK(out.size(0) == T_ && out.size(1) == N, "group_quant_linear: out must be [", T_, ", ", N, "]");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == at::kFloat),
              "group_quant_linear: bias must be fp32 [N] or empty");
  if (T_ == 0 || N == 0) return;
  const Weight w{qweight.data_ptr<uint8_t>(),
                 scales.data_ptr(),
                 zero < 0 ? offsets.data_ptr() : nullptr,
                 S ? super_scales.data_ptr<float>() : nullptr,
                 S && zero < 0 ? super_offsets.data_ptr<float>() : nullptr,
                 N,
                 K,
                 G,
                 g,
                 bits,
                 S,
                 S ? __builtin_ctzll(static_cast<unsigned long long>(S)) : 0,
                 zero < 0 ? -1 : zero};
  (void)int8_activations;  // builds without AVX512-VNNI
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  if (x.scalar_type() == at::kFloat) {
    if (T_ <= kDecodeRows)
      decode(w, x.data_ptr<float>(), T_, b, out.data_ptr<float>());
    else
      prefill(w, x, b, out.data_ptr<float>());
  } else {
    if (T_ <= kDecodeRows) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
      if (int8_activations && vnni_fits(bits, K, g)) {
        decode_int8(w, x.data_ptr<at::BFloat16>(), T_, b, out.data_ptr<at::BFloat16>());
        return;
      }
#endif
      decode(w, x.data_ptr<at::BFloat16>(), T_, b, out.data_ptr<at::BFloat16>());
      return;
    }
#if defined(ENGINE_CPU_AMX)
    if (g % 32 == 0 && amx_supported()) {
      amx_prefill(w, x.data_ptr<at::BFloat16>(), T_, b, out.data_ptr<at::BFloat16>());
      return;
    }
#endif
    prefill(w, x, b, out.data_ptr<at::BFloat16>());
  }
}

// group_quant_linear into a new [T, N] tensor of x's dtype; absent offsets (a zero), super tensors
// (one level) and bias may be None: one call from Python per layer, with no tensor made there
torch::Tensor group_quant_matmul(torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                                 std::optional<torch::Tensor> offsets, std::optional<torch::Tensor> super_scales,
                                 std::optional<torch::Tensor> super_offsets, int64_t bits, int64_t group_size,
                                 int64_t super_group, int64_t zero, std::optional<torch::Tensor> bias,
                                 bool int8_activations) {
  TORCH_CHECK(x.dim() == 2 && x.device().is_cpu() && qweight.device().is_cpu(),
              "group_quant_matmul: x must be 2-D, and x and the weight on the CPU");
  static const torch::Tensor no_bias = at::empty({0}, at::kFloat);
  torch::Tensor out = at::empty({x.size(0), qweight.size(0)}, x.options());
  const torch::Tensor none;
  group_quant_linear(out, x, qweight, scales, offsets.value_or(none), super_scales.value_or(none),
                     super_offsets.value_or(none), bits, group_size, super_group, zero,
                     bias.has_value() ? *bias : no_bias, int8_activations);
  return out;
}

// whether group_quant_linear's int8 activations (int8_activations=true) run in this build for a
// weight of `bits` with `in_features` inputs in groups of `group_size`
bool group_quant_int8_supported(int64_t bits, int64_t in_features, int64_t group_size) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return (bits == 4 || bits == 6 || bits == 8) && group_size > 0 && in_features % group_size == 0 &&
         vnni_fits(bits, in_features, group_size);
#else
  (void)bits, (void)in_features, (void)group_size;
  return false;
#endif
}
