// Schemas of torch.ops.bladesmith (docs/ARCHITECTURE.md, "Custom operators") and the one
// kernel shared by every backend: retinanet_postprocess as decode followed by NMS.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>

namespace bladesmith {
namespace {

using Detections = std::tuple<at::Tensor, at::Tensor, at::Tensor>;
using PaddedDetections = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// Both halves go through the dispatcher, so each backend's own decode and NMS kernels run
// (CPU, CUDA, or the copy-to-CPU fallback).
PaddedDetections retinanet_postprocess(const at::Tensor& cls_logits,
                                       const at::Tensor& bbox_deltas, const at::Tensor& anchors,
                                       at::IntArrayRef level_sizes,
                                       const at::Tensor& image_sizes, double score_threshold,
                                       int64_t topk_candidates, double iou_threshold,
                                       int64_t max_detections, at::ArrayRef<double> weights,
                                       double bbox_clip) {
  static auto decode =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("bladesmith::retinanet_decode", "")
          .typed<Detections(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                            at::IntArrayRef, const at::Tensor&, double, int64_t,
                            at::ArrayRef<double>, double)>();
  static auto nms = c10::Dispatcher::singleton()
                        .findSchemaOrThrow("bladesmith::batched_nms", "")
                        .typed<PaddedDetections(const at::Tensor&, const at::Tensor&,
                                                const at::Tensor&, double, int64_t)>();
  auto [boxes, scores, labels] =
      decode.call(cls_logits, bbox_deltas, anchors, level_sizes, image_sizes, score_threshold,
                  topk_candidates, weights, bbox_clip);
  return nms.call(boxes, scores, labels, iou_threshold, max_detections);
}

}  // namespace

TORCH_LIBRARY(bladesmith, m) {
  // Fake kernels live there; torch imports it when tracing needs them.
  m.set_python_module("bladesmith.ops.fake");
  m.def(
      "retinanet_decode(Tensor cls_logits, Tensor bbox_deltas, Tensor anchors, "
      "int[] level_sizes, Tensor image_sizes, float score_threshold, int topk_candidates, "
      "float[] weights=[1.,1.,1.,1.], float bbox_clip=4.135166556742356) "
      "-> (Tensor boxes, Tensor scores, Tensor labels)");
  m.def(
      "batched_nms(Tensor boxes, Tensor scores, Tensor labels, float iou_threshold, "
      "int max_detections) -> (Tensor boxes, Tensor scores, Tensor labels, "
      "Tensor num_detections)");
  m.def(
      "retinanet_postprocess(Tensor cls_logits, Tensor bbox_deltas, Tensor anchors, "
      "int[] level_sizes, Tensor image_sizes, float score_threshold, int topk_candidates, "
      "float iou_threshold, int max_detections, float[] weights=[1.,1.,1.,1.], "
      "float bbox_clip=4.135166556742356) "
      "-> (Tensor boxes, Tensor scores, Tensor labels, Tensor num_detections)");
  // relu(conv2d(x, weight) + bias [+ residual]), output channels_last (conv_relu.cpp).
  m.def(
      "conv2d_relu(Tensor x, Tensor weight, Tensor bias, Tensor? residual, int[2] stride, "
      "int[2] padding, int[2] dilation, int groups) -> Tensor");
  // A 3x3 stride-1 padding-1 float32 convolution (+ ReLU) as Winograd F(4x4, 3x3), CPU
  // only (cpu/winograd_kernel.cpp).
  m.def("winograd_conv3x3(Tensor x, Tensor weight, Tensor bias, bool relu) -> Tensor");
  // torchvision's roi_align (forward) on a channels_last feature map, vectorised over the
  // channels and threaded over the boxes; output [K, C, h, w] as torchvision's. CPU only
  // (cpu/roi_align_kernel.cpp).
  m.def(
      "roi_align_nhwc(Tensor input, Tensor rois, float spatial_scale, int pooled_height, "
      "int pooled_width, int sampling_ratio, bool aligned) -> Tensor");
  // torchvision's MultiScaleRoIAlign (a fixed sampling ratio) in one pass: box n pooled
  // from level level_of[n] of one channels-last table of every level's pixels, image by
  // image; output [N, h, w, C] in the table's dtype (cpu/ and cuda/
  // multilevel_roi_align_kernel.*, arithmetic in roi_align_math.h).
  m.def(
      "multilevel_roi_align(Tensor table, Tensor rois, Tensor level_of, int[] heights, "
      "int[] widths, float[] scales, int pooled_height, int pooled_width, int sampling_ratio) "
      "-> Tensor");
}

// CompositeExplicitAutograd rather than CompositeImplicitAutograd: it serves every backend
// that has no kernel of its own (CPU, CUDA, MPS, PrivateUse1, ...), yet tracing keeps the
// operator as one node, because a CompositeExplicitAutograd op accepts a register_fake
// kernel (a CompositeImplicitAutograd one refuses it and is decomposed instead). A backend
// may still register a fused kernel, which takes precedence over this one.
TORCH_LIBRARY_IMPL(bladesmith, CompositeExplicitAutograd, m) {
  m.impl("retinanet_postprocess", &retinanet_postprocess);
}

}  // namespace bladesmith
