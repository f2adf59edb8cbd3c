// Group-quantized linear layers (engine.interfaces.group_quant's layout): out = x @ W^T + bias with
// W[n, k] = scales[n, k / g] * q[n, k] - offsets[n, k / g], q stored in 4 bits (two a byte, even k
// in the low nibble) or 8.
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
// does a quarter of the instructions of the fp32 path.
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
  const float* scales;
  const float* offsets;  // [N, G]
  int64_t N, K, G, g, bits;
  int64_t row_bytes() const { return K * bits / 8; }
};

// x in fp32, [T, K] (reordered for the 4-bit vector kernels), and its sums per group [T, G]
struct Input {
  const float* x;
  const float* sums;
  int64_t K, G;
};

// ---- plain C++: any group size, any build ----

// y[r] for R rows of x (starting at row t0) and output row n
void row_scalar(const Weight& w, const Input& in, int64_t n, int64_t t0, int64_t R, float* y) {
  const uint8_t* q = w.q + n * w.row_bytes();
  for (int64_t r = 0; r < R; ++r) {
    const float* x = in.x + (t0 + r) * in.K;
    const float* xs = in.sums + (t0 + r) * in.G;
    float total = 0.f, offset = 0.f;
    for (int64_t j = 0; j < w.G; ++j) {
      float dot = 0.f;
      const int64_t k0 = j * w.g;
      if (w.bits == 4) {
        for (int64_t i = k0 / 2; i < (k0 + w.g) / 2; ++i)
          dot += x[2 * i] * static_cast<float>(q[i] & 0x0f) + x[2 * i + 1] * static_cast<float>(q[i] >> 4);
      } else {
        for (int64_t k = k0; k < k0 + w.g; ++k) dot += x[k] * static_cast<float>(q[k]);
      }
      total += w.scales[n * w.G + j] * dot;
      offset += w.offsets[n * w.G + j] * xs[j];
    }
    y[r] = total - offset;
  }
}

// ---- AVX2: 4 bits 16 inputs a step, 8 bits 8 ----

#if defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kAvx2Rows = 2;  // rows of x per pass: 4 accumulators each, 16 ymm

inline float sum8(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_shuffle_ps(quarter, quarter, 1)));
}

