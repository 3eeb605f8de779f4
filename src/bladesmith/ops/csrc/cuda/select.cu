// Top-k candidate selection for retinanet_decode: a radix select per (image, level) segment.
//
// Each logit that passes the threshold gets a ranking key, unique within its level:
//   (score bits - lowest passing score bits) << index_bits | (level size - 1 - index)
// so that a larger key is a better candidate in the reference's order (score, then lower
// index). The k-th largest key is found 12 bits at a time: a histogram pass over the logits
// (sigmoid and threshold fused in), whose last block per segment finds the bin that holds
// the k-th key. Usually that bin holds few keys (at most kBoundaryCap) and one pass is enough:
// the compaction pass then writes every key above the bin straight to the output and the
// bin's keys to a small buffer, which the segment's last block ranks exactly. Otherwise the
// next histogram pass refines within the bin; passes with nothing to refine exit at once.
// Everything stays on the device: no host synchronisation, fixed launches, graph-capturable.
#include <ATen/Dispatch.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <cub/block/block_scan.cuh>
#include <limits>

#include "common.cuh"
#include "select.cuh"

namespace bladesmith {
namespace gpu {
namespace {

constexpr int kThreads = 256;
constexpr int kItems = 32;  // logits per thread and tile
constexpr int kTile = kThreads * kItems;
constexpr int kDigitBits = 12;
constexpr int kBins = 1 << kDigitBits;
constexpr int kBinsPerThread = kBins / kThreads;
constexpr int kBoundaryCap = 1024;
constexpr int kMaxPasses = 6;  // ranking keys have at most 30 + 31 bits

enum Status : int { kRefining = 0, kBoundaryFound = 1, kTakeAll = 2 };

// Zero-initialised per segment; counters are updated atomically by the blocks of a kernel.
struct SegmentState {
  unsigned long long prefix;  // the boundary region: keys k with (k >> shift) == prefix
  int status;
  int shift;
  unsigned int need;        // candidates still to take from the boundary region
  unsigned int above;       // keys written above the region (every passing key for kTakeAll)
  unsigned int boundary;    // keys of the region stored for the final ranking
  unsigned int tiles_done;  // tiles of the segment the running kernel has finished
  float low;  // with the boundary found: logits at or below it score below the region
};

struct SelectParams {
  int num_levels, tiles_per_image;
  int64_t logits_per_image, slots_per_image;
  float bound;            // logits at or below it cannot pass (spares the exp)
  float threshold;        // in the input dtype, as the reference compares
  uint32_t score_base;    // float bits of the lowest score that can pass
  int64_t level_begin[kMaxLevels];  // first logit of the level within its image
  int64_t level_size[kMaxLevels];   // N_l * C
  int64_t slot_begin[kMaxLevels];
  int64_t topk[kMaxLevels];
  int tile_begin[kMaxLevels + 1];
  int index_bits[kMaxLevels];
  int key_bits[kMaxLevels];
};

struct TileRef {
  int64_t image, start;  // start: first logit of the tile within its level
  int level, segment;
};

__device__ __forceinline__ TileRef locate(const SelectParams& p, int64_t tile) {
  TileRef t;
  t.image = tile / p.tiles_per_image;
  const int r = static_cast<int>(tile % p.tiles_per_image);
  int l = 0;
  while (r >= p.tile_begin[l + 1]) ++l;
  t.level = l;
  t.start = static_cast<int64_t>(r - p.tile_begin[l]) * kTile;
  t.segment = static_cast<int>(t.image * p.num_levels + l);
  return t;
}

// Position in the level of item (j, v) of this thread: loads of VEC consecutive logits,
// coalesced across the block.
template <int VEC>
__device__ __forceinline__ int64_t item_position(int64_t start, int j) {
  return start + (static_cast<int64_t>(j) * kThreads + threadIdx.x) * VEC;
}

// Logits past the end of the level read as NaN, which never passes.
template <typename T, int VEC>
__device__ __forceinline__ void load_tile(const T* __restrict__ level, int64_t size, int64_t start,
                                          float (&x)[kItems]) {
#pragma unroll
  for (int j = 0; j < kItems / VEC; ++j) {
    const int64_t pos = item_position<VEC>(start, j);
    if (VEC > 1 && pos + VEC <= size) {
      const uint4 raw = __ldg(reinterpret_cast<const uint4*>(level + pos));
      const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int e = 0; e < VEC; ++e) x[j * VEC + e] = to_float(v[e]);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        x[j * VEC + e] = pos + e < size ? to_float(level[pos + e]) : NAN;
      }
    }
  }
}

// The reference's test: sigmoid rounded to the input dtype, strictly above the threshold.
template <typename T>
__device__ __forceinline__ bool passing_score(const SelectParams& p, float x, uint32_t& bits) {
  if (!(x > p.bound)) return false;  // NaN too
  const float score = round_to<T>(sigmoid(x));
  if (!(score > p.threshold)) return false;
  bits = __float_as_uint(score);
  return true;
}

__device__ __forceinline__ uint64_t ranking_key(const SelectParams& p, int l, uint32_t bits,
                                                int64_t pos) {
  return (static_cast<uint64_t>(bits - p.score_base) << p.index_bits[l]) |
         static_cast<uint64_t>(p.level_size[l] - 1 - pos);
}

__device__ __forceinline__ uint64_t candidate_of(const SelectParams& p, int l, uint64_t key) {
  const int ib = p.index_bits[l];
  const int64_t pos = p.level_size[l] - 1 - static_cast<int64_t>(key & ((1ull << ib) - 1));
  const uint32_t bits = static_cast<uint32_t>(key >> ib) + p.score_base;
  return make_candidate(bits + 1u, static_cast<uint32_t>(p.level_begin[l] + pos));
}

// Each block takes a contiguous share of the tiles and calls visit(tile) on those not
// skipped; close(tile, n) follows each run of n visited tiles of one segment.
template <typename Skip, typename Visit, typename Close>
__device__ __forceinline__ void for_each_run(const SelectParams& p, int64_t num_tiles, Skip skip,
                                             Visit visit, Close close) {
  const int64_t share = (num_tiles + gridDim.x - 1) / gridDim.x;
  const int64_t end = min(num_tiles, (blockIdx.x + 1) * share);
  TileRef open{};
  int run = 0;
  for (int64_t tile = blockIdx.x * share; tile < end; ++tile) {
    const TileRef t = locate(p, tile);
    if (skip(t)) continue;
    if (run > 0 && t.segment != open.segment) {
      close(open, run);
      run = 0;
    }
    visit(t);
    open = t;
    ++run;
  }
  if (run > 0) close(open, run);
}

// Counts a finished run of tiles; true in the block that finished the segment's last ones,
// which then sees every other block's writes.
__device__ __forceinline__ bool finish_run(const SelectParams& p, const TileRef& t,
                                           SegmentState& st, int run, bool& s_last) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned tiles = p.tile_begin[t.level + 1] - p.tile_begin[t.level];
    s_last = atomicAdd(&st.tiles_done, static_cast<unsigned>(run)) + run == tiles;
  }
  __syncthreads();
  const bool last = s_last;
  if (last) __threadfence();
  return last;
}

