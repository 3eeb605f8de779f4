// batched_nms on the CPU: per image, class-aware greedy NMS as torchvision.ops.batched_nms,
// then the max_detections best by score.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../checks.h"

namespace bladesmith {
namespace {

// torchvision's nms_kernel arithmetic: intersection over (area_i + area_j - intersection).
inline float iou(const float* a, float area_a, const float* b, float area_b) {
  const float w = std::max(0.0f, std::min(a[2], b[2]) - std::max(a[0], b[0]));
  const float h = std::max(0.0f, std::min(a[3], b[3]) - std::max(a[1], b[1]));
  const float inter = w * h;
  return inter / (area_a + area_b - inter);
}

// One image: returns the number of detections written from the front of the outputs.
template <typename scalar_t>
int64_t nms_image(const scalar_t* boxes_in, const scalar_t* scores_in, const int64_t* labels,
                  int64_t num_boxes, double iou_threshold, int64_t max_detections,
                  scalar_t* boxes_out, scalar_t* scores_out, int64_t* labels_out) {
  std::vector<float> boxes(num_boxes * 4), areas(num_boxes), scores(num_boxes);
  std::vector<int64_t> order;
  order.reserve(num_boxes);
  for (int64_t i = 0; i < num_boxes; ++i) {
    scores[i] = static_cast<float>(scores_in[i]);
    if (labels[i] < 0 || std::isnan(scores[i])) continue;  // padding, or never selected
    for (int c = 0; c < 4; ++c) boxes[i * 4 + c] = static_cast<float>(boxes_in[i * 4 + c]);
    areas[i] = (boxes[i * 4 + 2] - boxes[i * 4]) * (boxes[i * 4 + 3] - boxes[i * 4 + 1]);
    order.push_back(i);
  }
  const auto by_score = [&](int64_t i, int64_t j) {
    return scores[i] > scores[j] || (scores[i] == scores[j] && i < j);
  };
  // Boxes of different labels never suppress each other, so each label is done alone.
  std::sort(order.begin(), order.end(), [&](int64_t i, int64_t j) {
    return labels[i] < labels[j] || (labels[i] == labels[j] && by_score(i, j));
  });

  std::vector<char> suppressed(num_boxes, 0);
  std::vector<int64_t> kept;
  for (size_t start = 0, end; start < order.size(); start = end) {
    end = start;
    while (end < order.size() && labels[order[end]] == labels[order[start]]) ++end;
    // Kept boxes come out by descending score, so beyond max_detections of one label none
    // can make the final cut.
    int64_t kept_in_label = 0;
    for (size_t a = start; a < end && kept_in_label < max_detections; ++a) {
      const int64_t i = order[a];
      if (suppressed[i]) continue;
      kept.push_back(i);
      ++kept_in_label;
      for (size_t b = a + 1; b < end; ++b) {
        const int64_t j = order[b];
        // Compared in double, as torchvision compares its float IoU with the double threshold.
        if (!suppressed[j] &&
            static_cast<double>(iou(&boxes[i * 4], areas[i], &boxes[j * 4], areas[j])) >
                iou_threshold) {
          suppressed[j] = 1;
        }
      }
    }
  }

  const int64_t count = std::min<int64_t>(max_detections, static_cast<int64_t>(kept.size()));
  std::partial_sort(kept.begin(), kept.begin() + count, kept.end(), by_score);
  for (int64_t d = 0; d < count; ++d) {
    const int64_t i = kept[d];
    for (int c = 0; c < 4; ++c) boxes_out[d * 4 + c] = boxes_in[i * 4 + c];
    scores_out[d] = scores_in[i];
    labels_out[d] = labels[i];
  }
  return count;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> batched_nms_cpu(
    const at::Tensor& boxes, const at::Tensor& scores, const at::Tensor& labels,
    double iou_threshold, int64_t max_detections) {
  check_nms_inputs(boxes, scores, labels, iou_threshold, max_detections);
  const int64_t B = boxes.size(0), K = boxes.size(1), D = max_detections;
  auto out_boxes = at::zeros({B, D, 4}, boxes.options());
  auto out_scores = at::zeros({B, D}, scores.options());
  auto out_labels = at::full({B, D}, -1, labels.options());
  auto counts = at::zeros({B}, labels.options());
  if (B == 0 || K == 0 || D == 0) return {out_boxes, out_scores, out_labels, counts};

  const auto boxes_c = boxes.contiguous();
  const auto scores_c = scores.contiguous();
  const auto labels_c = labels.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, boxes.scalar_type(),
                                  "batched_nms_cpu", [&] {
    const scalar_t* boxes_in = boxes_c.const_data_ptr<scalar_t>();
    const scalar_t* scores_in = scores_c.const_data_ptr<scalar_t>();
    const int64_t* labels_in = labels_c.const_data_ptr<int64_t>();
    scalar_t* boxes_out = out_boxes.mutable_data_ptr<scalar_t>();
    scalar_t* scores_out = out_scores.mutable_data_ptr<scalar_t>();
    int64_t* labels_out = out_labels.mutable_data_ptr<int64_t>();
    int64_t* counts_out = counts.mutable_data_ptr<int64_t>();
    at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        counts_out[b] = nms_image<scalar_t>(boxes_in + b * K * 4, scores_in + b * K,
                                            labels_in + b * K, K, iou_threshold, D,
                                            boxes_out + b * D * 4, scores_out + b * D,
                                            labels_out + b * D);
      }
    });
  });
  return {out_boxes, out_scores, out_labels, counts};
}

}  // namespace

TORCH_LIBRARY_IMPL(bladesmith, CPU, m) {
  m.impl("batched_nms", &batched_nms_cpu);
}

}  // namespace bladesmith
