// retinanet_decode on the CPU: per image and level, threshold, top-k and box decoding with
// torchvision's float arithmetic (RetinaNet.postprocess_detections before NMS).
//
// Under load, hundreds of thousands of a level's logits pass the threshold and sigmoid on all
// of them would dominate, so selection works on logits: a sample of the level guesses a logit
// that about 2k candidates reach, those are gathered and scored, and the top k by score are
// taken among them. Rounding keeps sigmoid only roughly monotonic (and ties scores, in float16
// above all), so a second gather reaches lower where a score that makes the cut may lie: the
// result is exact whatever the guess.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "../checks.h"

namespace bladesmith {
namespace {

struct Candidate {
  float score;
  int64_t index;  // anchor * C + class, within the level
};

// Strict order of the output: higher score first, then lower flat index. A function object,
// so that the sorts inline it.
struct Better {
  bool operator()(const Candidate& a, const Candidate& b) const {
    return a.score > b.score || (a.score == b.score && a.index < b.index);
  }
};

// torch.sigmoid in float, rounded to the input dtype.
template <typename scalar_t>
inline float score_of(float x) {
  return static_cast<float>(static_cast<scalar_t>(1.0f / (1.0f + std::exp(-x))));
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

// Writes one image and level's candidates from the front of its output slots.
template <typename scalar_t>
void write_level(const Candidate* candidates, int64_t count, const scalar_t* deltas,
                 const scalar_t* anchors, int64_t num_classes, const BoxCoder& coder,
                 float height, float width, scalar_t* boxes, scalar_t* scores,
                 int64_t* labels) {
  for (int64_t slot = 0; slot < count; ++slot) {
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

// The guess is the kSampleRank-th largest logit of a sample of one logit in `stride`, so
// about kSampleRank * stride logits of the level reach it: a stride of 2k / kSampleRank makes
// that twice the rank needed, so that a guess too high to reach k candidates (and a second
// gather) is rare.
constexpr int64_t kSampleRank = 64;
// The sample is made of runs of this many consecutive logits (a cache line of float32), one
// run every kRun * stride logits: it reads a small part of the memory a strided one would.
constexpr int64_t kRun = 16;

// The distance between sampled runs in a level, coprime with C so that the runs start at
// every class; 0 where the level is too small to gain from a guess.
int64_t sample_step(int64_t topk, int64_t num_classes) {
  const int64_t stride = 2 * topk / kSampleRank;
  if (stride < 2) return 0;
  int64_t step = stride * kRun;
  while (std::gcd(step, num_classes) != 1) ++step;
  return step;
}

// Sampled runs lie too far apart for the hardware prefetcher: without a hint, each would wait
// on memory.
inline void prefetch(const void* address) {
#if defined(__GNUC__) || defined(__clang__)
  __builtin_prefetch(address);
#else
  static_cast<void>(address);
#endif
}

// The kSampleRank largest of the sampled logits of [begin, end) that reach `lowest`.
template <typename scalar_t>
std::vector<float> sample_top(const scalar_t* logits, int64_t begin, int64_t end, int64_t step,
                              float lowest) {
  constexpr int64_t kAhead = 8;  // runs prefetched ahead
  std::vector<float> top((end - begin) / step * kRun + kRun);
  int64_t count = 0;
  for (int64_t run = (begin + step - 1) / step * step; run < end; run += step) {
    if (run + kAhead * step < end) {
      prefetch(logits + run + kAhead * step);
      prefetch(logits + run + kAhead * step + kRun - 1);
    }
    for (int64_t i = run; i < std::min(run + kRun, end); ++i) {
      // No branch: under load, a third or more of the logits reach `lowest`, at random.
      const float x = static_cast<float>(logits[i]);
      top[count] = x;
      count += x >= lowest;
    }
  }
  top.resize(count);
  if (count > kSampleRank) {
    std::nth_element(top.begin(), top.begin() + kSampleRank - 1, top.end(),
                     std::greater<float>());
    top.resize(kSampleRank);
  }
  return top;
}

// Appends the logits of [begin, end) within [low, high], scored, to `out`.
template <typename scalar_t>
void gather(const scalar_t* logits, int64_t begin, int64_t end, float low, float high,
            std::vector<Candidate>& out) {
  const auto keep = [&](int64_t i) {
    const float x = static_cast<float>(logits[i]);
    if (x >= low && x <= high) out.push_back({score_of<scalar_t>(x), i});
  };
  // Few blocks hold a logit that high: each is tested whole first, in a loop that vectorizes.
  constexpr int64_t kBlock = 64;
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    int hits = 0;
    for (int64_t j = 0; j < kBlock; ++j) hits += static_cast<float>(logits[i + j]) >= low;
    if (hits == 0) continue;
    for (int64_t j = i; j < i + kBlock; ++j) keep(j);
  }
  for (; i < end; ++i) keep(i);
}

// Sampling and gathering run on chunks of this many logits, so that one image's large first
// level spreads over threads too.
constexpr int64_t kChunk = 1 << 16;

struct Chunk {
  int64_t segment, begin, end;  // logits [begin, end) of one image and level
  std::vector<float> sampled;
  std::vector<Candidate> found;
};

struct Segment {
  int64_t image, level, sample_step;
  std::vector<int64_t> chunks;
  float low, high;       // the logits gathered next, [low, high]
  bool pending = false;  // whether that gather is still to run
  std::vector<Candidate> candidates;
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

  std::vector<Segment> segments;  // one per image and level with slots
  std::vector<Chunk> chunks;
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t l = 0; l < num_levels; ++l) {
      if (shape.level_topk[l] == 0) continue;
      Segment segment{b, l, sample_step(shape.level_topk[l], C)};
      const int64_t size = level_sizes[l] * C;
      for (int64_t begin = 0; begin < size; begin += kChunk) {
        segment.chunks.push_back(static_cast<int64_t>(chunks.size()));
        chunks.push_back({static_cast<int64_t>(segments.size()), begin,
                          std::min(begin + kChunk, size), {}, {}});
      }
      segments.push_back(std::move(segment));
    }
  }
  const int64_t num_chunks = static_cast<int64_t>(chunks.size());
  const int64_t num_segments = static_cast<int64_t>(segments.size());

  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, cls_logits.scalar_type(), "retinanet_decode_cpu", [&] {
        constexpr float inf = std::numeric_limits<float>::infinity();
        // Comparing with a Python float rounds the threshold to the tensor's dtype.
        const float threshold = static_cast<float>(static_cast<scalar_t>(score_threshold));
        const double epsilon = std::numeric_limits<scalar_t>::epsilon();
        // The least logit above logit_bound: no candidate lies below.
        const float lowest = std::nextafter(logit_bound(threshold, epsilon), inf);
        const scalar_t* logits = logits_c.const_data_ptr<scalar_t>();
        const scalar_t* deltas = deltas_c.const_data_ptr<scalar_t>();
        const scalar_t* anchor_data = anchors_c.const_data_ptr<scalar_t>();
        const int64_t* sizes = sizes_c.const_data_ptr<int64_t>();
        scalar_t* boxes_out = boxes.mutable_data_ptr<scalar_t>();
        scalar_t* scores_out = scores.mutable_data_ptr<scalar_t>();
        int64_t* labels_out = labels.mutable_data_ptr<int64_t>();
        const auto segment_logits = [&](const Segment& segment) {
          return logits + (segment.image * N + shape.level_offsets[segment.level]) * C;
        };
        // Per segment the work is small: one image's levels per task at least, so that a
        // single image spends no parallel region on it.
        const auto for_segments = [&](const auto& fn) {
          at::parallel_for(0, num_segments, num_levels, [&](int64_t begin, int64_t end) {
            for (int64_t s = begin; s < end; ++s) fn(segments[s]);
          });
        };
        const auto run_gathers = [&] {
          at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
              Chunk& chunk = chunks[i];
              const Segment& segment = segments[chunk.segment];
              if (!segment.pending) continue;
              chunk.found.clear();
              gather(segment_logits(segment), chunk.begin, chunk.end, segment.low,
                     segment.high, chunk.found);
            }
          });
        };
        // Adds what the chunks gathered, drops those that fail the threshold and moves the
        // best k of the rest to the front, unordered; returns how many that is (k, or all
        // when fewer).
        const auto select = [&](Segment& segment) {
          auto& candidates = segment.candidates;
          for (int64_t c : segment.chunks) {
            candidates.insert(candidates.end(), chunks[c].found.begin(), chunks[c].found.end());
          }
          const auto fails = [&](const Candidate& c) { return !(c.score > threshold); };
          candidates.erase(std::remove_if(candidates.begin(), candidates.end(), fails),
                           candidates.end());
          const int64_t k =
              std::min<int64_t>(shape.level_topk[segment.level], candidates.size());
          if (k > 0) {
            std::nth_element(candidates.begin(), candidates.begin() + k - 1, candidates.end(),
                             Better());
          }
          return k;
        };
        const auto write = [&](Segment& segment, int64_t k) {
          std::sort(segment.candidates.begin(), segment.candidates.begin() + k, Better());
          const int64_t b = segment.image, l = segment.level;
          const int64_t first_anchor = b * N + shape.level_offsets[l];
          const int64_t slot = b * K + shape.slot_offsets[l];
          write_level<scalar_t>(
              segment.candidates.data(), k, deltas + first_anchor * 4,
              anchor_data + b * anchors_image_stride + shape.level_offsets[l] * 4, C, coder,
              static_cast<float>(sizes[b * 2]), static_cast<float>(sizes[b * 2 + 1]),
              boxes_out + slot * 4, scores_out + slot, labels_out + slot);
        };

