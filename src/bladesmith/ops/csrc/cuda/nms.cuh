// Greedy class-aware NMS over candidates sorted by descending key, as cpu/nms_kernel.cpp
// defines it: the first max_detections survivors, in that order.
//
// Labels never suppress one another, so the labels are split into buckets (label mod the
// bucket count) and each (image, bucket) block runs the greedy pass over its own candidates
// only, many blocks at once where one block per image left most of the GPU idle. A block
// stops once it has kept max_detections: its later candidates come after that many kept
// ones. Survivors are flagged at their sorted position; a second kernel then takes each
// image's first max_detections flagged candidates, in order, and writes the outputs.
//
// Within a block, candidates come 512 at a time and are resolved 64 at a time (one 64-bit
// mask word):
//  1. in parallel, each candidate is tested against the detections the block kept so far
//     (eight threads per candidate, each scanning every eighth one), and a 64x64 IoU
//     bitmask of the group is built (upper triangle, same label only);
//  2. one warp resolves the group greedily. Only candidates whose row suppresses someone
//     need a serial step; every other survivor is simply kept. The serial work is therefore
//     the number of overlapping same-class pairs, not the number of detections.
// No mask over all candidate pairs is ever built.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "../message.h"
#include "common.cuh"

namespace bladesmith {
namespace gpu {

constexpr int kNmsThreads = 512;
constexpr int kNmsWarps = kNmsThreads / 32;
constexpr int kNmsGroup = 64;  // one 64-bit mask word
constexpr int kNmsParts = kNmsThreads / kNmsGroup;
constexpr int kRowBits = kNmsGroup / kNmsParts;  // the bits of a group's row one part tests
constexpr int kKeptCache = 512;   // kept detections of a block in shared memory
constexpr int kScanUnroll = 4;    // kept detections one thread tests per step of its scan
constexpr int kMaxBuckets = 64;

// A kept detection past kKeptCache.
struct alignas(16) KeptNode {
  float4 box;
  int64_t label;
  float area;
};

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
        counts(at::empty({batch}, options.dtype(at::kLong))) {
    BLADESMITH_CHECK_VALUE(max_detections < (int64_t{1} << 31), "max_detections: the CUDA kernels "
                           "keep fewer than 2^31 detections per image, got ", max_detections);
  }

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
  for (int p = 0; p < kNmsParts; ++p) row |= static_cast<uint64_t>(parts[p]) << (kRowBits * p);
  return row;
}

// The first n set bits of mask (n < popcount(mask)).
__device__ __forceinline__ uint64_t first_bits(uint64_t mask, int64_t n) {
  while (__popcll(mask) > n) mask &= ~(1ull << (63 - __clzll(static_cast<long long>(mask))));
  return mask;
}

// Where this thread's flag goes among the block's flagged threads, counted from base, and
// how many threads flagged (the same in every thread). Uses warp_total; a barrier inside.
__device__ __forceinline__ int block_rank(bool flag, int base, int (&warp_total)[kNmsWarps],
                                          int& total) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const unsigned ballot = __ballot_sync(0xFFFFFFFFu, flag);
  if (lane == 0) warp_total[warp] = __popc(ballot);
  __syncthreads();
  int rank = base + __popc(ballot & ((1u << lane) - 1));
  total = 0;
#pragma unroll
  for (int w = 0; w < kNmsWarps; ++w) {
    rank += w < warp ? warp_total[w] : 0;
    total += warp_total[w];
  }
  return rank;
}

