// The part of torch's C++ API that the CPU kernels use, in place of <torch/extension.h>.
//
// <torch/extension.h> pulls in all of libtorch's C++ frontend (autograd, nn, optim, serialization) to give an
// extension at::Tensor and pybind11's tensor conversion. Parsing it was most of each kernel file's build: a
// file of 3 lines took ~3x longer to compile with it than with the headers below, and every worker on a fresh
// machine, `make setup` and CI build four kernel files. The kernels need only the tensor type, empty tensors,
// at::parallel_for and the Python binding, so they include just those.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>  // pybind11 with torch's type casters (at::Tensor <-> torch.Tensor)

// The names the kernels spell with torch::, as <torch/types.h> defines them (that header is not included: it
// brings the autograd factory functions with it).
namespace torch {
using at::Tensor;
using at::empty;
using at::empty_like;
constexpr auto kHalf = at::kHalf;
constexpr auto kFloat16 = at::kHalf;
constexpr auto kFloat32 = at::kFloat;
constexpr auto kBFloat16 = at::kBFloat16;
constexpr auto kUInt8 = at::kByte;
constexpr auto kInt8 = at::kChar;
constexpr auto kInt16 = at::kShort;
constexpr auto kInt32 = at::kInt;
constexpr auto kInt64 = at::kLong;
}  // namespace torch