// sums[r] = dot(x_g, q_g) of the group starting at input k0, for R rows of x (two partial sums each)
template <int R, int BITS>
__attribute__((always_inline)) inline void group_avx2(const uint8_t* q, const float* x, int64_t K, int64_t k0,
                                                      int64_t g, __m256* sums) {
  __m256 p0[R], p1[R];
  for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm256_setzero_ps();
  if constexpr (BITS == 4) {
    const __m256i low = _mm256_set1_epi32(0x0f);
    for (int64_t k = k0; k < k0 + g; k += 16) {
      const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + (k >> 1))));
      const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(b, low));
      const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
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
void row_avx2(const Weight& w, const Input& in, int64_t n, int64_t t0, float* y) {
  const uint8_t* q = w.q + n * w.row_bytes();
  const float* x = in.x + t0 * in.K;
  const float* s = w.scales + n * w.G;
  const float* m = w.offsets + n * w.G;
  const float* xs = in.sums + t0 * in.G;
  // alternate groups go to two accumulators: two independent fma chains
  __m256 a0[R], a1[R], u[R], v[R];
  float offset[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm256_setzero_ps(), offset[r] = 0.f;
  int64_t j = 0;
  for (; j + 1 < w.G; j += 2) {
    group_avx2<R, BITS>(q, x, in.K, j * w.g, w.g, u);
    group_avx2<R, BITS>(q, x, in.K, (j + 1) * w.g, w.g, v);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm256_fmadd_ps(u[r], _mm256_set1_ps(s[j]), a0[r]);
      a1[r] = _mm256_fmadd_ps(v[r], _mm256_set1_ps(s[j + 1]), a1[r]);
      offset[r] += m[j] * xs[r * in.G + j] + m[j + 1] * xs[r * in.G + j + 1];
    }
  }
  if (j < w.G) {
    group_avx2<R, BITS>(q, x, in.K, j * w.g, w.g, u);
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

// sums[r] = dot(x_g, q_g) of the group starting at input k0, for R rows of x (two partial sums each)
template <int R, int BITS>
__attribute__((always_inline)) inline void group_avx512(const uint8_t* q, const float* x, int64_t K, int64_t k0,
                                                        int64_t g, __m512* sums) {
  __m512 p0[R], p1[R];
  for (int r = 0; r < R; ++r) p0[r] = p1[r] = _mm512_setzero_ps();
  if constexpr (BITS == 4) {
    const __m512i low = _mm512_set1_epi32(0x0f);
    for (int64_t k = k0; k < k0 + g; k += 32) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (k >> 1))));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_and_si512(b, low));
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
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
void row_avx512(const Weight& w, const Input& in, int64_t n, int64_t t0, float* y) {
  const uint8_t* q = w.q + n * w.row_bytes();
  const float* x = in.x + t0 * in.K;
  const float* s = w.scales + n * w.G;
  const float* m = w.offsets + n * w.G;
  const float* xs = in.sums + t0 * in.G;
  // alternate groups go to two accumulators: two independent fma chains
  __m512 a0[R], a1[R], u[R], v[R];
  float offset[R];
  for (int r = 0; r < R; ++r) a0[r] = a1[r] = _mm512_setzero_ps(), offset[r] = 0.f;
  int64_t j = 0;
  for (; j + 1 < w.G; j += 2) {
    group_avx512<R, BITS>(q, x, in.K, j * w.g, w.g, u);
    group_avx512<R, BITS>(q, x, in.K, (j + 1) * w.g, w.g, v);
    for (int r = 0; r < R; ++r) {
      a0[r] = _mm512_fmadd_ps(u[r], _mm512_set1_ps(s[j]), a0[r]);
      a1[r] = _mm512_fmadd_ps(v[r], _mm512_set1_ps(s[j + 1]), a1[r]);
      offset[r] += m[j] * xs[r * in.G + j] + m[j + 1] * xs[r * in.G + j + 1];
    }
  }
  if (j < w.G) {
    group_avx512<R, BITS>(q, x, in.K, j * w.g, w.g, u);
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
  if (bits == 4 ? g % 32 == 0 : g % 16 == 0) return Path::kAvx512;
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (bits == 4 ? g % 16 == 0 : g % 8 == 0) return Path::kAvx2;
#endif
  return Path::kScalar;
}

int64_t reorder_chunk(Path path, int64_t bits) {
  if (bits != 4) return 0;
  return path == Path::kAvx512 ? 32 : path == Path::kAvx2 ? 16 : 0;
}

// R rows of x, one output row: dispatch on the kernel and the (compile-time) row count
void row(Path path, const Weight& w, const Input& in, int64_t n, int64_t t0, int64_t R, float* y) {
#if defined(__AVX512F__)
  if (path == Path::kAvx512) {
    switch (R) {
      case 1: w.bits == 4 ? row_avx512<1, 4>(w, in, n, t0, y) : row_avx512<1, 8>(w, in, n, t0, y); return;
      case 2: w.bits == 4 ? row_avx512<2, 4>(w, in, n, t0, y) : row_avx512<2, 8>(w, in, n, t0, y); return;
      case 3: w.bits == 4 ? row_avx512<3, 4>(w, in, n, t0, y) : row_avx512<3, 8>(w, in, n, t0, y); return;
      default: w.bits == 4 ? row_avx512<4, 4>(w, in, n, t0, y) : row_avx512<4, 8>(w, in, n, t0, y); return;
    }
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  if (path == Path::kAvx2) {
    if (R == 1)
      w.bits == 4 ? row_avx2<1, 4>(w, in, n, t0, y) : row_avx2<1, 8>(w, in, n, t0, y);
    else
      w.bits == 4 ? row_avx2<2, 4>(w, in, n, t0, y) : row_avx2<2, 8>(w, in, n, t0, y);
    return;
  }
#endif
  row_scalar(w, in, n, t0, R, y);
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

// inputs per chunk: one 64-byte load of weights
constexpr int64_t vnni_chunk(int64_t bits) { return bits == 4 ? 128 : 64; }

// whether the int8 path takes this weight: whole chunks, and blocks (min(g, chunk)) of whole lanes
bool vnni_fits(int64_t bits, int64_t K, int64_t g) {
  const int64_t chunk = vnni_chunk(bits), lane = bits == 4 ? 8 : 4;
  if (K % chunk != 0) return false;
  return g % chunk == 0 || (chunk % g == 0 && g % lane == 0);
}

// x quantized: xq [T, K] int8 (4 bits: each chunk's even inputs, then its odd ones); dx [T, K / chunk,
// 16]: the scale of each lane's block, per chunk (a lane covers 8 inputs for 4 bits, 4 for 8)
struct QuantInput {
  const int8_t* xq;
  const float* dx;
  const float* sums;  // [T, G_pad] exact sums of x per group, zero past G
  int64_t K, G_pad, block;
  const int32_t* lane_block;  // [16] each lane's block within its chunk
};

template <typename T>
void quantize_input(const T* x, int64_t T_, int64_t K, int64_t g, int64_t bits, int64_t G_pad, int8_t* xq,
                    float* dx, float* sums) {
  const int64_t chunk = vnni_chunk(bits), block = std::min(g, chunk), G = K / g;
  const int64_t lane_inputs = bits == 4 ? 8 : 4;
  at::parallel_for(0, T_, 1, [&](int64_t t0, int64_t t1) {
    std::vector<float> xf(K), scale(K / block);
    std::vector<int8_t> natural(K);
    for (int64_t t = t0; t < t1; ++t) {
      const T* xr = x + t * K;
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
      int8_t* out = xq + t * K;
      float* lanes = dx + t * (K / chunk) * 16;
      for (int64_t c = 0; c < K; c += chunk) {
        if (bits == 4) {
          for (int64_t i = 0; i < chunk / 2; ++i) {
            out[c + i] = natural[c + 2 * i];
            out[c + chunk / 2 + i] = natural[c + 2 * i + 1];
          }
        } else {
          std::memcpy(out + c, natural.data() + c, chunk);
        }
        for (int64_t L = 0; L < 16; ++L) lanes[c / chunk * 16 + L] = scale[(c + L * lane_inputs) / block];
      }
    }
  });
}

template <int R, int BITS>
void row_vnni(const Weight& w, const QuantInput& in, int64_t n, int64_t t0, float* y) {
  constexpr int64_t chunk = BITS == 4 ? 128 : 64;
  const uint8_t* q = w.q + n * w.row_bytes();
  const float* s = w.scales + n * w.G;
  const float* m = w.offsets + n * w.G;
  const int64_t g = w.g, per_chunk = chunk / in.block;  // blocks a chunk holds (1 when g >= chunk)
  const int64_t chunks = in.K / chunk;
  const __m512i lanes = _mm512_loadu_si512(in.lane_block);
  const __mmask16 first = static_cast<__mmask16>((1u << per_chunk) - 1);
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    __m512i lo, hi = _mm512_setzero_si512();
    if constexpr (BITS == 4) {
      const __m512i b = _mm512_loadu_si512(q + c * chunk / 2);
      lo = _mm512_and_si512(b, nibble);
      hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
    } else {
      lo = _mm512_loadu_si512(q + c * chunk);
    }
    // the weight scale of each lane: s of the group its block lies in
    const int64_t j0 = c * chunk / g;
    const __m512 ws = per_chunk == 1 ? _mm512_set1_ps(s[j0])
                                     : _mm512_permutexvar_ps(lanes, _mm512_maskz_loadu_ps(first, s + j0));
    for (int r = 0; r < R; ++r) {
      const int8_t* xr = in.xq + (t0 + r) * in.K + c * chunk;
      __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xr));
      if constexpr (BITS == 4) d = _mm512_dpbusd_epi32(d, hi, _mm512_loadu_si512(xr + 64));
      const __m512 dv = _mm512_loadu_ps(in.dx + ((t0 + r) * chunks + c) * 16);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(ws, dv), acc[r]);
    }
  }
  // minus sum_j m_j sum(x_j), 16 groups a step (sums are zero past G)
  for (int64_t j = 0; j < w.G; j += 16) {
    const __mmask16 mask = w.G - j >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (w.G - j)) - 1);
    const __m512 mv = _mm512_maskz_loadu_ps(mask, m + j);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_fnmadd_ps(mv, _mm512_loadu_ps(in.sums + (t0 + r) * in.G_pad + j), acc[r]);
  }
  for (int r = 0; r < R; ++r) y[r] = _mm512_reduce_add_ps(acc[r]);
}

