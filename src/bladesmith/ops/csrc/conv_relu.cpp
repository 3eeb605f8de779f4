// bladesmith::conv2d_relu: relu(conv2d(x, weight) + bias [+ residual]) in one call.
//
// On CUDA with cuDNN it is cuDNN's fused convolution-bias-add-activation, so the epilogue
// is done while the output tile is still on chip: Inductor instead runs cuDNN without
// the bias and adds bias, residual and ReLU in a kernel of its own, one more read and
// write of the whole activation. Elsewhere it is the same arithmetic unfused. The output
// is channels_last on every backend (the fake kernel says so to the compilers).
#include <ATen/ATen.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "message.h"

namespace bladesmith {
namespace {

bool use_cudnn(const at::Tensor& x) {
  return x.is_cuda() && at::globalContext().userEnabledCuDNN() &&
         at::detail::getCUDAHooks().compiledWithCuDNN();
}

at::Tensor conv2d_relu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                       const std::optional<at::Tensor>& residual, at::IntArrayRef stride,
                       at::IntArrayRef padding, at::IntArrayRef dilation, int64_t groups) {
  BLADESMITH_CHECK(x.dim() == 4 && weight.dim() == 4,
                   "conv2d_relu: expected 4-D x and weight, got shapes ", x.sizes(), " and ",
                   weight.sizes());
  BLADESMITH_CHECK(x.scalar_type() == weight.scalar_type() && bias.scalar_type() == x.scalar_type(),
                   "conv2d_relu: x, weight and bias must share a dtype, got ", x.scalar_type(),
                   ", ", weight.scalar_type(), " and ", bias.scalar_type());
  if (residual.has_value()) {
    std::vector<int64_t> out{x.size(0), weight.size(0)};
    for (int64_t d = 0; d < 2; ++d) {
      const int64_t span = dilation[d] * (weight.size(d + 2) - 1) + 1;
      out.push_back((x.size(d + 2) + 2 * padding[d] - span) / stride[d] + 1);
    }
    BLADESMITH_CHECK(residual->sizes() == at::IntArrayRef(out), "conv2d_relu: residual has shape ",
                     residual->sizes(), ", the convolution's output ", at::IntArrayRef(out));
    BLADESMITH_CHECK(residual->scalar_type() == x.scalar_type(),
                     "conv2d_relu: residual must have x's dtype ", x.scalar_type(), ", got ",
                     residual->scalar_type());
  }
  const auto cl = at::MemoryFormat::ChannelsLast;
  const auto x_cl = x.contiguous(cl);
  const auto weight_cl = weight.contiguous(cl);
  at::Tensor y;
  if (use_cudnn(x)) {
    y = residual.has_value()
            ? at::cudnn_convolution_add_relu(x_cl, weight_cl, residual->contiguous(cl), 1.0,
                                             bias, stride, padding, dilation, groups)
            : at::cudnn_convolution_relu(x_cl, weight_cl, bias, stride, padding, dilation,
                                         groups);
  } else {
    y = at::conv2d(x_cl, weight_cl, bias, stride, padding, dilation, groups);
    if (residual.has_value()) {
      y.add_(*residual);
    }
    y.relu_();
  }
  return y.contiguous(cl);
}

}  // namespace

// Schema in ops.cpp. CompositeExplicitAutograd serves every backend and keeps the
// operator one node when traced.
TORCH_LIBRARY_IMPL(bladesmith, CompositeExplicitAutograd, m) {
  m.impl("conv2d_relu", &conv2d_relu);
}

}  // namespace bladesmith
