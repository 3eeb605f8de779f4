// bladesmith::roi_align_nhwc on the CPU: torchvision's RoIAlign (its forward, to the bit)
// on a channels_last feature map.
//
// torchvision's CPU kernel walks one channel at a time, one box after another on one
// thread: each bilinear sample reads four scattered floats. In channels_last the four
// neighbours of a sample are four contiguous channel vectors, so a bin is a few vector
// multiply-adds over the channels, and the boxes are split between threads. The
// sampling positions and weights are torchvision's (pre_calc_for_bilinear_interpolate),
// and each output is summed in its order with no fused multiply-add (the library is built
// with -ffp-contract=off): the same floats as torchvision's kernel.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "../message.h"

namespace bladesmith {
namespace {

// A copy of the function per instruction set, picked when the library loads (GNU ifunc).
#if defined(__linux__) && defined(__x86_64__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

struct Sample {  // one bilinear sample: its four neighbours (pixel indices) and weights
  int64_t pos1, pos2, pos3, pos4;
  float w1, w2, w3, w4;
};

// torchvision's pre_calc_for_bilinear_interpolate, with the same arithmetic and types.
void samples_of(int64_t height, int64_t width, int64_t pooled_height, int64_t pooled_width,
                float roi_start_h, float roi_start_w, float bin_size_h, float bin_size_w,
                int grid_h, int grid_w, std::vector<Sample>& samples) {
  int64_t index = 0;
  for (int ph = 0; ph < pooled_height; ph++) {
    for (int pw = 0; pw < pooled_width; pw++) {
      for (int iy = 0; iy < grid_h; iy++) {
        const float yy = roi_start_h + ph * bin_size_h +
                         static_cast<float>(iy + .5f) * bin_size_h / static_cast<float>(grid_h);
        for (int ix = 0; ix < grid_w; ix++) {
          const float xx = roi_start_w + pw * bin_size_w +
                           static_cast<float>(ix + .5f) * bin_size_w /
                               static_cast<float>(grid_w);
          float x = xx;
          float y = yy;
          Sample& s = samples[index++];
          // !(in range), so that NaN coordinates take this branch too.
          if (!(y >= -1.0 && y <= height && x >= -1.0 && x <= width)) {
            s = Sample{0, 0, 0, 0, 0.f, 0.f, 0.f, 0.f};
            continue;
          }
          if (y <= 0) y = 0;
          if (x <= 0) x = 0;
          int y_low = (int)y;
          int x_low = (int)x;
          int y_high, x_high;
          if (y_low >= height - 1) {
            y_high = y_low = height - 1;
            y = (float)y_low;
          } else {
            y_high = y_low + 1;
          }
          if (x_low >= width - 1) {
            x_high = x_low = width - 1;
            x = (float)x_low;
          } else {
            x_high = x_low + 1;
          }
          float ly = y - y_low;
          float lx = x - x_low;
          float hy = 1. - ly, hx = 1. - lx;
          s = Sample{y_low * width + x_low, y_low * width + x_high, y_high * width + x_low,
                     y_high * width + x_high, hy * hx, hy * lx, ly * hx, ly * lx};
        }
      }
    }
  }
}

constexpr int64_t kBlock = 32;  // channels summed together, in registers

// One bin: sum[c] over its samples of w1 v1 + w2 v2 + w3 v3 + w4 v4, in torchvision's
// order, over the contiguous channels of the pixels of image (channels_last).
VECTOR_CLONES void pool_bin(const float* image, int64_t channels, const Sample* samples,
                            int64_t count, float* sum) {
  int64_t c0 = 0;
  for (; c0 + kBlock <= channels; c0 += kBlock) {
    float acc[kBlock] = {};
    for (int64_t i = 0; i < count; ++i) {
      const Sample s = samples[i];
      const float* v1 = image + s.pos1 * channels + c0;
      const float* v2 = image + s.pos2 * channels + c0;
      const float* v3 = image + s.pos3 * channels + c0;
      const float* v4 = image + s.pos4 * channels + c0;
      for (int64_t c = 0; c < kBlock; ++c) {
        acc[c] += s.w1 * v1[c] + s.w2 * v2[c] + s.w3 * v3[c] + s.w4 * v4[c];
      }
    }
    std::copy_n(acc, kBlock, sum + c0);
  }
  for (int64_t c = c0; c < channels; ++c) {  // the last channels, fewer than a block
    float acc = 0.0f;
    for (int64_t i = 0; i < count; ++i) {
      const Sample s = samples[i];
      acc += s.w1 * image[s.pos1 * channels + c] + s.w2 * image[s.pos2 * channels + c] +
             s.w3 * image[s.pos3 * channels + c] + s.w4 * image[s.pos4 * channels + c];
    }
    sum[c] = acc;
  }
}

at::Tensor roi_align_nhwc(const at::Tensor& input, const at::Tensor& rois, double spatial_scale,
                          int64_t pooled_height, int64_t pooled_width, int64_t sampling_ratio,
                          bool aligned) {
  BLADESMITH_CHECK(input.dim() == 4, "roi_align_nhwc: input must be [N, C, H, W], got ",
                   input.dim(), " dimensions");
  TORCH_CHECK(input.scalar_type() == at::kFloat && rois.scalar_type() == at::kFloat,
              "roi_align_nhwc: input and rois must be float32");
  TORCH_CHECK(rois.dim() == 2 && rois.size(1) == 5,
              "roi_align_nhwc: rois must be [K, 5] (image index, x1, y1, x2, y2)");
  TORCH_CHECK(pooled_height > 0 && pooled_width > 0,
              "roi_align_nhwc: the output size must be positive");
  const int64_t num_rois = rois.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  auto output = at::zeros({num_rois, channels, pooled_height, pooled_width}, input.options());
  if (output.numel() == 0) return output;
  const auto features = input.contiguous(at::MemoryFormat::ChannelsLast);
  const auto boxes = rois.contiguous();
  const float* data = features.const_data_ptr<float>();
  const float* box_data = boxes.const_data_ptr<float>();
  float* out = output.mutable_data_ptr<float>();
  const int64_t bins = pooled_height * pooled_width;
  const float scale = static_cast<float>(spatial_scale);
  at::parallel_for(0, num_rois, 1, [&](int64_t begin, int64_t end) {
    std::vector<Sample> samples;
    std::vector<float> sum(channels);
    for (int64_t n = begin; n < end; ++n) {
      const float* roi = box_data + n * 5;
      const int64_t image = static_cast<int64_t>(roi[0]);
      BLADESMITH_CHECK(image >= 0 && image < input.size(0), "roi_align_nhwc: box ", n,
                       " names image ", image, " of ", input.size(0));
      // torchvision's arithmetic, in float as its kernel for float inputs.
      const float offset = aligned ? 0.5f : 0.0f;
      const float roi_start_w = roi[1] * scale - offset;
      const float roi_start_h = roi[2] * scale - offset;
      const float roi_end_w = roi[3] * scale - offset;
      const float roi_end_h = roi[4] * scale - offset;
      float roi_width = roi_end_w - roi_start_w;
      float roi_height = roi_end_h - roi_start_h;
      if (!aligned) {  // malformed boxes become 1x1
        roi_width = std::max(roi_width, 1.0f);
        roi_height = std::max(roi_height, 1.0f);
      }
      const float bin_size_h = roi_height / static_cast<float>(pooled_height);
      const float bin_size_w = roi_width / static_cast<float>(pooled_width);
      const int grid_h = sampling_ratio > 0 ? sampling_ratio : std::ceil(roi_height / pooled_height);
      const int grid_w = sampling_ratio > 0 ? sampling_ratio : std::ceil(roi_width / pooled_width);
      const float count = std::max(grid_h * grid_w, 1);
      // A reversed box (aligned) has a negative grid: no samples, as in torchvision.
      const int64_t per_bin = static_cast<int64_t>(std::max(grid_h, 0)) * std::max(grid_w, 0);
      samples.resize(per_bin * bins);
      samples_of(height, width, pooled_height, pooled_width, roi_start_h, roi_start_w,
                 bin_size_h, bin_size_w, grid_h, grid_w, samples);
      const float* pixels = data + image * height * width * channels;
      float* roi_out = out + n * channels * bins;
      for (int64_t bin = 0; bin < bins; ++bin) {
        pool_bin(pixels, channels, samples.data() + bin * per_bin, per_bin, sum.data());
        for (int64_t c = 0; c < channels; ++c) {
          roi_out[c * bins + bin] = sum[c] / count;
        }
      }
    }
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(bladesmith, CPU, m) { m.impl("roi_align_nhwc", &roi_align_nhwc); }

}  // namespace bladesmith