template <typename T>
void decode_int8(const Weight& w, const T* x, int64_t T_, const float* bias, T* out) {
  const int64_t chunk = vnni_chunk(w.bits), block = std::min(w.g, chunk);
  const int64_t lane_inputs = w.bits == 4 ? 8 : 4, G_pad = (w.G + 15) / 16 * 16;
  alignas(64) int32_t lane_block[16];
  for (int64_t L = 0; L < 16; ++L) lane_block[L] = static_cast<int32_t>(L * lane_inputs / block);
  std::vector<int8_t> xq(T_ * w.K);
  std::vector<float> dx(T_ * (w.K / chunk) * 16), sums(T_ * G_pad);
  quantize_input(x, T_, w.K, w.g, w.bits, G_pad, xq.data(), dx.data(), sums.data());
  const QuantInput in{xq.data(), dx.data(), sums.data(), w.K, G_pad, block, lane_block};
  at::parallel_for(0, w.N, kDecodeGrainRows, [&](int64_t n0, int64_t n1) {
    float y[kVnniRows];
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t t0 = 0; t0 < T_; t0 += kVnniRows) {
        const int64_t R = std::min(kVnniRows, T_ - t0);
        auto run = [&](auto rows) {
          constexpr int RR = decltype(rows)::value;
          w.bits == 4 ? row_vnni<RR, 4>(w, in, n, t0, y) : row_vnni<RR, 8>(w, in, n, t0, y);
        };
        switch (R) {
          case 1: run(std::integral_constant<int, 1>{}); break;
          case 2: run(std::integral_constant<int, 2>{}); break;
          case 3: run(std::integral_constant<int, 3>{}); break;
          default: run(std::integral_constant<int, 4>{}); break;
        }
        for (int64_t r = 0; r < R; ++r) store_row(out + (t0 + r) * w.N, n, y[r], bias);
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
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t t0 = 0; t0 < T_; t0 += rows_per_pass) {
        const int64_t R = std::min(rows_per_pass, T_ - t0);
        row(path, w, in, n, t0, R, y);
        for (int64_t r = 0; r < R; ++r) store_row(out + (t0 + r) * w.N, n, y[r], bias);
      }
  });
}

