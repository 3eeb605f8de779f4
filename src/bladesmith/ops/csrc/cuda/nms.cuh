// Greedy class-aware NMS over candidates sorted by descending key, one block per image, as
// cpu/nms_kernel.cpp defines it, stopping as soon as max_detections are kept.
//
// Candidates come 256 at a time. Each is first tested against the detections kept so far
// (kept boxes are cached in shared memory); the survivors are then resolved 64 at a time: a
// 64x64 IoU bitmask of the group (upper triangle, same label only), then one warp walks the
// group's survivors in order, keeping each one not yet suppressed and removing the ones its
// row suppresses. No mask over all candidate pairs is ever built, and the outputs are written
// as detections are kept.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include <cmath>
#include <limits>

#include "common.cuh"

namespace bladesmith {
namespace gpu {

constexpr int kNmsThreads = 256;
constexpr int kNmsGroup = 64;  // one 64-bit mask word
constexpr int kNmsParts = kNmsThreads / kNmsGroup;
constexpr int kKeptCache = 1024;

template <typename T>
struct NmsOutput {
  T* boxes;         // [B, D, 4]
  T* scores;        // [B, D]
  int64_t* labels;  // [B, D]
  int64_t* counts;  // [B]
  int64_t max_detections;
};

template <typename T>
struct NmsTensors {
  at::Tensor boxes, scores, labels, counts;

  NmsTensors(int64_t batch, int64_t max_detections, const at::TensorOptions& options)
      : boxes(at::empty({batch, max_detections, 4}, options)),
        scores(at::empty({batch, max_detections}, options)),
        labels(at::empty({batch, max_detections}, options.dtype(at::kLong))),
        counts(at::empty({batch}, options.dtype(at::kLong))) {}

