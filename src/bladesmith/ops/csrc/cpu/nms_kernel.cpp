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
//
// Greedy NMS keeps a box unless a kept box of its label, of a better score, overlaps it. In
// one pass over all labels by descending score, each box is checked against the kept boxes of
// its label only; the kept come out best first, so the pass stops at max_detections.
template <typename scalar_t>
int64_t nms_image(const scalar_t* boxes_in, const scalar_t* scores_in, const int64_t* labels,
                  int64_t num_boxes, double iou_threshold, int64_t max_detections,
                  scalar_t* boxes_out, scalar_t* scores_out, int64_t* labels_out) {
  struct Entry {
    float score;
    int64_t slot;
  };
  std::vector<Entry> order;
  std::vector<int64_t> label_values;  // the distinct labels, sorted
  order.reserve(num_boxes);
  label_values.reserve(num_boxes);
  for (int64_t i = 0; i < num_boxes; ++i) {
    const float score = static_cast<float>(scores_in[i]);
    if (labels[i] < 0 || std::isnan(score)) continue;  // padding, or never selected
    order.push_back({score, i});
    label_values.push_back(labels[i]);
  }
  std::sort(order.begin(), order.end(), [](const Entry& a, const Entry& b) {
    return a.score > b.score || (a.score == b.score && a.slot < b.slot);
  });
  std::sort(label_values.begin(), label_values.end());
  label_values.erase(std::unique(label_values.begin(), label_values.end()), label_values.end());

  struct Kept {
    float box[4], area;
    int64_t slot;
    int64_t previous;  // the kept box of the same label before this one, or -1
  };
  std::vector<Kept> kept;
  kept.reserve(std::min<int64_t>(max_detections, static_cast<int64_t>(order.size())));
  std::vector<int64_t> last_kept(label_values.size(), -1);  // per label
  for (const Entry& entry : order) {
    if (static_cast<int64_t>(kept.size()) == max_detections) break;
    const int64_t i = entry.slot;
    Kept candidate{};
    float* box = candidate.box;
    for (int c = 0; c < 4; ++c) box[c] = static_cast<float>(boxes_in[i * 4 + c]);
    candidate.area = (box[2] - box[0]) * (box[3] - box[1]);
    const auto label = std::lower_bound(label_values.begin(), label_values.end(), labels[i]);
    int64_t& last = last_kept[label - label_values.begin()];
    bool suppressed = false;
    for (int64_t k = last; k >= 0 && !suppressed; k = kept[k].previous) {
      // Compared in double, as torchvision compares its float IoU with the double threshold.
      suppressed = static_cast<double>(iou(kept[k].box, kept[k].area, box, candidate.area)) >
                   iou_threshold;
    }
    if (suppressed) continue;
    candidate.slot = i;
    candidate.previous = last;
    last = static_cast<int64_t>(kept.size());
    kept.push_back(candidate);
  }

  const int64_t count = static_cast<int64_t>(kept.size());
  for (int64_t d = 0; d < count; ++d) {
    const int64_t i = kept[d].slot;
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