// Source::label_of(b, key) gives a candidate's label, Source::fetch(b, key, box, score,
// label) its box and score as values of T too. Block (b, bucket) flags, in keep[b], the
// sorted positions of the survivors among the labels of its bucket.
template <typename T, typename Source>
__global__ void __launch_bounds__(kNmsThreads)
    bucket_nms_kernel(Source src, const uint64_t* __restrict__ sorted, int64_t num_slots,
                      float iou_threshold, int64_t max_keep, uint8_t* __restrict__ keep,
                      KeptNode* __restrict__ spill) {
  __shared__ float4 kept_box[kKeptCache];
  __shared__ int64_t kept_label[kKeptCache];
  __shared__ float kept_area[kKeptCache];
  __shared__ float4 cand_box[kNmsThreads];
  __shared__ float cand_area[kNmsThreads];
  __shared__ int64_t cand_label[kNmsThreads];
  // Sorted positions of the bucket's candidates not yet resolved, in order: a scan adds
  // at most kNmsThreads to fewer than kNmsThreads.
  __shared__ int32_t member[2 * kNmsThreads];
  __shared__ int warp_total[kNmsWarps];
  __shared__ uint32_t dead_bits[kNmsParts][kNmsGroup / 32];
  __shared__ uint16_t row_bits[kNmsGroup][kNmsParts];
  __shared__ int64_t s_kept;

  const int64_t b = blockIdx.x;
  const uint32_t bucket = blockIdx.y, buckets = gridDim.y;
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const uint64_t* keys = sorted + b * num_slots;
  uint8_t* flags = keep + b * num_slots;
  KeptNode* spilled =
      spill + (b * buckets + bucket) * max(max_keep - kKeptCache, int64_t{0});

  int64_t kept = 0, cursor = 0;
  int count = 0;
  bool more = true;
  while (kept < max_keep) {
    // Gather the bucket's next candidates. Valid keys come first: a zero ends the list.
    while (more && count < kNmsThreads) {
      const int64_t i = cursor + tid;
      const uint64_t key = i < num_slots ? keys[i] : 0;
      const bool mine =
          key != 0 && static_cast<uint64_t>(src.label_of(b, key)) % buckets == bucket;
      int added;
      const int at = block_rank(mine, count, warp_total, added);
      if (mine) member[at] = static_cast<int32_t>(i);
      more = !__syncthreads_or(key == 0);  // also: warp_total is free again
      count += added;
      cursor += kNmsThreads;
    }
    const int valid = min(count, kNmsThreads);
    if (valid == 0) break;
    if (tid < valid) {
      float4 box;
      float score;
      int64_t label;
      src.fetch(b, keys[member[tid]], box, score, label);
      cand_box[tid] = box;
      cand_area[tid] = box_area(box);
      cand_label[tid] = label;
    }
    __syncthreads();

    for (int g = 0; g * kNmsGroup < valid && kept < max_keep; ++g) {
      const int c = tid % kNmsGroup, part = tid / kNmsGroup, me = g * kNmsGroup + c;
      bool dead = me >= valid;
      uint32_t row = 0;
      if (!dead) {
        const float4 mb = cand_box[me];
        const float ma = cand_area[me];
        const int64_t ml = cand_label[me];
        // Suppressed by a detection kept before this group? Part p tests p, p + kNmsParts, ...
        const int cached = static_cast<int>(min(kept, int64_t{kKeptCache}));
        for (int pos = part; pos < cached && !dead; pos += kNmsParts * kScanUnroll) {
#pragma unroll
          for (int u = 0; u < kScanUnroll; ++u) {
            const int k = pos + u * kNmsParts;
            dead = dead || (k < cached && kept_label[k] == ml &&
                            iou_above(kept_box[k], kept_area[k], mb, ma, iou_threshold));
          }
        }
        // From global memory: kScanUnroll loads issued before any is tested, so their
        // latencies overlap (the RPN's NMS keeps up to 1,000 boxes per level).
        for (int64_t pos = kKeptCache + part; pos < kept && !dead;
             pos += kNmsParts * kScanUnroll) {
          KeptNode node[kScanUnroll];
#pragma unroll
          for (int u = 0; u < kScanUnroll; ++u) {
            const int64_t k = pos + u * kNmsParts;
            if (k < kept) node[u] = spilled[k - kKeptCache];
          }
#pragma unroll
          for (int u = 0; u < kScanUnroll; ++u) {
            dead = dead || (pos + u * kNmsParts < kept && node[u].label == ml &&
                            iou_above(node[u].box, node[u].area, mb, ma, iou_threshold));
          }
        }
#pragma unroll 4
        for (int q = 0; q < kRowBits; ++q) {
          const int j = part * kRowBits + q;
          const int other = g * kNmsGroup + j;
          if (j > c && other < valid && cand_label[other] == ml &&
              iou_above(mb, ma, cand_box[other], cand_area[other], iou_threshold)) {
            row |= 1u << q;
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
        const uint64_t suppressing = __ballot_sync(0xFFFFFFFFu, row_lo != 0) |
                                     static_cast<uint64_t>(__ballot_sync(0xFFFFFFFFu, row_hi != 0))
                                         << 32;
        // The serial part, uniform across the warp: one step per surviving candidate that
        // suppresses another of the group, in order.
        uint64_t remaining = ~removed;
        uint64_t next = suppressing & remaining;
        while (next != 0) {
          const int first = __ffsll(static_cast<long long>(next)) - 1;
          remaining &= ~__shfl_sync(0xFFFFFFFFu, first < 32 ? row_lo : row_hi, first % 32);
          next = first == 63 ? 0 : suppressing & remaining & (~0ull << (first + 1));
        }
        // The block stops at max_keep: the first `room` survivors.
        const int64_t room = max_keep - kept;
        const uint64_t kept_now =
            __popcll(remaining) > room ? first_bits(remaining, room) : remaining;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c2 = lane + 32 * h;
          if (!(kept_now >> c2 & 1u)) continue;
          const int64_t pos = kept + __popcll(kept_now & ((1ull << c2) - 1));
          const int slot = g * kNmsGroup + c2;
          flags[member[slot]] = 1;
          if (pos < kKeptCache) {
            kept_box[pos] = cand_box[slot];
            kept_label[pos] = cand_label[slot];
            kept_area[pos] = cand_area[slot];
          } else {
            spilled[pos - kKeptCache] = KeptNode{cand_box[slot], cand_label[slot], cand_area[slot]};
          }
        }
        if (lane == 0) s_kept = kept + __popcll(kept_now);
      }
      __syncthreads();
      kept = s_kept;
    }
    // The unresolved rest moves to the front.
    const int rest = count - valid;
    const int32_t moved = tid < rest ? member[valid + tid] : 0;
    __syncthreads();
    if (tid < rest) member[tid] = moved;
    count = rest;
    __syncthreads();
  }
}

// Per image: the first max_detections flagged candidates, in sorted order, decoded into
// the outputs; the rest padded (score 0, label -1).
template <typename T, typename Source>
__global__ void __launch_bounds__(kNmsThreads)
    gather_kept_kernel(Source src, const uint64_t* __restrict__ sorted, int64_t num_slots,
                       const uint8_t* __restrict__ keep, NmsOutput<T> out) {
  __shared__ int warp_total[kNmsWarps];
  const int64_t b = blockIdx.x, D = out.max_detections;
  const int tid = threadIdx.x;
  T* boxes = out.boxes + b * D * 4;
  T* scores = out.scores + b * D;
  int64_t* labels = out.labels + b * D;
  int64_t taken = 0;
  for (int64_t start = 0; start < num_slots && taken < D; start += kNmsThreads) {
    const int64_t i = start + tid;
    const bool flagged = i < num_slots && keep[b * num_slots + i] != 0;
    int added;
    const int64_t pos = taken + block_rank(flagged, 0, warp_total, added);
    if (flagged && pos < D) {
      float4 box;
      float score;
      int64_t label;
      src.fetch(b, sorted[b * num_slots + i], box, score, label);
      write_detection(boxes, scores, labels, pos, box, score, label);
    }
    taken += added;
    __syncthreads();  // warp_total is read before the next round writes it
  }
  taken = min(taken, D);
  for (int64_t pos = taken + tid; pos < D; pos += kNmsThreads) {
    write_detection(boxes, scores, labels, pos, make_float4(0.f, 0.f, 0.f, 0.f), 0.f, -1);
  }
  if (tid == 0) out.counts[b] = taken;
}

// Label buckets per image: as many blocks as run at once, at most one bucket per label
// when the labels are known to be 0 .. num_labels - 1 (num_labels > 0).
template <typename Kernel>
int nms_buckets(Kernel kernel, int64_t batch, int64_t num_labels) {
  int64_t buckets =
      std::clamp<int64_t>(resident_blocks(kernel, kNmsThreads) / batch, 1, kMaxBuckets);
  if (num_labels > 0) buckets = std::min(buckets, num_labels);
  return static_cast<int>(buckets);
}

// sorted: [B, num_slots] candidate keys, descending per image. num_labels: labels lie in
// 0 .. num_labels - 1, or 0 when unknown.
template <typename T, typename Source>
void launch_nms(const Source& src, const at::Tensor& sorted, int64_t num_slots,
                double iou_threshold, int64_t num_labels, NmsTensors<T>& result) {
  const int64_t batch = result.counts.size(0), D = result.labels.size(1);
  if (batch == 0) return;
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const auto* keys = reinterpret_cast<const uint64_t*>(sorted.const_data_ptr<int64_t>());
  auto keep = at::zeros({batch, num_slots}, sorted.options().dtype(at::kByte));
  if (num_slots > 0 && D > 0) {
    auto kernel = bucket_nms_kernel<T, Source>;
    const int buckets = nms_buckets(kernel, batch, num_labels);
    auto spill = at::empty({batch * buckets * std::max<int64_t>(D - kKeptCache, 0) *
                            static_cast<int64_t>(sizeof(KeptNode))},
                           sorted.options().dtype(at::kByte));
    kernel<<<dim3(batch, buckets), kNmsThreads, 0, stream>>>(
        src, keys, num_slots, float_threshold(iou_threshold), D, keep.data_ptr<uint8_t>(),
        reinterpret_cast<KeptNode*>(spill.data_ptr()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  gather_kept_kernel<T, Source><<<batch, kNmsThreads, 0, stream>>>(
      src, keys, num_slots, keep.const_data_ptr<uint8_t>(), result.view());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace gpu
}  // namespace bladesmith
