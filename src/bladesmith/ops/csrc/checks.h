// Input checks shared by every kernel (CPU, CUDA, fallback) of torch.ops.bladesmith.
// Mirrored in ops/fake.py for tracing: keep the messages of both in step.
// Errors name the argument and what was expected; shapes and values raise ValueError,
// dtypes raise TypeError (c10::ValueError / c10::TypeError).
//
// Semantics every kernel shares (the CPU kernels in cpu/ are the reference):
// - retinanet_decode: image b, level l owns output slots [slot_offsets[l], slot_offsets[l+1])
//   and fills them from the front with its candidates (sigmoid score > score_threshold, the
//   threshold rounded to the input dtype) by descending score, ties by lower flat index
//   (anchor * C + class); remaining slots are padding (box 0, score 0, label -1).
// - batched_nms: entries with a negative label (padding) or a NaN score are ignored; the rest
//   is sorted by descending score, ties by lower slot index, suppressed greedily per label
//   (IoU > iou_threshold, computed as torchvision does), and the first max_detections kept
//   are written from slot 0.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/util/safe_numerics.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "message.h"
#include "roi_align_math.h"

namespace bladesmith {

struct DecodeShape {
  int64_t batch, num_anchors, num_classes, num_candidates;
  std::vector<int64_t> level_offsets;  // anchor offset of each level, size L+1
  std::vector<int64_t> level_topk;     // min(topk, N_l*C) per level
  std::vector<int64_t> slot_offsets;   // first output slot of each level, size L+1
  bool per_image_anchors;              // anchors are [B,N,4] rather than [N,4]
};

// Python's names, so that messages read the same as the fake kernels'.
inline std::string dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kDouble: return "float64";
    case at::kLong: return "int64";
    case at::kInt: return "int32";
    default: return c10::toString(dtype);
  }
}

// The input dtypes the operators take (check_float); the kernels compute in float.
#define BLADESMITH_DISPATCH_FLOAT(TYPE, NAME, ...)                 \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) \
                                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__) \
                                         AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

inline bool is_supported_float(at::ScalarType dtype) {
  return dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
}

inline void check_rank(const at::Tensor& t, const char* name, int64_t rank, const char* layout) {
  BLADESMITH_CHECK_VALUE(t.dim() == rank, name, ": expected a ", rank, "-D tensor ", layout,
                         ", got shape ", t.sizes());
}

inline void check_size(const at::Tensor& t, const char* name, int64_t dim, int64_t expected,
                       const char* meaning, const char* layout) {
  BLADESMITH_CHECK_VALUE(t.size(dim) == expected, name, ": expected size ", expected, " (", meaning,
                         ") in dimension ", dim, " of ", layout, ", got shape ", t.sizes());
}

inline void check_float(const at::Tensor& t, const char* name) {
  BLADESMITH_CHECK_TYPE(is_supported_float(t.scalar_type()), name,
                        ": expected float32, float16 or bfloat16, got ",
                        dtype_name(t.scalar_type()));
}

inline void check_same_dtype(const at::Tensor& t, const char* name, const at::Tensor& ref,
                             const char* ref_name) {
  BLADESMITH_CHECK_TYPE(t.scalar_type() == ref.scalar_type(), name, ": expected dtype ",
                        dtype_name(ref.scalar_type()), " (the dtype of ", ref_name, "), got ",
                        dtype_name(t.scalar_type()));
}

inline void check_dtype(const at::Tensor& t, const char* name, at::ScalarType expected) {
  BLADESMITH_CHECK_TYPE(t.scalar_type() == expected, name, ": expected dtype ",
                        dtype_name(expected), ", got ", dtype_name(t.scalar_type()));
}

inline void check_same_device(const at::Tensor& t, const char* name, const at::Tensor& ref,
                              const char* ref_name) {
  BLADESMITH_CHECK_VALUE(t.device() == ref.device(), name, ": expected device ", ref.device(),
                         " (the device of ", ref_name, "), got ", t.device());
}

