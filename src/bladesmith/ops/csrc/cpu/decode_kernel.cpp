// retinanet_decode on the CPU: per image and level, threshold, top-k and box decoding with
// torchvision's float arithmetic (RetinaNet.postprocess_detections before NMS).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../checks.h"

namespace bladesmith {
namespace {

struct Candidate {
  float score;
  int64_t index;  // anchor * C + class, within the level
};

// Strict order of the output: higher score first, then lower flat index.
inline bool better(const Candidate& a, const Candidate& b) {
  return a.score > b.score || (a.score == b.score && a.index < b.index);
}

// sigmoid is monotonic, so only logits above this bound need exp(); the exact test on the
// rounded score still decides. The bound sits a few ulps of the dtype below
// logit(threshold), so rounding of the score never drops a candidate that passes.
float logit_bound(float threshold, double epsilon) {
  constexpr float inf = std::numeric_limits<float>::infinity();
  if (threshold <= 0) return -inf;
  if (threshold >= 1) return inf;  // a score never exceeds 1
  const double t = threshold * (1.0 - 8.0 * epsilon);
  return std::nextafter(static_cast<float>(std::log(t / (1.0 - t))), -inf);
}

struct BoxCoder {
  float wx, wy, ww, wh, clip;

  // BoxCoder.decode_single then clip_boxes_to_image, operation by operation.
  void decode(const float* anchor, const float* delta, float height, float width,
              float* box) const {
    const float widths = anchor[2] - anchor[0];
    const float heights = anchor[3] - anchor[1];
    const float ctr_x = anchor[0] + 0.5f * widths;
    const float ctr_y = anchor[1] + 0.5f * heights;
    const float dx = delta[0] / wx;
    const float dy = delta[1] / wy;
    // std::min(x, clip) keeps a NaN x, as torch.clamp does.
    const float dw = std::min(delta[2] / ww, clip);
    const float dh = std::min(delta[3] / wh, clip);
    const float pred_ctr_x = dx * widths + ctr_x;
    const float pred_ctr_y = dy * heights + ctr_y;
    const float half_w = 0.5f * (std::exp(dw) * widths);
    const float half_h = 0.5f * (std::exp(dh) * heights);
    box[0] = clamp(pred_ctr_x - half_w, width);
    box[1] = clamp(pred_ctr_y - half_h, height);
    box[2] = clamp(pred_ctr_x + half_w, width);
    box[3] = clamp(pred_ctr_y + half_h, height);
  }

