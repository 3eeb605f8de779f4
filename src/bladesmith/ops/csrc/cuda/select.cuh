// Per image and level, the candidates of retinanet_decode: sigmoid score above the threshold,
// the best min(topk, N_l*C) by descending score, ties by lower index.
#pragma once

#include <ATen/ATen.h>

#include "../checks.h"

namespace bladesmith {
namespace gpu {

// Returns [B, K] int64 holding candidate keys (common.cuh): image b, level l's slots
// [slot_offsets[l], slot_offsets[l+1]) hold its candidates in no particular order, then zeros.
// The index in a key is the flat logit index within the image (anchor * C + class).
// The shape must have passed check_cuda_decode_shape (decode.cuh).
at::Tensor select_candidates(const at::Tensor& cls_logits, const DecodeShape& shape,
                             double score_threshold);

}  // namespace gpu
}  // namespace bladesmith
