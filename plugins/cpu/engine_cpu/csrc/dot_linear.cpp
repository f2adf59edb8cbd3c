// Batch-invariant linear layers: out[m, n] = x[m] . W[n] + bias[n], each output one dot product
// in an order fixed by K alone (--batch-invariant on CPUs without the AVX512-BF16 gemv).
//
// A blocked GEMM picks its tiles, and so the order of its sums, by the shape of the call; here
// every output is summed the same way whatever the number of rows: with AVX2 + FMA, eight lanes
// times four accumulators over K in steps of 32, then steps of 8, the four added pairwise and
// the lanes in a fixed tree, then the scalar tail; without AVX2, the same order in plain C++
// (compiled without reassociation of its loop). Threads split the output columns, each column
// block is summed whole by one thread, and its weight rows stay in cache across the rows of x.
#include "kernel.h"

#include <cstdint>
#include <cstring>

#include "vec.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(at::BFloat16 v) { return static_cast<float>(v); }
inline float to_float(float v) { return v; }

#if defined(__AVX2__) && defined(__FMA__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
using engine_cpu::sum8;  // vec.h
#endif

template <typename T>
float dot(const T* x, const T* w, int64_t K) {
  int64_t k = 0;
  float total = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps(), a2 = _mm256_setzero_ps(), a3 = _mm256_setzero_ps();
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(load8(x + k), load8(w + k), a0);
    a1 = _mm256_fmadd_ps(load8(x + k + 8), load8(w + k + 8), a1);
    a2 = _mm256_fmadd_ps(load8(x + k + 16), load8(w + k + 16), a2);
    a3 = _mm256_fmadd_ps(load8(x + k + 24), load8(w + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load8(x + k), load8(w + k), a0);
  total = sum8(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; k < K; ++k) total += to_float(x[k]) * to_float(w[k]);
  return total;
}

template <typename T>
void dot_linear_impl(T* out, const T* x, const T* w, const T* bias, int64_t M, int64_t N, int64_t K, int64_t xs,
                     int64_t os) {
  constexpr int64_t kColumns = 16;  // weight rows kept in cache while every row of x passes
  at::parallel_for(0, (N + kColumns - 1) / kColumns, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * kColumns, n1 = std::min(N, n0 + kColumns);
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) {
          float v = dot(x + m * xs, w + n * K, K);
          if (bias != nullptr) v += to_float(bias[n]);
          out[m * os + n] = static_cast<T>(v);
        }
    }
  });
}

}  // namespace

// out [M, N] = x [M, K] @ w [N, K]^T + bias, fp32 or bf16 (fp32 sums, one rounding), each
// output summed in an order that depends on K only. bias: [N] or empty.
void dot_linear(torch::Tensor out, torch::Tensor x, torch::Tensor w, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && out.dim() == 2, "dot_linear: 2-D x, w and out");
  TORCH_CHECK(x.stride(1) == 1 && out.stride(1) == 1 && w.is_contiguous(), "dot_linear: rows must be contiguous");
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && out.scalar_type() == x.scalar_type(),
              "dot_linear: x, w and out must share a dtype");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat, "dot_linear: fp32 or bf16 only");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && out.size(0) == M && out.size(1) == N, "dot_linear: shapes do not match");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == x.scalar_type()),
              "dot_linear: bias must be [N] of x's dtype");
  if (x.scalar_type() == at::kFloat) {
    dot_linear_impl(out.data_ptr<float>(), x.data_ptr<float>(), w.data_ptr<float>(),
                    bias.numel() ? bias.data_ptr<float>() : nullptr, M, N, K, x.stride(0), out.stride(0));
  } else {
    dot_linear_impl(out.data_ptr<at::BFloat16>(), x.data_ptr<at::BFloat16>(), w.data_ptr<at::BFloat16>(),
                    bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr, M, N, K, x.stride(0), out.stride(0));
  }
}
