// Segmented descending sort of candidate keys. Segments of up to 8192 keys (every segment the
// default RetinaNet settings make) sort in one block, in shared memory, in one launch;
// larger ones go through CUB's segmented radix sort. Neither synchronises with the host.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cub/block/block_merge_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "sort.cuh"

namespace bladesmith {
namespace gpu {
namespace {

struct Greater {
  __device__ __forceinline__ bool operator()(uint64_t a, uint64_t b) const { return a > b; }
};

template <int THREADS, int ITEMS>
using BlockSort = cub::BlockMergeSort<uint64_t, THREADS, ITEMS>;

template <int THREADS, int ITEMS>
__global__ void __launch_bounds__(THREADS) block_sort_kernel(Segments s, uint64_t* keys) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto& storage = *reinterpret_cast<typename BlockSort<THREADS, ITEMS>::TempStorage*>(smem);
  const int64_t group = blockIdx.x / s.parts;
  const int part = blockIdx.x % s.parts;
  uint64_t* segment = keys + group * s.group_stride + s.begin[part];
  const int n = static_cast<int>(s.size[part]);
  uint64_t items[ITEMS];
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = j * THREADS + threadIdx.x;  // any arrangement will do as input
    items[j] = i < n ? segment[i] : 0;       // padding sorts last
  }
  BlockSort<THREADS, ITEMS>(storage).Sort(items, Greater());
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x * ITEMS + j;  // sorted blocked across threads
    if (i < n) segment[i] = items[j];
  }
}

template <int THREADS, int ITEMS>
void block_sort(const Segments& s, uint64_t* keys) {
  auto kernel = block_sort_kernel<THREADS, ITEMS>;
  constexpr int smem = sizeof(typename BlockSort<THREADS, ITEMS>::TempStorage);
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  kernel<<<s.groups * s.parts, THREADS, smem, c10::cuda::getCurrentCUDAStream()>>>(s, keys);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

__global__ void segment_offsets_kernel(Segments s, int* begins, int* ends) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= s.groups * s.parts) return;
  const int64_t begin = (i / s.parts) * s.group_stride + s.begin[i % s.parts];
  begins[i] = static_cast<int>(begin);
  ends[i] = static_cast<int>(begin + s.size[i % s.parts]);
}

at::Tensor radix_sort(const at::Tensor& keys, const Segments& s) {
  TORCH_CHECK_VALUE(keys.numel() < (int64_t{1} << 31), "the CUDA kernels sort fewer than 2^31 ",
                    "candidates in all, got ", keys.numel());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int num_segments = static_cast<int>(s.groups * s.parts);
  auto offsets = at::empty({2, num_segments}, keys.options().dtype(at::kInt));
  int* begins = offsets.data_ptr<int>();
  int* ends = begins + num_segments;
  segment_offsets_kernel<<<ceil_div(num_segments, 256), 256, 0, stream>>>(s, begins, ends);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  auto sorted = at::empty_like(keys);
  const auto* in = reinterpret_cast<const uint64_t*>(keys.const_data_ptr<int64_t>());
  auto* out = reinterpret_cast<uint64_t*>(sorted.data_ptr<int64_t>());
  const int n = static_cast<int>(keys.numel());
  size_t temp_bytes = 0;
  C10_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortKeysDescending(
      nullptr, temp_bytes, in, out, n, num_segments, begins, ends, 0, 64, stream));
  auto temp = at::empty({static_cast<int64_t>(temp_bytes)}, keys.options().dtype(at::kByte));
  C10_CUDA_CHECK(cub::DeviceSegmentedRadixSort::SortKeysDescending(
      temp.data_ptr(), temp_bytes, in, out, n, num_segments, begins, ends, 0, 64, stream));
  return sorted;
}

}  // namespace

Segments per_image(int64_t groups, int64_t slots) {
  Segments s;
  s.groups = groups;
  s.group_stride = slots;
  s.parts = 1;
  s.size[0] = slots;
  return s;
}

Segments per_level(int64_t groups, const std::vector<int64_t>& slot_offsets) {
  Segments s;
  s.groups = groups;
  s.group_stride = slot_offsets.back();
  s.parts = static_cast<int>(slot_offsets.size()) - 1;
  for (int l = 0; l < s.parts; ++l) {
    s.begin[l] = slot_offsets[l];
    s.size[l] = slot_offsets[l + 1] - slot_offsets[l];
  }
  return s;
}

at::Tensor sort_descending(const at::Tensor& keys, const Segments& segments) {
  if (segments.groups == 0 || segments.parts == 0) return keys;
  const int64_t largest = *std::max_element(segments.size, segments.size + segments.parts);
  auto* data = reinterpret_cast<uint64_t*>(keys.data_ptr<int64_t>());
  if (largest <= 1024) {
    block_sort<256, 4>(segments, data);
  } else if (largest <= 8192) {
    block_sort<1024, 8>(segments, data);
  } else {
    return radix_sort(keys, segments);
  }
  return keys;
}

}  // namespace gpu
}  // namespace bladesmith
