// retinanet_postprocess on CUDA, fused: the decode's top-k selection, one descending sort per
// image over all its levels, then the greedy NMS pass, which decodes the boxes of the
// candidates it reaches and no others. Same results as retinanet_decode then batched_nms: the
// sort key orders candidates by score then flat index, which is the decode's slot order.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "../checks.h"
#include "decode.cuh"
#include "nms.cuh"
#include "select.cuh"
#include "sort.cuh"

namespace bladesmith {
namespace gpu {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> retinanet_postprocess_cuda(
    const at::Tensor& cls_logits, const at::Tensor& bbox_deltas, const at::Tensor& anchors,
    at::IntArrayRef level_sizes, const at::Tensor& image_sizes, double score_threshold,
    int64_t topk_candidates, double iou_threshold, int64_t max_detections,
    at::ArrayRef<double> weights, double bbox_clip) {
  const DecodeShape shape =
      check_decode_inputs(cls_logits, bbox_deltas, anchors, level_sizes, image_sizes,
                          score_threshold, topk_candidates, weights, bbox_clip);
  check_cuda_decode_shape(shape);
  check_nms_arguments(iou_threshold, max_detections);
  const c10::cuda::CUDAGuard guard(cls_logits.device());
  const int64_t B = shape.batch, K = shape.num_candidates;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> outputs;
  BLADESMITH_DISPATCH_FLOAT(cls_logits.scalar_type(), "retinanet_postprocess_cuda", [&] {
    NmsTensors<scalar_t> result(B, max_detections, cls_logits.options());
    outputs = {result.boxes, result.scores, result.labels, result.counts};
    if (B == 0) return;
    auto keys = select_candidates(cls_logits, shape, score_threshold);
    if (K > 0) keys = sort_descending(keys, per_image(B, K));
    const auto deltas_c = bbox_deltas.contiguous();
    const auto anchors_c = anchors.contiguous();
    const auto sizes_c = image_sizes.contiguous();
    launch_nms(make_decode_source<scalar_t>(deltas_c, anchors_c, sizes_c, shape, weights,
                                            bbox_clip),
               keys, K, iou_threshold, shape.num_classes, result);
  });
  return outputs;
}

}  // namespace
}  // namespace gpu

TORCH_LIBRARY_IMPL(bladesmith, CUDA, m) {
  m.impl("retinanet_postprocess", &gpu::retinanet_postprocess_cuda);
}

}  // namespace bladesmith
