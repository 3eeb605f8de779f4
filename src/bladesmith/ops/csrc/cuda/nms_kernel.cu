// batched_nms on CUDA: per image, candidate keys in slot order, a descending sort, then the
// greedy pass of nms.cuh over label buckets. Fixed shapes, no host synchronisation.
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <tuple>

#include "../checks.h"
#include "nms.cuh"
#include "sort.cuh"

namespace bladesmith {
namespace gpu {
namespace {

template <typename T>
struct TensorSource {
  const T* boxes;         // [B, K, 4]
  const T* scores;        // [B, K]
  const int64_t* labels;  // [B, K]
  int64_t num_slots;

  __device__ __forceinline__ int64_t label_of(int64_t b, uint64_t candidate) const {
    return labels[b * num_slots + candidate_index(candidate)];
  }

  __device__ __forceinline__ void fetch(int64_t b, uint64_t candidate, float4& box,
                                        float& score, int64_t& label) const {
    const int64_t slot = b * num_slots + candidate_index(candidate);
    const T* p = boxes + slot * 4;
    box = make_float4(to_float(p[0]), to_float(p[1]), to_float(p[2]), to_float(p[3]));
    score = to_float(scores[slot]);
    label = labels[slot];
  }
};

// Padding (negative label) and NaN scores get the empty key, which sorts last.
template <typename T>
__global__ void candidate_keys_kernel(const T* __restrict__ scores,
                                      const int64_t* __restrict__ labels, int64_t num_slots,
                                      int64_t total, uint64_t* __restrict__ keys) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= total) return;
  const float score = to_float(scores[i]);
  keys[i] = labels[i] < 0 || isnan(score)
                ? 0
                : make_candidate(ordered_score_key(score), static_cast<uint32_t>(i % num_slots));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batched_nms_cuda(
    const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& labels,
    double iou_threshold, int64_t max_detections) {
  check_nms_inputs(boxes, scores, labels, iou_threshold, max_detections);
  const c10::cuda::CUDAGuard guard(boxes.device());
  const int64_t B = boxes.size(0), K = boxes.size(1);
  BLADESMITH_CHECK_VALUE(K < (int64_t{1} << 31),
                         "boxes: the CUDA kernels take fewer than 2^31 boxes per image, got ", K);
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> outputs;
  BLADESMITH_DISPATCH_FLOAT(boxes.scalar_type(), "batched_nms_cuda", [&] {
    NmsTensors<scalar_t> result(B, max_detections, boxes.options());
    const auto boxes_c = boxes.contiguous();
    const auto scores_c = scores.contiguous();
    const auto labels_c = labels.contiguous();
    auto keys = at::empty({B, K}, labels.options());
    if (B * K > 0) {
      constexpr int threads = 256;
      candidate_keys_kernel<scalar_t>
          <<<ceil_div(B * K, threads), threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
              scores_c.const_data_ptr<scalar_t>(), labels_c.const_data_ptr<int64_t>(), K, B * K,
              reinterpret_cast<uint64_t*>(keys.data_ptr<int64_t>()));
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      keys = sort_descending(keys, per_image(B, K));
    }
    const TensorSource<scalar_t> source{boxes_c.const_data_ptr<scalar_t>(),
                                        scores_c.const_data_ptr<scalar_t>(),
                                        labels_c.const_data_ptr<int64_t>(), K};
    launch_nms(source, keys, K, iou_threshold, /*num_labels=*/0, result);
    outputs = {result.boxes, result.scores, result.labels, result.counts};
  });
  return outputs;
}

}  // namespace
}  // namespace gpu

TORCH_LIBRARY_IMPL(bladesmith, CUDA, m) { m.impl("batched_nms", &gpu::batched_nms_cuda); }

}  // namespace bladesmith