// fp32 W[n0:n1, k0:k1] (k0, k1 whole groups) into dst [n1 - n0, k1 - k0]
void dequantize_tile(const Weight& w, int64_t n0, int64_t n1, int64_t k0, int64_t k1, float* dst) {
  const int64_t width = k1 - k0;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* q = w.q + n * w.row_bytes();
    float* d = dst + (n - n0) * width;
    for (int64_t j = k0 / w.g; j < k1 / w.g; ++j) {
      const float s = w.scales[n * w.G + j], m = w.offsets[n * w.G + j];
      float* dg = d + j * w.g - k0;
      if (w.bits == 4) {
        const uint8_t* qg = q + j * w.g / 2;
        for (int64_t i = 0; i < w.g / 2; ++i) {
          dg[2 * i] = s * static_cast<float>(qg[i] & 0x0f) - m;
          dg[2 * i + 1] = s * static_cast<float>(qg[i] >> 4) - m;
        }
      } else {
        const uint8_t* qg = q + j * w.g;
        for (int64_t i = 0; i < w.g; ++i) dg[i] = s * static_cast<float>(qg[i]) - m;
      }
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
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kTileOutputs, n1 = std::min(w.N, n0 + kTileOutputs), rows = n1 - n0;
      torch::Tensor yb = y.narrow(1, 0, rows);
      yb.zero_();
      for (int64_t k0 = 0; k0 < w.K; k0 += width) {
        const int64_t k1 = std::min(w.K, k0 + width);
        dequantize_tile(w, n0, n1, k0, k1, tile.data_ptr<float>());
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
    const uint8_t* q = w.q + (n0 + r) * w.row_bytes();
    for (int64_t i = 0; i < w.row_bytes(); i += 16) {
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + i)));
      if (w.bits == 4) {
        // byte i holds inputs 2i (low) and 2i + 1 (high): one 32-bit pair of bf16, low first
        const __m512i lo = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0x0f))));
        const __m512i hi = _mm512_castps_si512(_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4)));
        const __m512i pair =
            _mm512_or_si512(_mm512_srli_epi32(lo, 16), _mm512_and_si512(hi, _mm512_set1_epi32(-65536)));
        _mm512_storeu_si512(d + 2 * i, pair);
      } else {
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
    alignas(64) float c[4][16 * 16];
    alignas(64) float acc[kAmxOutputs][kAmxRows];  // [output][row of x]
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t n0 = u * kAmxOutputs, outputs = std::min(kAmxOutputs, w.N - n0);
      unpack_rows_bf16(w, n0, a.data());
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
              const __m512 s = _mm512_set1_ps(w.scales[(n0 + n) * G + j]);
              const __m512 m = _mm512_set1_ps(w.offsets[(n0 + n) * G + j]);
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
// [N, K / group_size], bias fp32 [N] or empty. fp32 sums; bf16 out rounded once. int8_activations:
// bf16 decode rows may be quantized to int8 (see the header) where this build has AVX512-VNNI.
void group_quant_linear(torch::Tensor out, torch::Tensor x, torch::Tensor qweight, torch::Tensor scales,
                        torch::Tensor offsets, int64_t bits, int64_t group_size, torch::Tensor bias,
                        bool int8_activations) {
  TORCH_CHECK(bits == 4 || bits == 8, "group_quant_linear: 4 or 8 bits a value, not ", bits);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous(),
              "group_quant_linear: x and out must be contiguous 2-D");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "group_quant_linear: x must be fp32 or bf16, not ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "group_quant_linear: out must have x's dtype");
  const int64_t T_ = x.size(0), K = x.size(1), N = qweight.size(0), g = group_size;
  TORCH_CHECK(g > 0 && g % 2 == 0 && K % g == 0, "group_quant_linear: group_size ", g,
              " must be even and divide the ", K, " inputs");
  TORCH_CHECK(qweight.scalar_type() == at::kByte && qweight.is_contiguous() && qweight.dim() == 2 &&
                  qweight.size(1) == K * bits / 8,
              "group_quant_linear: qweight must be contiguous uint8 [N, ", K * bits / 8, "]");
  for (const auto* t : {&scales, &offsets})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->dim() == 2 && t->size(0) == N &&
                    t->size(1) == K / g,
                "group_quant_linear: scales and offsets must be contiguous fp32 [", N, ", ", K / g, "]");
  TORCH_CHECK(out.size(0) == T_ && out.size(1) == N, "group_quant_linear: out must be [", T_, ", ", N, "]");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == at::kFloat),
              "group_quant_linear: bias must be fp32 [N] or empty");
  if (T_ == 0 || N == 0) return;
  const Weight w{qweight.data_ptr<uint8_t>(), scales.data_ptr<float>(), offsets.data_ptr<float>(), N, K, K / g, g,
                 bits};
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

// whether group_quant_linear's int8 activations (int8_activations=true) run in this build for a
// weight of `bits` with `in_features` inputs in groups of `group_size`
bool group_quant_int8_supported(int64_t bits, int64_t in_features, int64_t group_size) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
  return (bits == 4 || bits == 8) && group_size > 0 && in_features % group_size == 0 &&
         vnni_fits(bits, in_features, group_size);
#else
  (void)bits, (void)in_features, (void)group_size;
  return false;
#endif
}