// sigmoid is monotonic: a score above `threshold` needs a logit above this bound, so only
// such logits need exp(). The bound sits a few ulps of the dtype (`epsilon`) below
// logit(threshold), so rounding of the score never drops a candidate that passes. Host and
// device: the CUDA selection bounds its compaction with it too.
C10_HOST_DEVICE inline float logit_bound(double threshold, double epsilon) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  if (threshold <= 0) return -inf;
  if (threshold >= 1) return inf;  // a score never exceeds 1
  const double t = threshold * (1.0 - 8.0 * epsilon);
  return ::nextafterf(static_cast<float>(::log(t / (1.0 - t))), -inf);
}

// A candidate whose score reaches `score` has a logit above this bound. Rounding to the dtype
// takes a float sigmoid of at least the midpoint to the next lower value of the dtype, which
// for a normal `score` is at least score * (1 - epsilon / 2): from there only float's
// rounding is left, a much tighter margin than the dtype's.
template <typename scalar_t>
C10_HOST_DEVICE float logit_bound_reaching(float score) {
  const double epsilon = std::numeric_limits<scalar_t>::epsilon();
  constexpr float inf = std::numeric_limits<float>::infinity();
  if (!(score >= static_cast<float>(std::numeric_limits<scalar_t>::min()))) {
    return logit_bound(::nextafterf(score, -inf), epsilon);
  }
  return logit_bound(score * (1.0 - epsilon / 2), std::numeric_limits<float>::epsilon());
}

inline DecodeShape check_decode_inputs(const at::Tensor& cls_logits, const at::Tensor& bbox_deltas,
                                       const at::Tensor& anchors, at::IntArrayRef level_sizes,
                                       const at::Tensor& image_sizes, double score_threshold,
                                       int64_t topk_candidates, at::ArrayRef<double> weights,
                                       double bbox_clip) {
  check_rank(cls_logits, "cls_logits", 3, "[B, N, C]");
  check_float(cls_logits, "cls_logits");
  DecodeShape shape;
  shape.batch = cls_logits.size(0);
  shape.num_anchors = cls_logits.size(1);
  shape.num_classes = cls_logits.size(2);

  check_rank(bbox_deltas, "bbox_deltas", 3, "[B, N, 4]");
  check_size(bbox_deltas, "bbox_deltas", 0, shape.batch, "B of cls_logits", "[B, N, 4]");
  check_size(bbox_deltas, "bbox_deltas", 1, shape.num_anchors, "N of cls_logits", "[B, N, 4]");
  check_size(bbox_deltas, "bbox_deltas", 2, 4, "box coordinates", "[B, N, 4]");
  check_same_dtype(bbox_deltas, "bbox_deltas", cls_logits, "cls_logits");
  check_same_device(bbox_deltas, "bbox_deltas", cls_logits, "cls_logits");

  BLADESMITH_CHECK_VALUE(anchors.dim() == 2 || anchors.dim() == 3,
                         "anchors: expected a 2-D tensor [N, 4] or a 3-D tensor [B, N, 4], ",
                         "got shape ", anchors.sizes());
  shape.per_image_anchors = anchors.dim() == 3;
  const char* anchors_layout = shape.per_image_anchors ? "[B, N, 4]" : "[N, 4]";
  const int64_t n_dim = shape.per_image_anchors ? 1 : 0;
  if (shape.per_image_anchors) {
    check_size(anchors, "anchors", 0, shape.batch, "B of cls_logits", anchors_layout);
  }
  check_size(anchors, "anchors", n_dim, shape.num_anchors, "N of cls_logits", anchors_layout);
  check_size(anchors, "anchors", n_dim + 1, 4, "box coordinates", anchors_layout);
  check_same_dtype(anchors, "anchors", cls_logits, "cls_logits");
  check_same_device(anchors, "anchors", cls_logits, "cls_logits");

  check_rank(image_sizes, "image_sizes", 2, "[B, 2]");
  check_size(image_sizes, "image_sizes", 0, shape.batch, "B of cls_logits", "[B, 2]");
  check_size(image_sizes, "image_sizes", 1, 2, "(height, width)", "[B, 2]");
  check_dtype(image_sizes, "image_sizes", at::kLong);
  check_same_device(image_sizes, "image_sizes", cls_logits, "cls_logits");

  BLADESMITH_CHECK_VALUE(!std::isnan(score_threshold),
                         "score_threshold: expected a number, got nan");
  BLADESMITH_CHECK_VALUE(topk_candidates >= 0,
                         "topk_candidates: expected a non-negative integer, got ", topk_candidates);
  BLADESMITH_CHECK_VALUE(weights.size() == 4, "weights: expected 4 values (wx, wy, ww, wh), got ",
                         weights.size());
  for (double w : weights) {
    BLADESMITH_CHECK_VALUE(std::isfinite(w) && w > 0,
                           "weights: expected finite positive values, got ", weights);
  }
  BLADESMITH_CHECK_VALUE(!std::isnan(bbox_clip), "bbox_clip: expected a number, got nan");

  shape.level_offsets.reserve(level_sizes.size() + 1);
  shape.level_topk.reserve(level_sizes.size());
  shape.slot_offsets.reserve(level_sizes.size() + 1);
  shape.level_offsets.push_back(0);
  shape.slot_offsets.push_back(0);
  for (int64_t n : level_sizes) {
    BLADESMITH_CHECK_VALUE(n >= 0, "level_sizes: expected non-negative sizes, got ", level_sizes);
    shape.level_offsets.push_back(shape.level_offsets.back() + n);
    const int64_t k = std::min(topk_candidates, n * shape.num_classes);
    shape.level_topk.push_back(k);
    shape.slot_offsets.push_back(shape.slot_offsets.back() + k);
  }
  shape.num_candidates = shape.slot_offsets.back();
  BLADESMITH_CHECK_VALUE(shape.level_offsets.back() == shape.num_anchors,
                         "level_sizes: expected sizes that sum to N = ", shape.num_anchors,
                         " (dimension 1 of cls_logits), got ", level_sizes, " (sum ",
                         shape.level_offsets.back(), ")");
  return shape;
}

