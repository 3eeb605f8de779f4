// bladesmith::multilevel_roi_align on CUDA: one thread per box, bin and vector of channels
// (roi_align_math.h's arithmetic). The threads of a bin read its samples' neighbours as
// contiguous channel vectors of the channels-last table (16-byte loads where the channels
// allow), so a warp reads whole rows; the fused element-wise form of the same pooling
// took most of Faster R-CNN MobileNetV3's RoI pooling time on an H200. No host copies or
// synchronisation: one CUDA graph holds it.
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>

#include "../checks.h"
#include "common.cuh"

namespace bladesmith {
namespace gpu {
namespace {

template <typename T, int V>
struct alignas(sizeof(T) * V) Vector {
  T v[V];
};

template <typename T, int V>
__global__ void multilevel_roi_align_kernel(const T* __restrict__ table,
                                            const float* __restrict__ rois,
                                            const int64_t* __restrict__ level_of,
                                            roi::Levels levels, int64_t total, int64_t channels,
                                            int64_t pooled_h, int64_t pooled_w, int64_t grid,
                                            T* __restrict__ out) {
  const int64_t vectors = channels / V;
  const float samples = static_cast<float>(grid * grid);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += stride) {
    const int64_t c = (i % vectors) * V, bin = i / vectors;
    const int64_t pw = bin % pooled_w, ph = bin / pooled_w % pooled_h;
    const int64_t n = bin / (pooled_w * pooled_h);
    const roi::Box box = roi::box_on(levels, rois + n * 5, level_of[n], pooled_h, pooled_w);
    float sum[V];
#pragma unroll
    for (int v = 0; v < V; ++v) sum[v] = 0.f;
    roi::for_each_sample(box, ph, pw, grid, [&](const roi::Bilinear& s) {
      const T* base = table + box.first_row * channels + c;
      const auto a = *reinterpret_cast<const Vector<T, V>*>(base + s.p1 * channels);
      const auto b = *reinterpret_cast<const Vector<T, V>*>(base + s.p2 * channels);
      const auto d = *reinterpret_cast<const Vector<T, V>*>(base + s.p3 * channels);
      const auto e = *reinterpret_cast<const Vector<T, V>*>(base + s.p4 * channels);
#pragma unroll
      for (int v = 0; v < V; ++v) {
        sum[v] = roi::add(sum[v], roi::mix(s, to_float(a.v[v]), to_float(b.v[v]),
                                           to_float(d.v[v]), to_float(e.v[v])));
      }
    });
    Vector<T, V> result;
#pragma unroll
    for (int v = 0; v < V; ++v) result.v[v] = from_float<T>(roi::div(sum[v], samples));
    *reinterpret_cast<Vector<T, V>*>(out + bin * channels + c) = result;
  }
}

template <typename T, int V>
void launch(MultilevelRoiAlign& call, int64_t pooled_h, int64_t pooled_w, int64_t grid) {
  constexpr int threads = 256;
  const int64_t total = call.output.numel() / V;
  auto kernel = multilevel_roi_align_kernel<T, V>;
  const int64_t blocks = std::min(ceil_div(total, threads), resident_blocks(kernel, threads) * 8);
  kernel<<<blocks, threads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      call.table.const_data_ptr<T>(), call.rois.const_data_ptr<float>(),
      call.level_of.const_data_ptr<int64_t>(), call.levels, total, call.table.size(1), pooled_h,
      pooled_w, grid, call.output.mutable_data_ptr<T>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor multilevel_roi_align_cuda(const at::Tensor& table, const at::Tensor& rois,
                                     const at::Tensor& level_of, at::IntArrayRef heights,
                                     at::IntArrayRef widths, at::ArrayRef<double> scales,
                                     int64_t pooled_height, int64_t pooled_width,
                                     int64_t sampling_ratio) {
  auto call = multilevel_roi_align_call(table, rois, level_of, heights, widths, scales,
                                        pooled_height, pooled_width, sampling_ratio);
  const c10::cuda::CUDAGuard guard(table.device());
  if (call.output.numel() == 0) return call.output;
  BLADESMITH_DISPATCH_FLOAT(table.scalar_type(), "multilevel_roi_align_cuda", [&] {
    // 16-byte loads where every row starts on a 16-byte boundary.
    constexpr int wide = 16 / sizeof(scalar_t);
    const bool aligned = table.size(1) % wide == 0 &&
                         reinterpret_cast<uintptr_t>(call.table.const_data_ptr()) % 16 == 0;
    if (aligned) {
      launch<scalar_t, wide>(call, pooled_height, pooled_width, sampling_ratio);
    } else {
      launch<scalar_t, 1>(call, pooled_height, pooled_width, sampling_ratio);
    }
  });
  return call.output;
}

}  // namespace
}  // namespace gpu

TORCH_LIBRARY_IMPL(bladesmith, CUDA, m) {
  m.impl("multilevel_roi_align", &gpu::multilevel_roi_align_cuda);
}

}  // namespace bladesmith
