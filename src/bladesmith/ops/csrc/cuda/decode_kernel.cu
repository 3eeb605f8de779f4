// retinanet_decode on CUDA: top-k selection per image and level (select.cu), a descending
// sort per level (sort.cu), then one thread per output slot decodes its box. Fixed shapes,
// no host synchronisation.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "../checks.h"
#include "decode.cuh"
#include "select.cuh"
#include "sort.cuh"

namespace bladesmith {
namespace gpu {
namespace {

template <typename T>
__global__ void write_detections_kernel(DecodeSource<T> source,
                                        const uint64_t* __restrict__ sorted, int64_t num_slots,
                                        int64_t total, T* __restrict__ boxes,
                                        T* __restrict__ scores, int64_t* __restrict__ labels) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const uint64_t candidate = sorted[i];
  float4 box = make_float4(0.f, 0.f, 0.f, 0.f);
  float score = 0.f;
  int64_t label = -1;  // an empty slot
  if (candidate != 0) source.fetch(i / num_slots, candidate, box, score, label);
  write_detection(boxes, scores, labels, i, box, score, label);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> retinanet_decode_cuda(
    const at::Tensor& cls_logits, const at::Tensor& bbox_deltas, const at::Tensor& anchors,
    at::IntArrayRef level_sizes, const at::Tensor& image_sizes, double score_threshold,
    int64_t topk_candidates, at::ArrayRef<double> weights, double bbox_clip) {
  const DecodeShape shape =
      check_decode_inputs(cls_logits, bbox_deltas, anchors, level_sizes, image_sizes,
                          score_threshold, topk_candidates, weights, bbox_clip);
  check_cuda_decode_shape(shape);
  const c10::cuda::CUDAGuard guard(cls_logits.device());
  const int64_t B = shape.batch, K = shape.num_candidates;
  auto boxes = at::empty({B, K, 4}, cls_logits.options());
  auto scores = at::empty({B, K}, cls_logits.options());
  auto labels = at::empty({B, K}, cls_logits.options().dtype(at::kLong));
  if (B * K == 0) return {boxes, scores, labels};

  const auto selected = select_candidates(cls_logits, shape, score_threshold);
  const auto keys = sort_descending(selected, per_level(B, shape.slot_offsets));
  const auto deltas_c = bbox_deltas.contiguous();
  const auto anchors_c = anchors.contiguous();
  const auto sizes_c = image_sizes.contiguous();
  BLADESMITH_DISPATCH_FLOAT(cls_logits.scalar_type(), "retinanet_decode_cuda", [&] {
    constexpr int threads = 256;
    write_detections_kernel<scalar_t>
        <<<ceil_div(B * K, threads), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
            make_decode_source<scalar_t>(deltas_c, anchors_c, sizes_c, shape, weights,
                                         bbox_clip),
            reinterpret_cast<const uint64_t*>(keys.const_data_ptr<int64_t>()), K, B * K,
            boxes.mutable_data_ptr<scalar_t>(), scores.mutable_data_ptr<scalar_t>(),
            labels.mutable_data_ptr<int64_t>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return {boxes, scores, labels};
}

}  // namespace
}  // namespace gpu

TORCH_LIBRARY_IMPL(bladesmith, CUDA, m) { m.impl("retinanet_decode", &gpu::retinanet_decode_cuda); }

}  // namespace bladesmith
