// A decoded candidate from its key: box, score and label as retinanet_decode outputs them.
#pragma once

#include <ATen/ATen.h>

#include "../checks.h"
#include "common.cuh"

namespace bladesmith {
namespace gpu {

// What the CUDA kernels take beyond check_decode_inputs: their per-level tables are fixed
// arrays. Checked with the other inputs, before anything is allocated or launched.
inline void check_cuda_decode_shape(const DecodeShape& shape) {
  BLADESMITH_CHECK_VALUE(shape.level_topk.size() <= kMaxLevels, "level_sizes: the CUDA kernels ",
                         "take at most ", kMaxLevels, " levels, got ", shape.level_topk.size());
  BLADESMITH_CHECK_VALUE(shape.num_anchors * shape.num_classes < (int64_t{1} << 31),
                         "cls_logits: the CUDA kernels take fewer than 2^31 logits per image ",
                         "(N * C), got ", shape.num_anchors * shape.num_classes);
}

template <typename T>
struct DecodeSource {
  const T* deltas;              // [B, N, 4]
  const T* anchors;             // [N, 4] or [B, N, 4]
  const int64_t* image_sizes;   // [B, 2] (h, w)
  int64_t num_anchors, anchors_image_stride;
  int num_classes;
  BoxCoder coder;

  __device__ __forceinline__ int64_t label_of(int64_t, uint64_t candidate) const {
    return candidate_index(candidate) % static_cast<uint32_t>(num_classes);
  }

  // Box and score hold values of T, as the decode writes them.
  __device__ __forceinline__ void fetch(int64_t b, uint64_t candidate, float4& box, float& score,
                                        int64_t& label) const {
    const uint32_t index = candidate_index(candidate);
    const int64_t anchor = index / static_cast<uint32_t>(num_classes);
    label = index % static_cast<uint32_t>(num_classes);
    score = decoded_score(candidate);
    const T* a = anchors + b * anchors_image_stride + anchor * 4;
    const T* d = deltas + (b * num_anchors + anchor) * 4;
    const float4 decoded = coder.decode(
        make_float4(to_float(a[0]), to_float(a[1]), to_float(a[2]), to_float(a[3])),
        make_float4(to_float(d[0]), to_float(d[1]), to_float(d[2]), to_float(d[3])),
        static_cast<float>(image_sizes[b * 2]), static_cast<float>(image_sizes[b * 2 + 1]));
    box = make_float4(round_to<T>(decoded.x), round_to<T>(decoded.y), round_to<T>(decoded.z),
                      round_to<T>(decoded.w));
  }
};

// Contiguous inputs must outlive the kernels that use the source.
template <typename T>
DecodeSource<T> make_decode_source(const at::Tensor& deltas, const at::Tensor& anchors,
                                   const at::Tensor& image_sizes, const DecodeShape& shape,
                                   at::ArrayRef<double> weights, double bbox_clip) {
  DecodeSource<T> s;
  s.deltas = deltas.const_data_ptr<T>();
  s.anchors = anchors.const_data_ptr<T>();
  s.image_sizes = image_sizes.const_data_ptr<int64_t>();
  s.num_anchors = shape.num_anchors;
  s.anchors_image_stride = shape.per_image_anchors ? shape.num_anchors * 4 : 0;
  s.num_classes = static_cast<int>(shape.num_classes);
  s.coder = BoxCoder{static_cast<float>(weights[0]), static_cast<float>(weights[1]),
                     static_cast<float>(weights[2]), static_cast<float>(weights[3]),
                     static_cast<float>(bbox_clip)};
  return s;
}

}  // namespace gpu
}  // namespace bladesmith
