// bladesmith::multilevel_roi_align on the CPU: each box pooled from its own level of the
// table (roi_align_math.h), threaded over the boxes; a bin's channels are contiguous rows.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "../checks.h"

namespace bladesmith {
namespace {

at::Tensor multilevel_roi_align_cpu(const at::Tensor& table, const at::Tensor& rois,
                                    const at::Tensor& level_of, at::IntArrayRef heights,
                                    at::IntArrayRef widths, at::ArrayRef<double> scales,
                                    int64_t pooled_height, int64_t pooled_width,
                                    int64_t sampling_ratio) {
  const auto call = multilevel_roi_align_call(table, rois, level_of, heights, widths, scales,
                                              pooled_height, pooled_width, sampling_ratio);
  const roi::Levels& levels = call.levels;
  const int64_t count = rois.size(0), channels = table.size(1);
  auto output = call.output;
  if (output.numel() == 0) return output;
  const int64_t grid = sampling_ratio;
  const float samples = static_cast<float>(grid * grid);
  BLADESMITH_DISPATCH_FLOAT(table.scalar_type(), "multilevel_roi_align_cpu", [&] {
    const scalar_t* data = call.table.const_data_ptr<scalar_t>();
    scalar_t* out = output.mutable_data_ptr<scalar_t>();
    at::parallel_for(0, count, 1, [&](int64_t begin, int64_t end) {
      std::vector<float> sum(channels);
      for (int64_t n = begin; n < end; ++n) {
        const roi::Box box = roi::box_on(levels, call.rois.const_data_ptr<float>() + n * 5,
                                         call.level_of.const_data_ptr<int64_t>()[n], pooled_height,
                                         pooled_width);
        for (int64_t ph = 0; ph < pooled_height; ++ph) {
          for (int64_t pw = 0; pw < pooled_width; ++pw) {
            std::fill(sum.begin(), sum.end(), 0.f);
            roi::for_each_sample(box, ph, pw, grid, [&](const roi::Bilinear& s) {
              const scalar_t* v1 = data + (box.first_row + s.p1) * channels;
              const scalar_t* v2 = data + (box.first_row + s.p2) * channels;
              const scalar_t* v3 = data + (box.first_row + s.p3) * channels;
              const scalar_t* v4 = data + (box.first_row + s.p4) * channels;
              for (int64_t c = 0; c < channels; ++c) {
                sum[c] += roi::mix(s, static_cast<float>(v1[c]), static_cast<float>(v2[c]),
                                   static_cast<float>(v3[c]), static_cast<float>(v4[c]));
              }
            });
            scalar_t* bin = out + ((n * pooled_height + ph) * pooled_width + pw) * channels;
            for (int64_t c = 0; c < channels; ++c) {
              bin[c] = static_cast<scalar_t>(sum[c] / samples);
            }
          }
        }
      }
    });
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(bladesmith, CPU, m) {
  m.impl("multilevel_roi_align", &multilevel_roi_align_cpu);
}

}  // namespace bladesmith