        at::parallel_for(0, num_chunks, 1, [&](int64_t begin, int64_t end) {
          for (int64_t i = begin; i < end; ++i) {
            Chunk& chunk = chunks[i];
            const Segment& segment = segments[chunk.segment];
            if (segment.sample_step == 0) continue;
            chunk.sampled = sample_top(segment_logits(segment), chunk.begin, chunk.end,
                                       segment.sample_step, lowest);
          }
        });
        // The guess: the kSampleRank-th largest of the level's sample (the lowest candidate
        // when there is none).
        for_segments([&](Segment& segment) {
          std::vector<float> top;
          for (int64_t c : segment.chunks) {
            top.insert(top.end(), chunks[c].sampled.begin(), chunks[c].sampled.end());
          }
          segment.low = lowest;
          if (static_cast<int64_t>(top.size()) >= kSampleRank) {
            std::nth_element(top.begin(), top.begin() + kSampleRank - 1, top.end(),
                             std::greater<float>());
            segment.low = top[kSampleRank - 1];
          }
          segment.high = inf;
          segment.pending = true;
        });
        run_gathers();
        // The k-th best score gathered is at most the level's k-th best, so a candidate that
        // makes the cut has a logit above logit_bound_reaching of it: gather down to there, or
        // to the lowest candidate when fewer than k were gathered.
        std::atomic<bool> any_pending{false};
        for_segments([&](Segment& segment) {
          const int64_t k = select(segment);
          float low = lowest;
          if (k == shape.level_topk[segment.level]) {
            const float kth = segment.candidates[k - 1].score;
            low = std::max(low, std::nextafter(logit_bound_reaching<scalar_t>(kth), inf));
          }
          segment.pending = low < segment.low;
          if (segment.pending) {
            any_pending = true;
            segment.high = std::nextafter(segment.low, -inf);
            segment.low = low;
          } else {
            write(segment, k);
          }
        });
        if (any_pending) {
          run_gathers();
          for_segments([&](Segment& segment) {
            if (segment.pending) write(segment, select(segment));
          });
        }
      });
  return {boxes, scores, labels};
}

}  // namespace

TORCH_LIBRARY_IMPL(bladesmith, CPU, m) {
  m.impl("retinanet_decode", &retinanet_decode_cpu);
}

}  // namespace bladesmith
