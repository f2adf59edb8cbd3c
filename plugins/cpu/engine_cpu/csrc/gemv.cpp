// bf16 matrix-vector products for decode (1 to 4 rows of activations), AVX512-BF16.
//
// Batch-1 decode reads every weight once per token, so its speed is the speed at
// which the weights stream from memory. The weight is packed once into
// [N/16][K/2][16][2]: each 64-byte line holds two consecutive k of 16 output
// columns, which is exactly one vdpbf16ps operand, and a thread's share of the
// columns is one contiguous stream.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#include <immintrin.h>
#endif

bool gemv_supported() {
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
namespace {

constexpr int64_t kCols = 16;   // output columns per block (one zmm of fp32)
constexpr int64_t kUnroll = 4;  // k pairs per step: independent accumulators hide the FMA latency

template <int M>
void gemv_blocks(const at::BFloat16* x, int64_t x_stride, const at::BFloat16* packed, const at::BFloat16* bias,
                 at::BFloat16* out, int64_t out_stride, int64_t N, int64_t K, int64_t b0, int64_t b1) {
  const int64_t pairs = K / 2;
  for (int64_t b = b0; b < b1; ++b) {
    __m512 acc[M][kUnroll];
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < kUnroll; ++u) acc[m][u] = _mm512_setzero_ps();
    const at::BFloat16* w = packed + b * pairs * 2 * kCols;
    for (int64_t p = 0; p < pairs; p += kUnroll) {
      const at::BFloat16* wp = w + p * 2 * kCols;
      _mm_prefetch(reinterpret_cast<const char*>(wp) + 1024, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp) + 1088, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp) + 1152, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(wp) + 1216, _MM_HINT_T0);
      for (int u = 0; u < kUnroll; ++u) {
        const __m512bh wv = (__m512bh)_mm512_loadu_si512(wp + u * 2 * kCols);
        for (int m = 0; m < M; ++m) {
          int32_t xpair;
          std::memcpy(&xpair, x + m * x_stride + (p + u) * 2, sizeof(xpair));
          acc[m][u] = _mm512_dpbf16_ps(acc[m][u], wv, (__m512bh)_mm512_set1_epi32(xpair));
        }
      }
    }
    const int64_t n0 = b * kCols;
    const int64_t valid = std::min<int64_t>(kCols, N - n0);
    const __mmask16 mask = valid == kCols ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
    __m512 bias_v = _mm512_setzero_ps();
    if (bias != nullptr) {
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n0);
      bias_v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
    }
    for (int m = 0; m < M; ++m) {
      __m512 sum = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
      sum = _mm512_add_ps(sum, bias_v);
      const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(sum);  // round to nearest even, as torch does
      _mm256_mask_storeu_epi16(out + m * out_stride + n0, mask, rounded);
    }
  }
}

}  // namespace
#endif

// out [M, N] = x [M, K] @ W^T + bias, with W packed by pack_gemv_weight ([ceil(N/16), K/2, 16, 2] bf16).
// M in 1..4, K % 8 == 0; bias is [N] bf16 or empty.
void gemv(torch::Tensor out, torch::Tensor x, torch::Tensor packed, torch::Tensor bias) {
  TORCH_CHECK(gemv_supported(), "gemv: this CPU or build has no AVX512-BF16");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "gemv: bf16 tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, "gemv: 2-D rows");
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2,
              "gemv: weight not packed by pack_gemv_weight");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(M >= 1 && M <= 4 && out.size(0) == M, "gemv: 1 to 4 rows");
  TORCH_CHECK(K % 8 == 0 && packed.size(1) * 2 == K && packed.size(0) * 16 >= N, "gemv: shapes do not match");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == at::kBFloat16),
              "gemv: bias must be [N] bf16");
#if defined(__AVX512BF16__) && defined(__AVX512F__)
  const at::BFloat16* xp = x.data_ptr<at::BFloat16>();
  const at::BFloat16* wp = packed.data_ptr<at::BFloat16>();
  const at::BFloat16* bp = bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr;
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const int64_t blocks = packed.size(0), xs = x.stride(0), os = out.stride(0);
  // contiguous block ranges per thread: one weight stream each
  at::parallel_for(0, blocks, 16, [&](int64_t b0, int64_t b1) {
    switch (M) {
      case 1: gemv_blocks<1>(xp, xs, wp, bp, op, os, N, K, b0, b1); break;
      case 2: gemv_blocks<2>(xp, xs, wp, bp, op, os, N, K, b0, b1); break;
      case 3: gemv_blocks<3>(xp, xs, wp, bp, op, os, N, K, b0, b1); break;
      default: gemv_blocks<4>(xp, xs, wp, bp, op, os, N, K, b0, b1); break;
    }
  });
#endif
}