// The scalar arguments of NMS, checked on their own by kernels that fuse decode and NMS.
inline void check_nms_arguments(double iou_threshold, int64_t max_detections) {
  BLADESMITH_CHECK_VALUE(!std::isnan(iou_threshold), "iou_threshold: expected a number, got nan");
  BLADESMITH_CHECK_VALUE(max_detections >= 0,
                         "max_detections: expected a non-negative integer, got ", max_detections);
}

inline void check_nms_inputs(const at::Tensor& boxes, const at::Tensor& scores,
                             const at::Tensor& labels, double iou_threshold,
                             int64_t max_detections) {
  check_rank(boxes, "boxes", 3, "[B, K, 4]");
  check_size(boxes, "boxes", 2, 4, "box coordinates", "[B, K, 4]");
  check_float(boxes, "boxes");
  check_rank(scores, "scores", 2, "[B, K]");
  check_size(scores, "scores", 0, boxes.size(0), "B of boxes", "[B, K]");
  check_size(scores, "scores", 1, boxes.size(1), "K of boxes", "[B, K]");
  check_same_dtype(scores, "scores", boxes, "boxes");
  check_same_device(scores, "scores", boxes, "boxes");
  check_rank(labels, "labels", 2, "[B, K]");
  check_size(labels, "labels", 0, boxes.size(0), "B of boxes", "[B, K]");
  check_size(labels, "labels", 1, boxes.size(1), "K of boxes", "[B, K]");
  check_dtype(labels, "labels", at::kLong);
  check_same_device(labels, "labels", boxes, "boxes");
  check_nms_arguments(iou_threshold, max_detections);
}