using BlockScan = cub::BlockScan<unsigned, kThreads>;

// The logit bound under the region of keys k with (k >> shift) == prefix: every key of the
// region or above it has a score of at least the region's lowest, so the compaction tests
// nothing at or below the bound (most passing logits, under a heavy load).
template <typename T>
__device__ float region_low(const SelectParams& p, int l, unsigned long long prefix, int shift) {
  const uint64_t lowest = static_cast<uint64_t>(prefix) << shift;
  const uint32_t bits = static_cast<uint32_t>(lowest >> p.index_bits[l]) + p.score_base;
  return logit_bound_reaching<T>(__uint_as_float(bits));
}

// The segment's last block of a histogram pass: finds the bin of the k-th largest key (bins
// scanned from the top), records the boundary region, and zeroes the histogram for the next
// pass.
template <typename T>
__device__ void find_boundary(const SelectParams& p, int l, int pass, int shift, int digit_bits,
                              int* __restrict__ hist, SegmentState& st,
                              int* __restrict__ pass_needed, BlockScan::TempStorage& scan) {
  unsigned counts[kBinsPerThread];
  unsigned sum = 0;
#pragma unroll
  for (int j = 0; j < kBinsPerThread; ++j) {
    const int bin = kBins - 1 - (threadIdx.x * kBinsPerThread + j);
    counts[j] = static_cast<unsigned>(__ldcg(&hist[bin]));
    hist[bin] = 0;
    sum += counts[j];
  }
  // Read before the scan's barrier: the finding thread rewrites the state.
  const unsigned k = pass == 0 ? static_cast<unsigned>(p.topk[l]) : st.need;
  unsigned before, total;
  BlockScan(scan).ExclusiveSum(sum, before, total);
  if (pass == 0 && total <= k) {
    if (threadIdx.x == 0) st.status = kTakeAll;
  } else if (before < k && k <= before + sum) {
    unsigned above = before;
#pragma unroll
    for (int j = 0; j < kBinsPerThread; ++j) {
      if (above + counts[j] >= k) {
        const unsigned long long bin = kBins - 1 - (threadIdx.x * kBinsPerThread + j);
        const bool found = counts[j] <= kBoundaryCap || shift == 0;
        const unsigned long long prefix = pass == 0 ? bin : (st.prefix << digit_bits) | bin;
        st.prefix = prefix;
        st.shift = shift;
        if (found) st.low = region_low<T>(p, l, prefix, shift);
        st.need = k - above;
        st.status = found ? kBoundaryFound : kRefining;
        if (!found) pass_needed[pass + 1] = 1;
        break;
      }
      above += counts[j];
    }
  }
  if (threadIdx.x == 0) st.tiles_done = 0;
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    histogram_kernel(SelectParams p, const T* __restrict__ logits, int pass, int64_t num_tiles,
                     int* __restrict__ hist, SegmentState* __restrict__ state,
                     int* __restrict__ pass_needed) {
  __shared__ int s_hist[kBins];  // of the open run, flushed when it closes
  __shared__ BlockScan::TempStorage scan;
  __shared__ bool s_last;
  if (pass > 0 && pass_needed[pass] == 0) return;
  for (int b = threadIdx.x; b < kBins; b += kThreads) s_hist[b] = 0;
  __syncthreads();

  const auto digit_shift = [&](int l) { return max(p.key_bits[l] - kDigitBits * (pass + 1), 0); };
  const auto digit_bits = [&](int l) { return min(p.key_bits[l] - kDigitBits * pass, kDigitBits); };
  const auto skip = [&](const TileRef& t) {
    return p.topk[t.level] == 0 || pass * kDigitBits >= p.key_bits[t.level] ||
           (pass > 0 && state[t.segment].status != kRefining);
  };
  const auto visit = [&](const TileRef& t) {
    const int l = t.level;
    const int shift = digit_shift(l);
    const uint32_t mask = (1u << digit_bits(l)) - 1;
    const SegmentState& st = state[t.segment];
    const unsigned long long region = st.prefix;
    const int region_shift = st.shift;
    float x[kItems];
    load_tile<T, VEC>(logits + t.image * p.logits_per_image + p.level_begin[l], p.level_size[l],
                      t.start, x);
#pragma unroll
    for (int n = 0; n < kItems; ++n) {
      uint32_t bits;
      if (!passing_score<T>(p, x[n], bits)) continue;
      const uint64_t key =
          ranking_key(p, l, bits, item_position<VEC>(t.start, n / VEC) + n % VEC);
      if (pass == 0 || (key >> region_shift) == region) {
        atomicAdd(&s_hist[static_cast<uint32_t>(key >> shift) & mask], 1);
      }
    }
  };
  const auto close = [&](const TileRef& t, int run) {
    __syncthreads();
    int* seg_hist = hist + static_cast<int64_t>(t.segment) * kBins;
    for (int b = threadIdx.x; b < kBins; b += kThreads) {
      if (s_hist[b] != 0) {
        atomicAdd(&seg_hist[b], s_hist[b]);
        s_hist[b] = 0;
      }
    }
    SegmentState& st = state[t.segment];
    if (finish_run(p, t, st, run, s_last)) {
      find_boundary<T>(p, t.level, pass, digit_shift(t.level), digit_bits(t.level), seg_hist,
                       st, pass_needed, scan);
    }
    __syncthreads();
  };
  for_each_run(p, num_tiles, skip, visit, close);
}

// The segment's last compaction block: ranks the boundary region's keys (at most
// kBoundaryCap, all distinct) and writes the best `need` after the keys above it; with no
// boundary (every passing key taken), pads the remaining slots.
__device__ void finish_segment(const SelectParams& p, int l, SegmentState& st,
                               const uint64_t* __restrict__ boundary_keys,
                               uint64_t* __restrict__ level_out, uint64_t* s_keys) {
  const int64_t k = p.topk[l];
  if (st.status == kTakeAll) {
    for (int64_t s = __ldcg(&st.above) + threadIdx.x; s < k; s += kThreads) level_out[s] = 0;
    return;
  }
  const unsigned n = min(__ldcg(&st.boundary), static_cast<unsigned>(kBoundaryCap));
  const unsigned need = min(st.need, n);
  for (unsigned i = threadIdx.x; i < n; i += kThreads) {
    s_keys[i] = __ldcg(reinterpret_cast<const unsigned long long*>(boundary_keys) + i);
  }
  __syncthreads();
  for (unsigned i = threadIdx.x; i < n; i += kThreads) {
    const uint64_t key = s_keys[i];
    unsigned rank = 0;
    for (unsigned j = 0; j < n; ++j) rank += s_keys[j] > key;
    if (rank < need) level_out[k - need + rank] = candidate_of(p, l, key);
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kThreads)
    compact_kernel(SelectParams p, const T* __restrict__ logits, int64_t num_tiles,
                   SegmentState* __restrict__ state, uint64_t* __restrict__ boundary_keys,
                   uint64_t* __restrict__ out) {
  __shared__ BlockScan::TempStorage scan;
  __shared__ unsigned s_above, s_boundary;
  __shared__ bool s_last;
  __shared__ uint64_t s_keys[kBoundaryCap];

  const auto level_out = [&](const TileRef& t) {
    return out + t.image * p.slots_per_image + p.slot_begin[t.level];
  };
  const auto seg_boundary = [&](const TileRef& t) {
    return boundary_keys + static_cast<int64_t>(t.segment) * kBoundaryCap;
  };
  const auto skip = [&](const TileRef& t) { return p.topk[t.level] == 0; };
  const auto visit = [&](const TileRef& t) {
    const int l = t.level;
    SegmentState& st = state[t.segment];
    const bool take_all = st.status == kTakeAll;
    const unsigned long long region = st.prefix;
    const int region_shift = st.shift;
    const float low = take_all ? -INFINITY : st.low;
    const T* level_logits = logits + t.image * p.logits_per_image + p.level_begin[l];
    float x[kItems];
    load_tile<T, VEC>(level_logits, p.level_size[l], t.start, x);
    uint32_t above = 0, boundary = 0;  // item masks
#pragma unroll
    for (int n = 0; n < kItems; ++n) {
      uint32_t bits;
      if (!(x[n] > low) || !passing_score<T>(p, x[n], bits)) continue;
      if (take_all) {
        above |= 1u << n;
        continue;
      }
      const uint64_t key =
          ranking_key(p, l, bits, item_position<VEC>(t.start, n / VEC) + n % VEC);
      const unsigned long long q = key >> region_shift;
      if (q > region) above |= 1u << n;
      if (q == region) boundary |= 1u << n;
    }
    // Per-thread counts packed in one word (each at most kItems).
    const unsigned mine = (__popc(above) << 16) | __popc(boundary);
    if (!__syncthreads_or(mine)) return;
    unsigned offset, total;
    BlockScan(scan).ExclusiveSum(mine, offset, total);
    if (threadIdx.x == 0) {
      s_above = atomicAdd(&st.above, total >> 16);
      s_boundary = atomicAdd(&st.boundary, total & 0xFFFFu);
    }
    __syncthreads();
    unsigned a = s_above + (offset >> 16), b = s_boundary + (offset & 0xFFFFu);
    uint64_t* level = level_out(t);
    uint64_t* bound = seg_boundary(t);
    // The counts cannot exceed the capacities (the histograms saw the same keys); the
    // bounds only make sure that nothing could ever write past them. The few logits taken
    // are read again (from cache) rather than keeping every score in registers, which
    // would halve the blocks resident per multiprocessor.
#pragma unroll
    for (int n = 0; n < kItems; ++n) {
      if (!((above | boundary) >> n & 1u)) continue;
      const int64_t pos = item_position<VEC>(t.start, n / VEC) + n % VEC;
      uint32_t bits;
      passing_score<T>(p, to_float(level_logits[pos]), bits);
      if (above >> n & 1u) {
        if (a < p.topk[l]) {
          level[a] = make_candidate(bits + 1u, static_cast<uint32_t>(p.level_begin[l] + pos));
        }
        ++a;
      } else {
        if (b < kBoundaryCap) bound[b] = ranking_key(p, l, bits, pos);
        ++b;
      }
    }
    __syncthreads();  // s_above, s_boundary and the scan storage are free again
  };
  const auto close = [&](const TileRef& t, int run) {
    if (finish_run(p, t, state[t.segment], run, s_last)) {
      finish_segment(p, t.level, state[t.segment], seg_boundary(t), level_out(t), s_keys);
    }
    __syncthreads();
  };
  for_each_run(p, num_tiles, skip, visit, close);
}

int bit_width(uint64_t v) { return v == 0 ? 0 : 64 - __builtin_clzll(v); }

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

template <typename T, int VEC>
void launch_select(const SelectParams& p, int num_passes, const T* logits, int64_t num_tiles,
                   int* hist, SegmentState* state, int* pass_needed, uint64_t* boundary_keys,
                   uint64_t* out) {
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto histogram = histogram_kernel<T, VEC>;
  const int64_t hist_grid = std::min(num_tiles, resident_blocks(histogram, kThreads));
  for (int pass = 0; pass < num_passes; ++pass) {
    histogram<<<hist_grid, kThreads, 0, stream>>>(p, logits, pass, num_tiles, hist, state,
                                                  pass_needed);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  auto compact = compact_kernel<T, VEC>;
  const int64_t compact_grid = std::min(num_tiles, resident_blocks(compact, kThreads));
  compact<<<compact_grid, kThreads, 0, stream>>>(p, logits, num_tiles, state, boundary_keys, out);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

at::Tensor select_candidates(const at::Tensor& cls_logits, const DecodeShape& shape,
                             double score_threshold) {
  const int64_t B = shape.batch, C = shape.num_classes, K = shape.num_candidates;
  const int L = static_cast<int>(shape.level_topk.size());
  auto out = at::empty({B, K}, cls_logits.options().dtype(at::kLong));
  if (B == 0 || K == 0) return out;

  const auto logits = cls_logits.contiguous();
  SelectParams p{};
  p.num_levels = L;
  p.logits_per_image = shape.num_anchors * C;
  p.slots_per_image = K;
  p.tile_begin[0] = 0;
  for (int l = 0; l < L; ++l) {
    p.level_begin[l] = shape.level_offsets[l] * C;
    p.level_size[l] = (shape.level_offsets[l + 1] - shape.level_offsets[l]) * C;
    p.slot_begin[l] = shape.slot_offsets[l];
    p.topk[l] = shape.level_topk[l];
    p.index_bits[l] = bit_width(static_cast<uint64_t>(std::max<int64_t>(p.level_size[l] - 1, 0)));
    p.tile_begin[l + 1] = p.tile_begin[l] + static_cast<int>(ceil_div(p.level_size[l], kTile));
  }
  p.tiles_per_image = p.tile_begin[L];
  const int64_t num_tiles = B * p.tiles_per_image;

  // Workspace: histograms, segment states and the per-pass flags, zeroed in one fill.
  const int64_t segments = B * L;
  const int64_t hist_bytes = segments * kBins * static_cast<int64_t>(sizeof(int));
  const int64_t state_bytes = segments * static_cast<int64_t>(sizeof(SegmentState));
  auto workspace = at::zeros({hist_bytes + state_bytes + (kMaxPasses + 1) * 4},
                             cls_logits.options().dtype(at::kByte));
  auto* hist = reinterpret_cast<int*>(workspace.data_ptr<uint8_t>());
  auto* state = reinterpret_cast<SegmentState*>(workspace.data_ptr<uint8_t>() + hist_bytes);
  auto* pass_needed =
      reinterpret_cast<int*>(workspace.data_ptr<uint8_t>() + hist_bytes + state_bytes);
  auto boundary_keys = at::empty({segments * kBoundaryCap}, out.options());
  auto* out_keys = reinterpret_cast<uint64_t*>(out.data_ptr<int64_t>());
  auto* boundary = reinterpret_cast<uint64_t*>(boundary_keys.data_ptr<int64_t>());

  BLADESMITH_DISPATCH_FLOAT(logits.scalar_type(), "retinanet_decode_cuda", [&] {
    // Comparing with a Python float rounds the threshold to the tensor's dtype.
    p.threshold = static_cast<float>(static_cast<scalar_t>(score_threshold));
    p.bound = logit_bound(p.threshold, std::numeric_limits<scalar_t>::epsilon());
    // Scores lie in [0, 1]: their float bits, less those of the lowest passing score, need
    // score_width bits.
    const uint32_t one = float_bits(1.0f);
    p.score_base = p.threshold >= 0 ? float_bits(p.threshold + 0.0f) + 1 : 0;
    const int score_width = p.score_base <= one ? std::max(bit_width(one - p.score_base), 1) : 1;
    int num_passes = 1;
    for (int l = 0; l < L; ++l) {
      p.key_bits[l] = score_width + p.index_bits[l];
      if (p.topk[l] > 0) {
        num_passes = std::max<int>(num_passes, ceil_div(p.key_bits[l], kDigitBits));
      }
    }
    const auto* data = logits.const_data_ptr<scalar_t>();
    constexpr int kVec = 16 / sizeof(scalar_t);
    bool aligned = reinterpret_cast<uintptr_t>(data) % 16 == 0 && p.logits_per_image % kVec == 0;
    for (int l = 0; l < L; ++l) aligned = aligned && p.level_begin[l] % kVec == 0;
    if (aligned) {
      launch_select<scalar_t, kVec>(p, num_passes, data, num_tiles, hist, state, pass_needed,
                                    boundary, out_keys);
    } else {
      launch_select<scalar_t, 1>(p, num_passes, data, num_tiles, hist, state, pass_needed,
                                 boundary, out_keys);
    }
  });
  return out;
}

}  // namespace gpu
}  // namespace bladesmith
