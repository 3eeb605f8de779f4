// Devices with no kernel of their own (DirectML registers as PrivateUse1; MPS): the
// operators run on CPU copies of the inputs and the results move back to the device, so
// models that use them still run there.
#include <ATen/native/CPUFallback.h>
#include <torch/library.h>

#include <optional>

#include "message.h"

namespace bladesmith {
namespace {

void run_on_cpu(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  // The generic fallback would silently gather tensors from different devices; refuse that
  // as the native kernels do, naming the argument.
  const auto& arguments = op.schema().arguments();
  const auto inputs = torch::jit::last(*stack, arguments.size());
  std::optional<c10::Device> device;
  const char* device_of = nullptr;
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!inputs[i].isTensor()) continue;
    const auto& tensor = inputs[i].toTensor();
    if (!device) {
      device = tensor.device();
      device_of = arguments[i].name().c_str();
    }
    BLADESMITH_CHECK_VALUE(tensor.device() == *device, arguments[i].name(), ": expected device ",
                           *device, " (the device of ", device_of, "), got ", tensor.device());
  }
  at::native::cpu_fallback(op, stack);
}

void register_cpu_fallback(torch::Library& m) {
  for (const char* name : {"retinanet_decode", "batched_nms", "retinanet_postprocess",
                           "multilevel_roi_align"}) {
    m.impl(name, torch::CppFunction::makeFromBoxedFunction<&run_on_cpu>());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(bladesmith, PrivateUse1, m) { register_cpu_fallback(m); }
TORCH_LIBRARY_IMPL(bladesmith, MPS, m) { register_cpu_fallback(m); }

}  // namespace bladesmith
