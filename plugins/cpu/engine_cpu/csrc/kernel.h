// What every kernel file includes: tensors and at::parallel_for, without the
// C++ frontend and pybind11 that torch/extension.h brings (bindings.cpp has those).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

namespace torch {
using at::Tensor;
}  // namespace torch
