// Descending sort of candidate keys (common.cuh) within segments, on the current stream,
// without host synchronisation.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "common.cuh"

namespace bladesmith {
namespace gpu {

// Segment (g, l) of `keys` starts at g * group_stride + begin[l] and holds size[l] keys:
// groups are images; parts are levels (decode) or the whole image (NMS).
struct Segments {
  int64_t groups = 0, group_stride = 0;
  int parts = 0;
  int64_t begin[kMaxLevels] = {};
  int64_t size[kMaxLevels] = {};
};

// One segment per image of `slots` keys.
Segments per_image(int64_t groups, int64_t slots);

// One segment per image and level, as the decode lays out its slots.
Segments per_level(int64_t groups, const std::vector<int64_t>& slot_offsets);

// Returns the keys (an int64 tensor holding uint64 keys, every key in one segment) sorted in
// descending order within each segment; may sort in place.
at::Tensor sort_descending(const at::Tensor& keys, const Segments& segments);

}  // namespace gpu
}  // namespace bladesmith