  NmsOutput<T> view() {
    return {boxes.mutable_data_ptr<T>(), scores.mutable_data_ptr<T>(),
            labels.mutable_data_ptr<int64_t>(), counts.mutable_data_ptr<int64_t>(),
            labels.size(1)};
  }
};

// The float t' with f > t' exactly when double(f) > t, for every float f: the reference
// compares its float IoU with the double threshold.
inline float float_threshold(double t) {
  float f = static_cast<float>(t);
  if (static_cast<double>(f) > t) f = std::nextafter(f, -std::numeric_limits<float>::infinity());
  return f;
}

__device__ __forceinline__ uint64_t assemble_row(const uint16_t (&parts)[kNmsParts]) {
  uint64_t row = 0;
#pragma unroll
  for (int p = 0; p < kNmsParts; ++p) row |= static_cast<uint64_t>(parts[p]) << (16 * p);
  return row;
}

// Source::fetch(b, key, box, score, label) gives a candidate's box and score as values of T.
template <typename T, typename Source>
__global__ void __launch_bounds__(kNmsThreads)
    nms_kernel(Source src, const uint64_t* __restrict__ sorted, int64_t num_slots,
               float iou_threshold, NmsOutput<T> out) {
  __shared__ float4 kept_box[kKeptCache];
  __shared__ float kept_area[kKeptCache];
  __shared__ int64_t kept_label[kKeptCache];
  __shared__ float4 cand_box[kNmsThreads];
  __shared__ float cand_area[kNmsThreads];
  __shared__ float cand_score[kNmsThreads];
  __shared__ int64_t cand_label[kNmsThreads];
  __shared__ uint32_t alive_bits[kNmsThreads / 32];
  __shared__ uint32_t dead_bits[kNmsParts][kNmsGroup / 32];
  __shared__ uint16_t row_bits[kNmsGroup][kNmsParts];
  __shared__ int64_t s_kept;

  const int64_t b = blockIdx.x, D = out.max_detections;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  T* boxes = out.boxes + b * D * 4;
  T* scores = out.scores + b * D;
  int64_t* labels = out.labels + b * D;

  // Does a detection kept at j in [from, to) (every step-th) suppress this box?
  const auto suppressed = [&](float4 box, float area, int64_t label, int64_t from, int64_t to,
                              int step) {
    for (int64_t j = from; j < to; j += step) {
      float4 kb;
      float ka;
      if (j < kKeptCache) {
        if (kept_label[j] != label) continue;
        kb = kept_box[j];
        ka = kept_area[j];
      } else {
        if (labels[j] != label) continue;
        const T* k = boxes + j * 4;
        kb = make_float4(to_float(k[0]), to_float(k[1]), to_float(k[2]), to_float(k[3]));
        ka = box_area(kb);
      }
      if (iou(kb, ka, box, area) > iou_threshold) return true;
    }
    return false;
  };

  int64_t kept = 0;
  for (int64_t start = 0; start < num_slots && kept < D; start += kNmsThreads) {
    __syncthreads();  // the previous round is done with the shared candidates
    const int64_t i = start + tid;
    const uint64_t candidate = i < num_slots ? sorted[b * num_slots + i] : 0;
    float4 box = make_float4(0.f, 0.f, 0.f, 0.f);
    float score = 0.f, area = 0.f;
    int64_t label = -1;
    bool alive = candidate != 0;
    if (alive) {
      src.fetch(b, candidate, box, score, label);
      area = box_area(box);
      alive = !suppressed(box, area, label, 0, kept, 1);
    }
    cand_box[tid] = box;
    cand_area[tid] = area;
    cand_score[tid] = score;
    cand_label[tid] = label;
    const uint32_t alive_ballot = __ballot_sync(0xFFFFFFFFu, alive);
    if (lane == 0) alive_bits[warp] = alive_ballot;
    // Valid candidates (non-zero keys) come first.
    const int valid = __syncthreads_count(candidate != 0);

    const int64_t round_kept = kept;
    for (int g = 0; g * kNmsGroup < valid && kept < D; ++g) {
      const uint64_t alive_group =
          alive_bits[2 * g] | (static_cast<uint64_t>(alive_bits[2 * g + 1]) << 32);
      if (alive_group == 0) continue;
      const int c = tid % kNmsGroup, part = tid / kNmsGroup, me = g * kNmsGroup + c;
      bool dead = !(alive_group >> c & 1u);
      uint32_t row = 0;
      if (!dead) {
        const float4 mb = cand_box[me];
        const float ma = cand_area[me];
        const int64_t ml = cand_label[me];
        // Kept earlier in this round, by the groups before this one.
        dead = suppressed(mb, ma, ml, round_kept + part, kept, kNmsParts);
        if (!dead) {
#pragma unroll 4
          for (int q = 0; q < kNmsGroup / kNmsParts; ++q) {
            const int j = part * (kNmsGroup / kNmsParts) + q;
            const int other = g * kNmsGroup + j;
            if (j > c && cand_label[other] == ml &&
                iou(mb, ma, cand_box[other], cand_area[other]) > iou_threshold) {
              row |= 1u << q;
            }
          }
        }
      }
      row_bits[c][part] = static_cast<uint16_t>(row);
      const uint32_t dead_ballot = __ballot_sync(0xFFFFFFFFu, dead);
      if (lane == 0) dead_bits[part][c / 32] = dead_ballot;
      __syncthreads();

      if (warp == 0) {
        uint64_t removed = 0;
#pragma unroll
        for (int p = 0; p < kNmsParts; ++p) {
          removed |= dead_bits[p][0] | (static_cast<uint64_t>(dead_bits[p][1]) << 32);
        }
        const uint64_t row_lo = assemble_row(row_bits[lane]);
        const uint64_t row_hi = assemble_row(row_bits[lane + 32]);
        // The serial part: uniform across the warp, one step per kept candidate.
        uint64_t remaining = ~removed, keep = 0;
        int64_t room = D - kept;
        while (remaining != 0 && room > 0) {
          const int first = __ffsll(static_cast<long long>(remaining)) - 1;
          const uint64_t r = __shfl_sync(0xFFFFFFFFu, first < 32 ? row_lo : row_hi, first % 32);
          keep |= 1ull << first;
          remaining &= ~(r | (1ull << first));
          --room;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c2 = lane + 32 * h;
          if (!(keep >> c2 & 1u)) continue;
          const int64_t pos = kept + __popcll(keep & ((1ull << c2) - 1));
          const int src_slot = g * kNmsGroup + c2;
          const float4 kb = cand_box[src_slot];
          boxes[pos * 4 + 0] = from_float<T>(kb.x);
          boxes[pos * 4 + 1] = from_float<T>(kb.y);
          boxes[pos * 4 + 2] = from_float<T>(kb.z);
          boxes[pos * 4 + 3] = from_float<T>(kb.w);
          scores[pos] = from_float<T>(cand_score[src_slot]);
          labels[pos] = cand_label[src_slot];
          if (pos < kKeptCache) {
            kept_box[pos] = kb;
            kept_area[pos] = cand_area[src_slot];
            kept_label[pos] = cand_label[src_slot];
          }
        }
        if (lane == 0) s_kept = kept + __popcll(keep);
      }
      __syncthreads();
      kept = s_kept;
    }
    if (valid < kNmsThreads) break;  // the rest are empty slots
  }

  for (int64_t pos = kept + tid; pos < D; pos += kNmsThreads) {
    boxes[pos * 4 + 0] = boxes[pos * 4 + 1] = boxes[pos * 4 + 2] = boxes[pos * 4 + 3] =
        from_float<T>(0.f);
    scores[pos] = from_float<T>(0.f);
    labels[pos] = -1;
  }
  if (tid == 0) out.counts[b] = kept;
}

// sorted: [B, num_slots] candidate keys, descending per image.
template <typename T, typename Source>
void launch_nms(const Source& src, const at::Tensor& sorted, int64_t num_slots,
                double iou_threshold, NmsTensors<T>& result) {
  const int64_t batch = result.counts.size(0);
  if (batch == 0) return;
  nms_kernel<T, Source><<<batch, kNmsThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      src, reinterpret_cast<const uint64_t*>(sorted.const_data_ptr<int64_t>()), num_slots,
      float_threshold(iou_threshold), result.view());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace gpu
}  // namespace bladesmith
