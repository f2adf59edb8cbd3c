// FP8 linear layers (engine.interfaces.ops.LayerOps.fp8_linear): out = x @ (W * scale)^T + bias
// for a weight W of e4m3 bytes [N, K] with one float32 scale per output row and block of
// block_k inputs, for the few rows of a decode step (more rows: NativeLayerOps dequantizes tiles
// of the weight and multiplies them with the BLAS).
//
// An e4m3 byte (sign bit 7, exponent bits 3-6 with bias 7, mantissa bits 0-2) becomes the fp16
// bits of its value times 2^-8 with a sign extension, a shift and an and: the sign to bit 15,
// exponent and mantissa to bits 7-13 (fp16's exponent bias is 15, so the same fields stand for
// 2^-8 times the value; subnormals included, fp16 holds them all exactly). F16C widens them to
// fp32 (exact), and the 2^8 is folded into the block's scale. e4m3fn's NaN (0x7f, 0xff) reads as
// 480: checkpoints hold none. Each output row sums the products with x in fp32 per
// block, then adds the block's sum times its scale: the reference's values, summed in another
// order. The weight is read once for up to kRows rows of x at a time.
#include "kernel.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <type_traits>
#include <vector>

#include "scalar.h"
#include "vec.h"

#include <ATen/ops/empty.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kRows = 4;          // rows of x per pass over a weight row
constexpr int64_t kGrainRows = 16;    // output rows per parallel_for grain
constexpr float kUnscale = 256.f;     // 2^8: the fp16 fields stand for 2^-8 times the value

// one e4m3 byte's value times 2^-8 (the vector paths' form), exactly
inline float e4m3_scaled(uint8_t b) {
  const int exponent = (b >> 3) & 0x0f, mantissa = b & 0x07;
  const float magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -17)  // m/8 * 2^-6 * 2^-8
                                        : std::ldexp(static_cast<float>(8 + mantissa), exponent - 18);
  return (b & 0x80) ? -magnitude : magnitude;
}

// The fp16 bits of e4m3 bytes times 2^-8, 16-bit lanes: the bytes sign-extended and shifted left
// by 7 put exponent and mantissa at bits 7-13 and the sign at bits 14 and 15; bit 14 is cleared.
constexpr uint16_t kHalfFields = 0xbf80;

#if defined(__AVX512F__)
// 32 e4m3 bytes -> their values times 2^-8, fp32, in two vectors of 16
inline void e4m3x32(const uint8_t* p, __m512& lo, __m512& hi) {
  const __m512i b = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i h = _mm512_and_si512(_mm512_slli_epi16(b, 7), _mm512_set1_epi16(static_cast<int16_t>(kHalfFields)));
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}
// 16 of them
inline __m512 e4m3x16(const uint8_t* p) {
  const __m256i b = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtph_ps(
      _mm256_and_si256(_mm256_slli_epi16(b, 7), _mm256_set1_epi16(static_cast<int16_t>(kHalfFields))));
}
#elif defined(__AVX2__) && defined(__F16C__)
// 8 e4m3 bytes -> their values times 2^-8, fp32
inline __m256 e4m3x8(const uint8_t* p) {
  const __m128i b = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtph_ps(_mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(static_cast<int16_t>(kHalfFields))));
}

using engine_cpu::sum8;  // vec.h
#endif

// y[r] = sum over blocks of scale * sum_k w[k] x[r][k] for one weight row w [K] and R rows of x
// (fp32, row stride K)
template <int R>
void row_dot(const uint8_t* w, const float* scale, int64_t K, int64_t block_k, const float* x, float* y) {
  float total[R] = {};
#if defined(__AVX512F__)
  __m512 totals[R];  // the blocks' sums times their scales, lane by lane: one reduction a row
  for (int r = 0; r < R; ++r) totals[r] = _mm512_setzero_ps();
#elif defined(__AVX2__) && defined(__F16C__)
  __m256 totals[R];
  for (int r = 0; r < R; ++r) totals[r] = _mm256_setzero_ps();
#endif
  for (int64_t k0 = 0, j = 0; k0 < K; k0 += block_k, ++j) {
    const int64_t k1 = std::min(K, k0 + block_k);
    const float s = scale[j] * kUnscale;
    int64_t k = k0;
#if defined(__AVX512F__)
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (; k + 32 <= k1; k += 32) {
      __m512 lo, hi;
      e4m3x32(w + k, lo, hi);
      for (int r = 0; r < R; ++r) {
        acc[r] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x + r * K + k), acc[r]);
        acc[r] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + r * K + k + 16), acc[r]);
      }
    }
    for (; k + 16 <= k1; k += 16) {
      const __m512 wv = e4m3x16(w + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + r * K + k), acc[r]);
    }
    const __m512 sv = _mm512_set1_ps(s);
    for (int r = 0; r < R; ++r) totals[r] = _mm512_fmadd_ps(acc[r], sv, totals[r]);
#elif defined(__AVX2__) && defined(__F16C__)
    __m256 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
    for (; k + 8 <= k1; k += 8) {
      const __m256 wv = e4m3x8(w + k);
      for (int r = 0; r < R; ++r) acc[r] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + r * K + k), acc[r]);
    }
    const __m256 sv = _mm256_set1_ps(s);
    for (int r = 0; r < R; ++r) totals[r] = _mm256_fmadd_ps(acc[r], sv, totals[r]);