  static float clamp(float x, float high) { return std::min(std::max(x, 0.0f), high); }
};

// The best `topk` of logits[begin, end) above the threshold, best first. A heap with the
// worst on top keeps memory at O(topk).
template <typename scalar_t>
std::vector<Candidate> select_top(const scalar_t* logits, int64_t begin, int64_t end,
                                  int64_t topk, float threshold, float bound) {
  std::vector<Candidate> heap;
  if (topk == 0) return heap;
  heap.reserve(topk);
  for (int64_t i = begin; i < end; ++i) {
    const float x = static_cast<float>(logits[i]);
    if (!(x > bound)) continue;  // also drops NaN
    // torch.sigmoid in float, rounded to the input dtype.
    const float score = static_cast<float>(static_cast<scalar_t>(1.0f / (1.0f + std::exp(-x))));
    if (!(score > threshold)) continue;
    const Candidate candidate{score, i};
    if (static_cast<int64_t>(heap.size()) < topk) {
      heap.push_back(candidate);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (better(candidate, heap.front())) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = candidate;
      std::push_heap(heap.begin(), heap.end(), better);
    }
  }
  std::sort_heap(heap.begin(), heap.end(), better);
  return heap;
}

// Writes one image and level's candidates from the front of its output slots.
template <typename scalar_t>
void write_level(const std::vector<Candidate>& candidates, const scalar_t* deltas,
                 const scalar_t* anchors, int64_t num_classes, const BoxCoder& coder,
                 float height, float width, scalar_t* boxes, scalar_t* scores,
                 int64_t* labels) {
  for (size_t slot = 0; slot < candidates.size(); ++slot) {
    const int64_t anchor_index = candidates[slot].index / num_classes;
    float anchor[4], delta[4], box[4];
    for (int c = 0; c < 4; ++c) {
      anchor[c] = static_cast<float>(anchors[anchor_index * 4 + c]);
      delta[c] = static_cast<float>(deltas[anchor_index * 4 + c]);
    }
    coder.decode(anchor, delta, height, width, box);
    for (int c = 0; c < 4; ++c) boxes[slot * 4 + c] = static_cast<scalar_t>(box[c]);
    scores[slot] = static_cast<scalar_t>(candidates[slot].score);
    labels[slot] = candidates[slot].index % num_classes;
  }
}

// Selection runs on chunks of this many logits, so that one image's large first level
// spreads over threads too; each chunk's best are then merged per image and level.
constexpr int64_t kChunk = 1 << 16;

struct Chunk {
  int64_t image, level, begin, end;  // logits [begin, end) within the level
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> retinanet_decode_cpu(
    const at::Tensor& cls_logits, const at::Tensor& bbox_deltas, const at::Tensor& anchors,
    at::IntArrayRef level_sizes, const at::Tensor& image_sizes, double score_threshold,
    int64_t topk_candidates, at::ArrayRef<double> weights, double bbox_clip) {
  const DecodeShape shape =
      check_decode_inputs(cls_logits, bbox_deltas, anchors, level_sizes, image_sizes,
                          score_threshold, topk_candidates, weights, bbox_clip);
  const int64_t B = shape.batch, N = shape.num_anchors, C = shape.num_classes;
  const int64_t K = shape.num_candidates;
  auto boxes = at::zeros({B, K, 4}, cls_logits.options());
  auto scores = at::zeros({B, K}, cls_logits.options());
  auto labels = at::full({B, K}, -1, cls_logits.options().dtype(at::kLong));
  const int64_t num_levels = static_cast<int64_t>(level_sizes.size());
  if (B == 0 || K == 0) return {boxes, scores, labels};

  const auto logits_c = cls_logits.contiguous();
  const auto deltas_c = bbox_deltas.contiguous();
  const auto anchors_c = anchors.contiguous();
  const auto sizes_c = image_sizes.contiguous();
  const BoxCoder coder{static_cast<float>(weights[0]), static_cast<float>(weights[1]),
                       static_cast<float>(weights[2]), static_cast<float>(weights[3]),
                       static_cast<float>(bbox_clip)};
  const int64_t anchors_image_stride = shape.per_image_anchors ? N * 4 : 0;

  std::vector<Chunk> chunks;
  std::vector<size_t> first_chunk;  // of each (image, level), and the end
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t l = 0; l < num_levels; ++l) {
      first_chunk.push_back(chunks.size());
      const int64_t size = level_sizes[l] * C;
      for (int64_t begin = 0; begin < size; begin += kChunk) {
        chunks.push_back({b, l, begin, std::min(begin + kChunk, size)});
      }
    }
  }
  first_chunk.push_back(chunks.size());
  std::vector<std::vector<Candidate>> selected(chunks.size());

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, cls_logits.scalar_type(), "retinanet_decode_cpu", [&] {
        // Comparing with a Python float rounds the threshold to the tensor's dtype.
        const float threshold = static_cast<float>(static_cast<scalar_t>(score_threshold));
        const float bound = logit_bound(threshold, std::numeric_limits<scalar_t>::epsilon());
        const scalar_t* logits = logits_c.const_data_ptr<scalar_t>();
        at::parallel_for(0, chunks.size(), 1, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            const Chunk& chunk = chunks[i];
            const scalar_t* level_logits =
                logits + (chunk.image * N + shape.level_offsets[chunk.level]) * C;
            selected[i] = select_top(level_logits, chunk.begin, chunk.end,
                                     shape.level_topk[chunk.level], threshold, bound);
          }
        });

        const scalar_t* deltas = deltas_c.const_data_ptr<scalar_t>();
        const scalar_t* anchor_data = anchors_c.const_data_ptr<scalar_t>();
        const int64_t* sizes = sizes_c.const_data_ptr<int64_t>();
        scalar_t* boxes_out = boxes.mutable_data_ptr<scalar_t>();
        scalar_t* scores_out = scores.mutable_data_ptr<scalar_t>();
        int64_t* labels_out = labels.mutable_data_ptr<int64_t>();
        at::parallel_for(0, B * num_levels, 1, [&](int64_t begin, int64_t end) {
          for (int64_t task = begin; task < end; ++task) {
            const int64_t b = task / num_levels, l = task % num_levels;
            std::vector<Candidate> best;
            for (size_t i = first_chunk[task]; i < first_chunk[task + 1]; ++i) {
              best.insert(best.end(), selected[i].begin(), selected[i].end());
            }
            const auto k = std::min<size_t>(shape.level_topk[l], best.size());
            std::partial_sort(best.begin(), best.begin() + k, best.end(), better);
            best.resize(k);
            const int64_t first_anchor = b * N + shape.level_offsets[l];
            const int64_t slot = b * K + shape.slot_offsets[l];
            write_level<scalar_t>(
                best, deltas + first_anchor * 4,
                anchor_data + b * anchors_image_stride + shape.level_offsets[l] * 4, C, coder,
                static_cast<float>(sizes[b * 2]), static_cast<float>(sizes[b * 2 + 1]),
                boxes_out + slot * 4, scores_out + slot, labels_out + slot);
          }
        });
      });
  return {boxes, scores, labels};
}

}  // namespace

TORCH_LIBRARY_IMPL(bladesmith, CPU, m) {
  m.impl("retinanet_decode", &retinanet_decode_cpu);
}

}  // namespace bladesmith
