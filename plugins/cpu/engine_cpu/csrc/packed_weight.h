// The argument checks of the kernels that read a weight packed by pack_gemv_weight
// ([ceil(N/16), K/2, 16, 2] bf16): gemv and amx_linear.
#pragma once

#include "kernel.h"

namespace engine_cpu {

// out [M, N], x [M, K] (rows with unit inner stride), bias [N] bf16 or empty
inline void check_packed_linear(const char* name, const torch::Tensor& out, const torch::Tensor& x,
                                const torch::Tensor& packed, const torch::Tensor& bias) {
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, name, ": bf16 tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.dim() == 2 && out.stride(1) == 1, name, ": 2-D rows");
  TORCH_CHECK(packed.is_contiguous() && packed.dim() == 4 && packed.size(2) == 16 && packed.size(3) == 2, name,
              ": weight not packed by pack_gemv_weight");
  const int64_t M = x.size(0), K = x.size(1), N = out.size(1);
  TORCH_CHECK(M >= 1 && out.size(0) == M, name, ": x and out rows differ");
  TORCH_CHECK(K % 8 == 0 && packed.size(1) * 2 == K && packed.size(0) * 16 >= N, name, ": shapes do not match");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() && bias.scalar_type() == at::kBFloat16),
              name, ": bias must be [N] bf16");
}

}  // namespace engine_cpu
