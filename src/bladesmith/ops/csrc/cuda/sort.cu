// Segmented descending sort of candidate keys. Segments of up to 1024 keys sort in one block,
// in shared memory, in one launch. Segments of up to 8192 keys (an image's candidates under
// the default RetinaNet settings) sort as tiles of 1024 keys, one block each, which a second
// kernel merges: every key finds its rank by binary search in the other tiles, so that
// nothing runs in one block alone. Larger segments, one per image, go through CUB's
// device-wide radix sort (its segmented sort gives each segment one block: 0.86 ms for one
// image's 90,000 keys on an H200); larger segments of several per image through the
// segmented one. None of them synchronises with the host.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cub/block/block_merge_sort.cuh>
#include <cub/device/device_radix_sort.cuh>
#include <cub/device/device_segmented_radix_sort.cuh>

#include "../message.h"
#include "sort.cuh"

namespace bladesmith {
namespace gpu {
namespace {

struct Greater {
  __device__ __forceinline__ bool operator()(uint64_t a, uint64_t b) const { return a > b; }
};

constexpr int kTileThreads = 256, kTileItems = 4, kTile = kTileThreads * kTileItems;
constexpr int kMergeThreads = 1024, kMaxMerged = 8192;

using TileSort = cub::BlockMergeSort<uint64_t, kTileThreads, kTileItems>;

// Block (segment, tile) sorts the tile's keys in place; tiles past a segment's end exit.
__global__ void __launch_bounds__(kTileThreads)
    tile_sort_kernel(Segments s, int tiles_per_part, uint64_t* keys) {
  __shared__ TileSort::TempStorage storage;
  const int64_t group = blockIdx.x / (s.parts * tiles_per_part);
  const int part = blockIdx.x / tiles_per_part % s.parts;
  const int tile = blockIdx.x % tiles_per_part;
  const int n = static_cast<int>(min(s.size[part] - int64_t{tile} * kTile, int64_t{kTile}));
  if (n <= 0) return;
  uint64_t* segment = keys + group * s.group_stride + s.begin[part] + int64_t{tile} * kTile;
  uint64_t items[kTileItems];
#pragma unroll
  for (int j = 0; j < kTileItems; ++j) {
    const int i = j * kTileThreads + threadIdx.x;  // any arrangement will do as input
    items[j] = i < n ? segment[i] : 0;             // padding sorts last
  }
  TileSort(storage).Sort(items, Greater());
#pragma unroll
  for (int j = 0; j < kTileItems; ++j) {
    const int i = threadIdx.x * kTileItems + j;  // sorted blocked across threads
    if (i < n) segment[i] = items[j];
  }
}

// Sorts every segment in tiles of kTile keys, each in place.
void sort_tiles(const Segments& s, int tiles_per_part, uint64_t* keys) {
  tile_sort_kernel<<<s.groups * s.parts * tiles_per_part, kTileThreads, 0,
                     c10::cuda::getCurrentCUDAStream()>>>(s, tiles_per_part, keys);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// How many of the n keys of a descending run are greater than key.
__device__ __forceinline__ int count_greater(const uint64_t* run, int n, uint64_t key) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (run[mid] > key) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

// Block (segment, share) loads the segment's sorted tiles into shared memory; each of its
// threads places one key at its rank: its position in its tile plus the keys of the other
// tiles greater than it (non-zero keys are distinct). Empty keys (zero) fill the end.
__global__ void __launch_bounds__(kMergeThreads)
    merge_tiles_kernel(Segments s, int shares_per_part, const uint64_t* in, uint64_t* out) {
  extern __shared__ __align__(16) unsigned char smem[];
  auto* tiles = reinterpret_cast<uint64_t*>(smem);
  __shared__ int s_nonzero;
  const int64_t group = blockIdx.x / (s.parts * shares_per_part);
  const int part = blockIdx.x / shares_per_part % s.parts;
  const int share = blockIdx.x % shares_per_part;
  const int n = static_cast<int>(s.size[part]);
  const int64_t begin = group * s.group_stride + s.begin[part];
  if (share * kMergeThreads >= n) return;
  for (int i = threadIdx.x; i < n; i += kMergeThreads) tiles[i] = in[begin + i];
  if (threadIdx.x == 0) s_nonzero = 0;
  __syncthreads();
  const int num_tiles = (n + kTile - 1) / kTile;
  if (threadIdx.x < num_tiles) {
    const int t = threadIdx.x;
    atomicAdd(&s_nonzero, count_greater(tiles + t * kTile, min(kTile, n - t * kTile), 0));
  }
  __syncthreads();
  const int p = share * kMergeThreads + threadIdx.x;
  if (p >= n) return;
  const uint64_t key = tiles[p];
  if (key != 0) {
    const int mine = p / kTile;
    int rank = p - mine * kTile;
    for (int t = 0; t < num_tiles; ++t) {
      if (t != mine) rank += count_greater(tiles + t * kTile, min(kTile, n - t * kTile), key);
    }
    out[begin + rank] = key;
  }
  if (p >= s_nonzero) out[begin + p] = 0;
}

at::Tensor merge_sort(const at::Tensor& keys, const Segments& s, int64_t largest) {
  auto* data = reinterpret_cast<uint64_t*>(keys.data_ptr<int64_t>());
  const int tiles = static_cast<int>(ceil_div(largest, kTile));
  sort_tiles(s, tiles, data);
  auto merged = at::empty_like(keys);
  const int shares = static_cast<int>(ceil_div(largest, kMergeThreads));
  const int smem = static_cast<int>(largest * sizeof(uint64_t));
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(merge_tiles_kernel,
                                        cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  merge_tiles_kernel<<<s.groups * s.parts * shares, kMergeThreads, smem,
                       c10::cuda::getCurrentCUDAStream()>>>(
      s, shares, data, reinterpret_cast<uint64_t*>(merged.data_ptr<int64_t>()));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return merged;
}

__global__ void segment_offsets_kernel(Segments s, int* begins, int* ends) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i >= s.groups * s.parts) return;
  const int64_t begin = (i / s.parts) * s.group_stride + s.begin[i % s.parts];
  begins[i] = static_cast<int>(begin);
  ends[i] = static_cast<int>(begin + s.size[i % s.parts]);
}

// The radix sorts take fewer than 2^31 keys in all (sort_descending checks).
at::Tensor radix_sort(const at::Tensor& keys, const Segments& s) {
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

__global__ void image_of_kernel(int n, int64_t slots, int* image) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) image[i] = static_cast<int>(i / slots);
}

// Whole images as segments: every key sorted at once, descending, carrying its image; then a
// stable sort on the image alone, ascending, keeps each image's keys in that order.
at::Tensor image_radix_sort(const at::Tensor& keys, const Segments& s) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  const int n = static_cast<int>(keys.numel());
  const auto* in = reinterpret_cast<const uint64_t*>(keys.const_data_ptr<int64_t>());
  auto sorted = at::empty_like(keys);
  auto* out = reinterpret_cast<uint64_t*>(sorted.data_ptr<int64_t>());
  const auto bytes = keys.options().dtype(at::kByte);
  size_t temp_bytes = 0;
  if (s.groups == 1) {
    C10_CUDA_CHECK(
        cub::DeviceRadixSort::SortKeysDescending(nullptr, temp_bytes, in, out, n, 0, 64, stream));
    auto temp = at::empty({static_cast<int64_t>(temp_bytes)}, bytes);
    C10_CUDA_CHECK(cub::DeviceRadixSort::SortKeysDescending(temp.data_ptr(), temp_bytes, in, out,
                                                            n, 0, 64, stream));
    return sorted;
  }
  auto images = at::empty({2, n}, keys.options().dtype(at::kInt));
  int* image = images.data_ptr<int>();
  int* image_sorted = image + n;
  image_of_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(n, s.group_stride, image);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  auto by_key = at::empty_like(keys);
  auto* middle = reinterpret_cast<uint64_t*>(by_key.data_ptr<int64_t>());
  const int image_bits = 32 - __builtin_clz(static_cast<unsigned>(s.groups - 1));
  size_t by_image_bytes = 0;
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(nullptr, temp_bytes, in, middle, image,
                                                           image_sorted, n, 0, 64, stream));
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, by_image_bytes, image_sorted, image,
                                                 middle, out, n, 0, image_bits, stream));
  temp_bytes = std::max(temp_bytes, by_image_bytes);
  auto temp = at::empty({static_cast<int64_t>(temp_bytes)}, bytes);
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairsDescending(
      temp.data_ptr(), temp_bytes, in, middle, image, image_sorted, n, 0, 64, stream));
  C10_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(temp.data_ptr(), temp_bytes, image_sorted,
                                                 image, middle, out, n, 0, image_bits, stream));
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
  BLADESMITH_CHECK_VALUE(slot_offsets.size() <= kMaxLevels + 1, "level_sizes: the CUDA kernels ",
                         "take at most ", kMaxLevels, " levels, got ", slot_offsets.size() - 1);
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
  if (largest <= kTile) {
    sort_tiles(segments, 1, reinterpret_cast<uint64_t*>(keys.data_ptr<int64_t>()));
    return keys;
  }
  if (largest <= kMaxMerged) return merge_sort(keys, segments, largest);
  BLADESMITH_CHECK_VALUE(keys.numel() < (int64_t{1} << 31), "the CUDA kernels sort fewer than ",
                         "2^31 candidates in all, got ", keys.numel());
  const bool whole_images = segments.parts == 1 && segments.begin[0] == 0 &&
                            segments.size[0] == segments.group_stride;
  return whole_images ? image_radix_sort(keys, segments) : radix_sort(keys, segments);
}

}  // namespace gpu
}  // namespace bladesmith
