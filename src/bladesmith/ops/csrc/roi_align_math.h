// The arithmetic of multilevel_roi_align, shared by its CPU and CUDA kernels: torchvision's
// roi_align forward (aligned=False, a fixed sampling ratio) for one box on its own level of
// a channels-last table that holds every level's pixels, image by image. Each operation
// rounds on its own as torchvision's float kernel does (the CPU build has
// -ffp-contract=off; device code uses the __f*_rn intrinsics, never contracted into fused
// multiply-adds), so both kernels give torchvision's floats on finite features (a sample
// outside the map reads 0 here, where torchvision's CPU kernel adds 0 times pixel (0, 0),
// NaN if that pixel is not finite).
#pragma once

#include <c10/macros/Macros.h>

#include <cstdint>

namespace bladesmith {

// Level tables travel as kernel parameters (no host copies, so a CUDA graph holds every
// launch): at most this many levels, in every operator that takes them.
constexpr int kMaxLevels = 16;

namespace roi {

// The table's layout: level l's pixel (y, x) of image b is row
// b * rows_per_image + offset[l] + y * width[l] + x. Passed by value to a kernel.
struct Levels {
  int64_t count = 0, images = 0, rows_per_image = 0;
  int64_t height[kMaxLevels] = {}, width[kMaxLevels] = {}, offset[kMaxLevels] = {};
  float scale[kMaxLevels] = {};
};

C10_HOST_DEVICE inline float mul(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

C10_HOST_DEVICE inline float add(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

C10_HOST_DEVICE inline float div(float a, float b) {
#ifdef __CUDA_ARCH__
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// One box on its level: the table row of its pixel (0, 0), its level's size, and its bins'
// origin and size in that level's pixels. first_row < 0: the box names no image or level
// of the table, and pools to 0.
struct Box {
  int64_t first_row = -1, height = 1, width = 1;
  float y0 = 0.f, x0 = 0.f, bin_h = 0.f, bin_w = 0.f;
};

// roi: (image index, x1, y1, x2, y2) in image coordinates.
C10_HOST_DEVICE inline Box box_on(const Levels& levels, const float* roi, int64_t level,
                                  int64_t pooled_h, int64_t pooled_w) {
  Box box;
  if (!(roi[0] >= 0.f && roi[0] < static_cast<float>(levels.images)) || level < 0 ||
      level >= levels.count) {
    return box;
  }
  const auto image = static_cast<int64_t>(roi[0]);
  box.first_row = image * levels.rows_per_image + levels.offset[level];
  box.height = levels.height[level];
  box.width = levels.width[level];
  const float scale = levels.scale[level];
  box.x0 = mul(roi[1], scale);
  box.y0 = mul(roi[2], scale);
  float roi_w = mul(roi[3], scale) - box.x0;
  float roi_h = mul(roi[4], scale) - box.y0;
  roi_w = roi_w < 1.f ? 1.f : roi_w;  // malformed boxes become 1x1, as std::max does
  roi_h = roi_h < 1.f ? 1.f : roi_h;
  box.bin_h = div(roi_h, static_cast<float>(pooled_h));
  box.bin_w = div(roi_w, static_cast<float>(pooled_w));
  return box;
}

// torchvision: start + bin * bin_size + (i + .5f) * bin_size / grid.
C10_HOST_DEVICE inline float sample_at(float start, int64_t bin, float bin_size, int64_t i,
                                       int64_t grid) {
  return add(add(start, mul(static_cast<float>(bin), bin_size)),
             div(mul(static_cast<float>(i) + .5f, bin_size), static_cast<float>(grid)));
}

// A sample's four neighbours (rows from the box's first row) and their weights.
struct Bilinear {
  int64_t p1, p2, p3, p4;
  float w1, w2, w3, w4;
};

// torchvision's bilinear_interpolate: false where the sample lies outside (it reads 0);
// !(in range), so that NaN positions read 0 too, as the CPU kernels do.
C10_HOST_DEVICE inline bool bilinear(float y, float x, int64_t height, int64_t width,
                                     Bilinear& s) {
  if (!(y >= -1.f && y <= static_cast<float>(height) && x >= -1.f &&
        x <= static_cast<float>(width))) {
    return false;
  }
  if (y <= 0) y = 0;
  if (x <= 0) x = 0;
  auto y_low = static_cast<int64_t>(y), x_low = static_cast<int64_t>(x);
  int64_t y_high, x_high;
  if (y_low >= height - 1) {
    y_high = y_low = height - 1;
    y = static_cast<float>(y_low);
  } else {
    y_high = y_low + 1;
  }
  if (x_low >= width - 1) {
    x_high = x_low = width - 1;
    x = static_cast<float>(x_low);
  } else {
    x_high = x_low + 1;
  }
  const float ly = y - static_cast<float>(y_low), lx = x - static_cast<float>(x_low);
  const float hy = 1.f - ly, hx = 1.f - lx;
  s = Bilinear{y_low * width + x_low, y_low * width + x_high, y_high * width + x_low,
               y_high * width + x_high, mul(hy, hx), mul(hy, lx), mul(ly, hx), mul(ly, lx)};
  return true;
}

// visit(s) for each sample of bin (ph, pw) of box that lies inside its level, in
// torchvision's order (row by row); the others read 0. Templated on the visitor, so a
// kernel's own lambda runs where it was written, on the host or the device.
#pragma nv_exec_check_disable
template <typename Visit>
C10_HOST_DEVICE inline void for_each_sample(const Box& box, int64_t ph, int64_t pw,
                                            int64_t grid, Visit&& visit) {
  if (box.first_row < 0) return;
  for (int64_t iy = 0; iy < grid; ++iy) {
    const float y = sample_at(box.y0, ph, box.bin_h, iy, grid);
    for (int64_t ix = 0; ix < grid; ++ix) {
      const float x = sample_at(box.x0, pw, box.bin_w, ix, grid);
      Bilinear s;
      if (bilinear(y, x, box.height, box.width, s)) visit(s);
    }
  }
}

// A sample's value: w1 v1 + w2 v2 + w3 v3 + w4 v4, left to right.
C10_HOST_DEVICE inline float mix(const Bilinear& s, float v1, float v2, float v3, float v4) {
  return add(add(add(mul(s.w1, v1), mul(s.w2, v2)), mul(s.w3, v3)), mul(s.w4, v4));
}

}  // namespace roi
}  // namespace bladesmith
