// Scalar helpers shared by the engine-cpu kernels that take float32 and bfloat16 tensors.
#pragma once

#include <ATen/Dispatch.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

// float32 and bfloat16 only (the dtypes NativeLayerOps sends the kernels)
#define DISPATCH_F32_BF16(TYPE, NAME, ...)                          \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

namespace engine_cpu {

inline float load(const float* p) { return *p; }
inline float load(const at::BFloat16* p) {
  uint32_t bits = static_cast<uint32_t>(p->x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// round to the storage dtype T and back: what a torch op on that dtype returns
template <typename T>
inline float rounded(float v) {
  return static_cast<float>(static_cast<T>(v));
}

}  // namespace engine_cpu
