// What the kernels that read a weight packed by pack_gemv_weight ([ceil(N/16), K/2, 16, 2] bf16),
// gemv and amx_linear, share: their argument checks and the 16-column blocks' masks and biases.
#pragma once

#include "kernel.h"

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace engine_cpu {

// x [M, K] (rows with unit inner stride, M >= 1), a packed weight of at least N outputs for it,
// bias [N] bf16 or empty
inline void check_packed_input(const char* name, const torch::Tensor& x, const torch::Tensor& packed,
                               const torch::Tensor& bias, int64_t N) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16, name, ": bf16 tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, name, ": 2-D rows");
  TORCH_CHECK(x.size(0) >= 1, name, ": x has no rows");
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2, name,
              ": weight not packed by pack_gemv_weight");
  const int64_t K = x.size(1);
  TORCH_CHECK(K % 8 == 0 && packed.size(1) * 2 == K && packed.size(0) * 16 >= N, name, ": shapes do not match");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == at::kBFloat16),
              name, ": bias must be [N] bf16");
}

// out [M, N], x [M, K] (rows with unit inner stride), bias [N] bf16 or empty
inline void check_packed_linear(const char* name, const torch::Tensor& out, const torch::Tensor& x,
                                const torch::Tensor& packed, const torch::Tensor& bias) {
  TORCH_CHECK(out.scalar_type() == at::kBFloat16, name, ": bf16 tensors only");
  TORCH_CHECK(out.dim() == 2 && out.stride(1) == 1, name, ": 2-D rows");
  TORCH_CHECK(out.size(0) == x.size(0), name, ": x and out rows differ");
  check_packed_input(name, x, packed, bias, out.size(1));
}

#if defined(__AVX512F__)
// the valid lanes of the 16-column block starting at column n0 of N
inline __mmask16 columns_mask(int64_t n0, int64_t N) {
  const int64_t valid = std::min<int64_t>(16, N - n0);
  return valid <= 0 ? 0 : valid == 16 ? 0xffff : static_cast<__mmask16>((1u << valid) - 1);
}

// bias[n0 : n0 + 16] (bf16, masked) as fp32; zeros without a bias
inline __m512 bias_of(const at::BFloat16* bias, int64_t n0, __mmask16 mask) {
  if (bias == nullptr) return _mm512_setzero_ps();
  const __m256i raw = _mm256_maskz_loadu_epi16(mask, bias + n0);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

}  // namespace engine_cpu