// multilevel_roi_align's inputs; returns the table's layout.
inline roi::Levels check_multilevel_roi_align_inputs(
    const at::Tensor& table, const at::Tensor& rois, const at::Tensor& level_of,
    at::IntArrayRef heights, at::IntArrayRef widths, at::ArrayRef<double> scales,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio) {
  check_rank(table, "table", 2, "[B * rows per image, C]");
  check_float(table, "table");
  check_rank(rois, "rois", 2, "[N, 5]");
  check_size(rois, "rois", 1, 5, "image index and box", "[N, 5]");
  check_dtype(rois, "rois", at::kFloat);
  check_same_device(rois, "rois", table, "table");
  check_rank(level_of, "level_of", 1, "[N]");
  check_size(level_of, "level_of", 0, rois.size(0), "N of rois", "[N]");
  check_dtype(level_of, "level_of", at::kLong);
  check_same_device(level_of, "level_of", table, "table");
  const auto count = static_cast<int64_t>(heights.size());
  BLADESMITH_CHECK_VALUE(count >= 1 && count <= kMaxLevels,
                         "heights: expected 1 to ", kMaxLevels, " levels, got ", count);
  BLADESMITH_CHECK_VALUE(static_cast<int64_t>(widths.size()) == count &&
                             static_cast<int64_t>(scales.size()) == count,
                         "widths, scales: expected one per level (", count, "), got ",
                         static_cast<int64_t>(widths.size()), " and ",
                         static_cast<int64_t>(scales.size()));
  BLADESMITH_CHECK_VALUE(pooled_height > 0 && pooled_width > 0,
                         "pooled_height, pooled_width: expected positive sizes, got ",
                         pooled_height, " and ", pooled_width);
  BLADESMITH_CHECK_VALUE(sampling_ratio > 0, "sampling_ratio: expected a positive ratio, got ",
                         sampling_ratio);
  roi::Levels levels;
  levels.count = count;
  for (int64_t l = 0; l < count; ++l) {
    BLADESMITH_CHECK_VALUE(heights[l] > 0 && widths[l] > 0,
                           "heights, widths: expected positive sizes, got ", heights, " and ",
                           widths);
    levels.height[l] = heights[l];
    levels.width[l] = widths[l];
    levels.offset[l] = levels.rows_per_image;
    levels.scale[l] = static_cast<float>(scales[l]);
    int64_t pixels = 0;
    BLADESMITH_CHECK_VALUE(!c10::mul_overflows(heights[l], widths[l], &pixels) &&
                               !c10::add_overflows(levels.rows_per_image, pixels,
                                                   &levels.rows_per_image),
                           "heights, widths: the levels' pixels overflow int64, got ", heights,
                           " and ", widths);
  }
  BLADESMITH_CHECK_VALUE(table.size(0) % levels.rows_per_image == 0, "table: expected rows in ",
                         "whole images of ", levels.rows_per_image, " (the levels' pixels), got ",
                         table.size(0));
  levels.images = table.size(0) / levels.rows_per_image;
  return levels;
}

// A multilevel_roi_align call as every kernel takes it: the checked inputs, contiguous,
// the table's layout, and the output [N, h, w, C].
struct MultilevelRoiAlign {
  roi::Levels levels;
  at::Tensor table, rois, level_of, output;
};

inline MultilevelRoiAlign multilevel_roi_align_call(
    const at::Tensor& table, const at::Tensor& rois, const at::Tensor& level_of,
    at::IntArrayRef heights, at::IntArrayRef widths, at::ArrayRef<double> scales,
    int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio) {
  const roi::Levels levels = check_multilevel_roi_align_inputs(
      table, rois, level_of, heights, widths, scales, pooled_height, pooled_width,
      sampling_ratio);
  return {levels, table.contiguous(), rois.contiguous(), level_of.contiguous(),
          at::empty({rois.size(0), pooled_height, pooled_width, table.size(1)},
                    table.options())};
}

}  // namespace bladesmith
