// Device helpers shared by the CUDA kernels of torch.ops.bladesmith: dtype conversion, the
// candidate key, and the float arithmetic of the CPU kernels (cpu/*.cpp are the reference).
// Arithmetic that must round like the reference uses __f*_rn intrinsics, which the compiler
// never contracts into fused multiply-adds.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#include "../roi_align_math.h"  // kMaxLevels

namespace bladesmith {
namespace gpu {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// How many blocks of `threads` threads of `kernel` the GPU runs at once (at least one per
// multiprocessor): grids of that size keep every multiprocessor busy in one wave.
template <typename Kernel>
int64_t resident_blocks(Kernel kernel, int threads) {
  int per_sm = 0, sms = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, c10::cuda::current_device()));
  return static_cast<int64_t>(std::max(per_sm, 1)) * sms;
}

template <typename T>
__device__ __forceinline__ float to_float(T v) {
  return static_cast<float>(v);
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  return static_cast<T>(v);
}

// A value as the dtype would hold it: the decode rounds its float results to the input dtype,
// and NMS must see exactly those values.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return to_float(from_float<T>(v));
}

// torch.sigmoid's CUDA formula: IEEE division and the full-precision expf.
__device__ __forceinline__ float sigmoid(float x) {
  return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x)));
}

// std::min / std::max as the CPU kernels call them: the first argument survives a NaN
// comparison, exactly as there.
__device__ __forceinline__ float std_min(float a, float b) { return (b < a) ? b : a; }
__device__ __forceinline__ float std_max(float a, float b) { return (a < b) ? b : a; }

// BoxCoder.decode_single then clip_boxes_to_image, operation by operation (as in
// cpu/decode_kernel.cpp).
struct BoxCoder {
  float wx, wy, ww, wh, clip;

  __device__ __forceinline__ float4 decode(float4 a, float4 d, float height, float width) const {
    const float widths = __fsub_rn(a.z, a.x);
    const float heights = __fsub_rn(a.w, a.y);
    const float ctr_x = __fadd_rn(a.x, __fmul_rn(0.5f, widths));
    const float ctr_y = __fadd_rn(a.y, __fmul_rn(0.5f, heights));
    const float dx = __fdiv_rn(d.x, wx);
    const float dy = __fdiv_rn(d.y, wy);
    const float dw = std_min(__fdiv_rn(d.z, ww), clip);  // keeps NaN, as torch.clamp
    const float dh = std_min(__fdiv_rn(d.w, wh), clip);
    const float pred_ctr_x = __fadd_rn(__fmul_rn(dx, widths), ctr_x);
    const float pred_ctr_y = __fadd_rn(__fmul_rn(dy, heights), ctr_y);
    const float half_w = __fmul_rn(0.5f, __fmul_rn(expf(dw), widths));
    const float half_h = __fmul_rn(0.5f, __fmul_rn(expf(dh), heights));
    return make_float4(clamp(__fsub_rn(pred_ctr_x, half_w), width),
                       clamp(__fsub_rn(pred_ctr_y, half_h), height),
                       clamp(__fadd_rn(pred_ctr_x, half_w), width),
                       clamp(__fadd_rn(pred_ctr_y, half_h), height));
  }

  __device__ __forceinline__ static float clamp(float x, float high) {
    return std_min(std_max(x, 0.0f), high);
  }
};

// Detection i of the outputs (boxes [.., 4], scores, labels) in the output dtype.
template <typename T>
__device__ __forceinline__ void write_detection(T* boxes, T* scores, int64_t* labels, int64_t i,
                                                float4 box, float score, int64_t label) {
  boxes[i * 4 + 0] = from_float<T>(box.x);
  boxes[i * 4 + 1] = from_float<T>(box.y);
  boxes[i * 4 + 2] = from_float<T>(box.z);
  boxes[i * 4 + 3] = from_float<T>(box.w);
  scores[i] = from_float<T>(score);
  labels[i] = label;
}

__device__ __forceinline__ float box_area(float4 b) {
  return __fmul_rn(__fsub_rn(b.z, b.x), __fsub_rn(b.w, b.y));
}

// iou(a, b) > t in torchvision's nms_kernel arithmetic: intersection over (area_a + area_b -
// intersection), rounded, against t. The division (a long dependent chain) is done only when
// the quotient may lie near t: otherwise comparing the intersection with t * union, widened
// by 2^-20 either way, decides, as it covers the roundings of the quotient and of both
// products (2^-24 each). The bounds on t and on the union keep those products normal.
__device__ __forceinline__ bool iou_above(float4 a, float area_a, float4 b, float area_b,
                                          float t) {
  const float w = std_max(0.0f, __fsub_rn(std_min(a.z, b.z), std_max(a.x, b.x)));
  const float h = std_max(0.0f, __fsub_rn(std_min(a.w, b.w), std_max(a.y, b.y)));
  const float inter = __fmul_rn(w, h);
  const float uni = __fsub_rn(__fadd_rn(area_a, area_b), inter);
  if (t >= 0x1p-40f && t <= 1.0f && uni >= 0x1p-80f && uni <= 0x1.fffffep127f) {
    const float bound = __fmul_rn(t, uni);
    if (inter > __fmul_rn(bound, 1.0f + 0x1p-20f)) return true;
    if (inter < __fmul_rn(bound, 1.0f - 0x1p-20f)) return false;
  }
  return __fdiv_rn(inter, uni) > t;
}

// Candidates travel between kernels as one 64-bit key: a 32-bit score key above the complement
// of a 32-bit index, so that sorting the keys in descending order gives the reference's order
// (higher score first, ties by lower index). Zero marks an empty slot and sorts last.
__device__ __forceinline__ uint64_t make_candidate(uint32_t score_key, uint32_t index) {
  return (static_cast<uint64_t>(score_key) << 32) | (0xFFFFFFFFu - index);
}

__device__ __forceinline__ uint32_t candidate_index(uint64_t candidate) {
  return 0xFFFFFFFFu - static_cast<uint32_t>(candidate);
}

// Decoded scores lie in [0, 1], so their float bits order them; +1 keeps zero free.
__device__ __forceinline__ uint32_t decoded_score_key(float score) {
  return __float_as_uint(score) + 1u;
}

__device__ __forceinline__ float decoded_score(uint64_t candidate) {
  return __uint_as_float(static_cast<uint32_t>(candidate >> 32) - 1u);
}

// Any score but NaN: flips the float bits into an unsigned order (never zero for a number);
// -0 becomes +0, as the two compare equal.
__device__ __forceinline__ uint32_t ordered_score_key(float score) {
  const uint32_t bits = __float_as_uint(__fadd_rn(score, 0.0f));
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

}  // namespace gpu
}  // namespace bladesmith