#endif
    for (; k < k1; ++k) {  // the block's tail
      const float wv = e4m3_scaled(w[k]) * s;
      for (int r = 0; r < R; ++r) total[r] += wv * x[r * K + k];
    }
  }
#if defined(__AVX512F__)
  for (int r = 0; r < R; ++r) total[r] += _mm512_reduce_add_ps(totals[r]);
#elif defined(__AVX2__) && defined(__F16C__)
  for (int r = 0; r < R; ++r) total[r] += sum8(totals[r]);
#endif
  for (int r = 0; r < R; ++r) y[r] = total[r];
}

template <typename T>
void fp8_rows(const T* x, int64_t T_, int64_t K, const uint8_t* w, const float* scales, int64_t G, int64_t N,
              int64_t block_k, const float* bias, T* out) {
  std::vector<float> xf(T_ * K);
  for (int64_t i = 0; i < T_ * K; ++i) xf[i] = engine_cpu::load(x + i);
  at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
    float y[kRows];
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* wr = w + n * K;
      const float* sr = scales + n * G;
      const float b = bias != nullptr ? bias[n] : 0.f;
      for (int64_t t0 = 0; t0 < T_; t0 += kRows) {
        const int64_t R = std::min(kRows, T_ - t0);
        const float* xr = xf.data() + t0 * K;
        switch (R) {
          case 1: row_dot<1>(wr, sr, K, block_k, xr, y); break;
          case 2: row_dot<2>(wr, sr, K, block_k, xr, y); break;
          case 3: row_dot<3>(wr, sr, K, block_k, xr, y); break;
          default: row_dot<4>(wr, sr, K, block_k, xr, y); break;
        }
        for (int64_t r = 0; r < R; ++r) out[(t0 + r) * N + n] = static_cast<T>(y[r] + b);
      }
    }
  });
}

void check_weight(const torch::Tensor& weight, const torch::Tensor& scales, int64_t K, int64_t block_k) {
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous() &&
                  (weight.scalar_type() == at::kFloat8_e4m3fn || weight.scalar_type() == at::kByte),
              "fp8_linear: weight [N, K] float8_e4m3fn (or its bytes as uint8), contiguous");
  TORCH_CHECK(block_k > 0 && weight.size(1) == K, "fp8_linear: the weight's inputs and x's differ");
  const int64_t G = (K + block_k - 1) / block_k;
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.dim() == 2 &&
                  scales.size(0) == weight.size(0) && scales.size(1) == G,
              "fp8_linear: scales float32 [N, ceil(K / block_k)], contiguous");
}

inline const uint8_t* weight_bytes(const torch::Tensor& weight) {
  return static_cast<const uint8_t*>(weight.data_ptr());
}

}  // namespace

// x [T, K] @ (weight * scales)^T + bias into a new [T, N] tensor of x's dtype: weight
// float8_e4m3fn [N, K] (or its bytes), scales float32 [N, ceil(K / block_k)], bias float32 [N] or
// None; x float32 or bf16, contiguous.
torch::Tensor fp8_matmul(torch::Tensor x, torch::Tensor weight, torch::Tensor scales, int64_t block_k,
                         std::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "fp8_linear: x [T, K] contiguous");
  const int64_t T_ = x.size(0), K = x.size(1), N = weight.size(0);
  check_weight(weight, scales, K, block_k);
  const float* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "fp8_linear: bias float32 [N]");
    bp = bias->data_ptr<float>();
  }
  torch::Tensor out = at::empty({T_, N}, x.options());
  const int64_t G = scales.size(1);
  DISPATCH_F32_BF16(x.scalar_type(), "fp8_linear", [&] {
    fp8_rows<scalar_t>(x.data_ptr<scalar_t>(), T_, K, weight_bytes(weight), scales.data_ptr<float>(), G, N, block_k,
                       bp, out.data_ptr<scalar_t>());
  });
  return out;
}

// out [N, K] (float32 or bf16) = weight * scales, each product rounded once to out's dtype
void fp8_dequantize(torch::Tensor out, torch::Tensor weight, torch::Tensor scales, int64_t block_k) {
  const int64_t N = weight.size(0), K = weight.size(1);
  check_weight(weight, scales, K, block_k);
  TORCH_CHECK(out.is_contiguous() && out.dim() == 2 && out.size(0) == N && out.size(1) == K,
              "fp8_dequantize: out [N, K] contiguous");
  const uint8_t* w = weight_bytes(weight);
  const float* sp = scales.data_ptr<float>();
  const int64_t G = scales.size(1);
  DISPATCH_F32_BF16(out.scalar_type(), "fp8_dequantize", [&] {
    scalar_t* op = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, kGrainRows, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) {
        for (int64_t k0 = 0, j = 0; k0 < K; k0 += block_k, ++j) {
          const int64_t k1 = std::min(K, k0 + block_k);
          const float s = sp[n * G + j] * kUnscale;
          int64_t k = k0;
#if defined(__AVX512F__)
          const __m512 sv = _mm512_set1_ps(s);
          for (; k + 16 <= k1; k += 16) {
            const __m512 v = _mm512_mul_ps(e4m3x16(w + n * K + k), sv);
            if constexpr (std::is_same_v<scalar_t, float>) {
              _mm512_storeu_ps(op + n * K + k, v);
            } else {
              engine_cpu::store_bf16(op + n * K + k, v);  // rounded to nearest even, as static_cast
            }
          }
#endif
          for (; k < k1; ++k) op[n * K + k] = static_cast<scalar_t>(e4m3_scaled(w[n * K + k]) * s);
        }
      }
    });
  });
}
