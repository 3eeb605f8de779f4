// bladesmith::winograd_conv3x3 on the CPU: a 3x3 stride-1 padding-1 convolution as
// Winograd F(4x4, 3x3) (Lavin and Gray, 2015), 36 multiplications per 4x4 output tile and
// input-output channel pair instead of 144.
//
// The input and output transforms are element-wise over channels: in channels_last they
// read and write contiguous channel vectors, which the compiler vectorises for the widest
// instruction set of this CPU. The 36 products of the transformed tiles
// with the transformed kernel are one grouped 1x1 convolution (a group per tile point),
// which oneDNN runs near the CPU's peak: the transforms stay here, the arithmetic there.
// The kernel is transformed, and laid out in oneDNN's blocked format, once per weight
// tensor and process (reordering 36x the weights on every call would cost as much as
// the products at the smaller levels), and the copy goes with the weight.
//
// Layouts (channels_last throughout): transformed input [1, 36 * C, tiles, 1], memory
// [tile][point][channel]; kernel [36 * K, C, 1, 1]; products [1, 36 * K, tiles, 1],
// memory [tile][point][output channel].
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <ATen/Context.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/intrusive_ptr.h>

#include <algorithm>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "../message.h"

namespace bladesmith {
namespace {

constexpr int64_t kOut = 4;          // output tile side
constexpr int64_t kIn = kOut + 2;    // input tile side
constexpr int64_t kPoints = kIn * kIn;
constexpr int64_t kBlock = 64;       // channels transformed together (fits the stack)

// A copy of the function per instruction set, picked when the library loads (GNU ifunc).
#if defined(__linux__) && defined(__x86_64__)
#define VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define VECTOR_CLONES
#endif

// One input tile, channels [c0, c0 + n): v[p * C + c] = (B^T d B)[p] with
//   B^T = [4 0 -5 0 1 0; 0 -4 -4 1 1 0; 0 4 -4 -1 1 0; 0 -2 -1 2 1 0; 0 2 -1 -2 1 0;
//          0 4 0 -5 0 1]
// d is the 6x6 window at (y0, x0) of the image x ([H][W][C]), zero outside it.
VECTOR_CLONES void input_tile(
    const float* x, int64_t height, int64_t width, int64_t channels, int64_t y0, int64_t x0,
    int64_t c0, int64_t n, float* v) {
  float d[kIn][kIn][kBlock];
  for (int64_t i = 0; i < kIn; ++i) {
    for (int64_t j = 0; j < kIn; ++j) {
      const int64_t y = y0 + i, xx = x0 + j;
      if (y < 0 || y >= height || xx < 0 || xx >= width) {
        std::fill_n(d[i][j], n, 0.0f);
      } else {
        std::copy_n(x + (y * width + xx) * channels + c0, n, d[i][j]);
      }
    }
  }
  float t[kIn][kIn][kBlock];  // B^T d, over rows
  for (int64_t j = 0; j < kIn; ++j) {
    for (int64_t c = 0; c < n; ++c) {
      const float r0 = d[0][j][c], r1 = d[1][j][c], r2 = d[2][j][c];
      const float r3 = d[3][j][c], r4 = d[4][j][c], r5 = d[5][j][c];
      t[0][j][c] = 4.0f * r0 - 5.0f * r2 + r4;
      t[1][j][c] = -4.0f * (r1 + r2) + r3 + r4;
      t[2][j][c] = 4.0f * (r1 - r2) - r3 + r4;
      t[3][j][c] = -2.0f * (r1 - r3) - r2 + r4;
      t[4][j][c] = 2.0f * (r1 - r3) - r2 + r4;
      t[5][j][c] = 4.0f * r1 - 5.0f * r3 + r5;
    }
  }
  for (int64_t i = 0; i < kIn; ++i) {  // (B^T d) B, over columns
    float row[kIn][kBlock];
    for (int64_t c = 0; c < n; ++c) {
      const float r0 = t[i][0][c], r1 = t[i][1][c], r2 = t[i][2][c];
      const float r3 = t[i][3][c], r4 = t[i][4][c], r5 = t[i][5][c];
      row[0][c] = 4.0f * r0 - 5.0f * r2 + r4;
      row[1][c] = -4.0f * (r1 + r2) + r3 + r4;
      row[2][c] = 4.0f * (r1 - r2) - r3 + r4;
      row[3][c] = -2.0f * (r1 - r3) - r2 + r4;
      row[4][c] = 2.0f * (r1 - r3) - r2 + r4;
      row[5][c] = 4.0f * r1 - 5.0f * r3 + r5;
    }
    for (int64_t j = 0; j < kIn; ++j) std::copy_n(row[j], n, v + (i * kIn + j) * channels + c0);
  }
}

// One output tile, channels [k0, k0 + n) of the products m ([point][K]): A^T m A with
//   A^T = [1 1 1 1 1 0; 0 1 -1 2 -2 0; 0 1 1 4 4 0; 0 1 -1 8 -8 1],
// plus the bias, then the ReLU if asked, written into y ([H][W][K]) where the tile lies
// inside the image.
VECTOR_CLONES void output_tile(
    const float* m, int64_t stride, const float* bias, bool relu, int64_t height,
    int64_t width, int64_t out_channels, int64_t y0, int64_t x0, int64_t k0, int64_t n,
    float* y) {
  float t[kOut][kIn][kBlock];  // A^T m, over rows
  for (int64_t j = 0; j < kIn; ++j) {
    const float* r[kIn];
    for (int64_t i = 0; i < kIn; ++i) r[i] = m + (i * kIn + j) * stride + k0;
    for (int64_t c = 0; c < n; ++c) {
      const float a1 = r[1][c] + r[2][c], s1 = r[1][c] - r[2][c];
      const float a2 = r[3][c] + r[4][c], s2 = r[3][c] - r[4][c];
      t[0][j][c] = r[0][c] + a1 + a2;
      t[1][j][c] = s1 + 2.0f * s2;
      t[2][j][c] = a1 + 4.0f * a2;
      t[3][j][c] = s1 + 8.0f * s2 + r[5][c];
    }
  }
  for (int64_t i = 0; i < kOut && y0 + i < height; ++i) {  // (A^T m) A, over columns
    float row[kOut][kBlock];
    for (int64_t c = 0; c < n; ++c) {
      const float r0 = t[i][0][c], r5 = t[i][5][c], b = bias[k0 + c];
      const float a1 = t[i][1][c] + t[i][2][c], s1 = t[i][1][c] - t[i][2][c];
      const float a2 = t[i][3][c] + t[i][4][c], s2 = t[i][3][c] - t[i][4][c];
      row[0][c] = r0 + a1 + a2 + b;
      row[1][c] = s1 + 2.0f * s2 + b;
      row[2][c] = a1 + 4.0f * a2 + b;
      row[3][c] = s1 + 8.0f * s2 + r5 + b;
    }
    for (int64_t j = 0; j < kOut && x0 + j < width; ++j) {
      float* out = y + ((y0 + i) * width + x0 + j) * out_channels + k0;
      if (relu) {
        for (int64_t c = 0; c < n; ++c) out[c] = std::max(row[j][c], 0.0f);
      } else {
        std::copy_n(row[j], n, out);
      }
    }
  }
}

// G g G^T for every 3x3 kernel g of weight [K, C, 3, 3], in float64: [36 * K, C, 1, 1].
at::Tensor transform_kernel(const at::Tensor& weight) {
  static constexpr double G[kIn][3] = {{1.0 / 4, 0, 0},           {-1.0 / 6, -1.0 / 6, -1.0 / 6},
                                       {-1.0 / 6, 1.0 / 6, -1.0 / 6}, {1.0 / 24, 1.0 / 12, 1.0 / 6},
                                       {1.0 / 24, -1.0 / 12, 1.0 / 6}, {0, 0, 1}};
  const int64_t out_channels = weight.size(0), channels = weight.size(1);
  const auto w = weight.to(at::kDouble).contiguous();
  auto u = at::empty({kPoints, out_channels, channels}, w.options());
  const double* ws = w.data_ptr<double>();
  double* us = u.data_ptr<double>();
  const int64_t pairs = out_channels * channels;
  at::parallel_for(0, pairs, 256, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const double* g = ws + pair * 9;
      double gg[kIn][3];  // G g
      for (int64_t a = 0; a < kIn; ++a) {
        for (int64_t j = 0; j < 3; ++j) {
          gg[a][j] = G[a][0] * g[j] + G[a][1] * g[3 + j] + G[a][2] * g[6 + j];
        }
      }
      for (int64_t a = 0; a < kIn; ++a) {
        for (int64_t b = 0; b < kIn; ++b) {
          us[(a * kIn + b) * pairs + pair] =
              gg[a][0] * G[b][0] + gg[a][1] * G[b][1] + gg[a][2] * G[b][2];
        }
      }
    }
  });
  return u.to(at::kFloat).reshape({kPoints * out_channels, channels, 1, 1});
}

// oneDNN's convolution with a weight already in its blocked format, when this PyTorch
// has it; else nullptr (at::conv2d then reorders the weight on every call).
const c10::OperatorHandle* prepacked_convolution() {
  static const auto op = [] {
    return at::hasMKLDNN() ? c10::Dispatcher::singleton().findOp(
                                 {"mkldnn::_convolution_pointwise", ""})
                           : std::nullopt;
  }();
  return op ? &*op : nullptr;
}

// The transformed kernel of each weight tensor, made on its first call in this process.
struct Transformed {
  c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl> weight;
  uint32_t version;
  at::Tensor kernel;
};

at::Tensor transformed_kernel(const at::Tensor& weight, at::IntArrayRef input_size) {
  static std::mutex mutex;
  static std::unordered_map<const c10::TensorImpl*, Transformed> cache;
  std::lock_guard<std::mutex> lock(mutex);
  for (auto it = cache.begin(); it != cache.end();) {  // the weights that are gone
    it = it->second.weight.expired() ? cache.erase(it) : std::next(it);
  }
  const auto found = cache.find(weight.unsafeGetTensorImpl());
  if (found != cache.end() && found->second.version == weight._version()) {
    return found->second.kernel;
  }
  auto kernel = transform_kernel(weight);
  if (prepacked_convolution()) {
    kernel = at::mkldnn_reorder_conv2d_weight(kernel.to_mkldnn(), {0, 0}, {1, 1}, {1, 1},
                                              kPoints, input_size);
  }
  cache.insert_or_assign(weight.unsafeGetTensorImpl(),
                         Transformed{c10::weak_intrusive_ptr<c10::TensorImpl,
                                                             c10::UndefinedTensorImpl>(
                                         weight.getIntrusivePtr()),
                                     weight._version(), kernel});
  return kernel;
}

// The 36 products: transformed [1, 36 * C, tiles, 1] by kernel, one group per point.
at::Tensor products(const at::Tensor& transformed, const at::Tensor& kernel) {
  if (const auto* op = prepacked_convolution()) {
    torch::jit::Stack stack{transformed,
                            kernel,
                            c10::IValue(),
                            std::vector<int64_t>{0, 0},
                            std::vector<int64_t>{1, 1},
                            std::vector<int64_t>{1, 1},
                            kPoints,
                            std::string("none"),
                            c10::List<std::optional<at::Scalar>>(),
                            c10::IValue()};
    op->callBoxed(&stack);
    return stack[0].toTensor().contiguous(at::MemoryFormat::ChannelsLast);
  }
  return at::conv2d(transformed, kernel, /*bias=*/{}, /*stride=*/at::IntArrayRef{1, 1},
                    /*padding=*/at::IntArrayRef{0, 0}, /*dilation=*/at::IntArrayRef{1, 1},
                    kPoints)
      .contiguous(at::MemoryFormat::ChannelsLast);
}

// f(tile, image, tile row, tile column) for every output tile of every image, in parallel;
// tiles are numbered image by image, row by row.
template <typename F>
void for_each_tile(int64_t images, int64_t rows, int64_t cols, const F& f) {
  const int64_t per_image = rows * cols;
  at::parallel_for(0, images * per_image, 1, [&](int64_t begin, int64_t end) {
    for (int64_t tile = begin; tile < end; ++tile) {
      f(tile, tile / per_image, tile % per_image / cols, tile % cols);
    }
  });
}

at::Tensor conv3x3(const at::Tensor& input, const at::Tensor& weight, const at::Tensor& bias,
                   bool relu) {
  BLADESMITH_CHECK_TYPE(input.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                            bias.scalar_type() == at::kFloat,
                        "bladesmith::winograd_conv3x3 computes in float32, got ",
                        input.scalar_type(), ", ", weight.scalar_type(), " and ",
                        bias.scalar_type());
  BLADESMITH_CHECK_VALUE(input.dim() == 4, "bladesmith::winograd_conv3x3: expected a 4-D input "
                         "[N, C, H, W], got shape ", input.sizes());
  const int64_t batch = input.size(0), channels = input.size(1);
  const int64_t height = input.size(2), width = input.size(3);
  BLADESMITH_CHECK_VALUE(weight.dim() == 4 && weight.size(1) == channels && weight.size(2) == 3 &&
                             weight.size(3) == 3,
                         "bladesmith::winograd_conv3x3: expected a weight [K, ", channels,
                         ", 3, 3], got shape ", weight.sizes());
  const int64_t out_channels = weight.size(0);
  BLADESMITH_CHECK_VALUE(bias.numel() == out_channels, "bladesmith::winograd_conv3x3: expected ",
                         out_channels, " bias values, got ", bias.numel());
  const int64_t rows = (height + kOut - 1) / kOut, cols = (width + kOut - 1) / kOut;
  const int64_t tiles = batch * rows * cols;
  const auto x = input.contiguous(at::MemoryFormat::ChannelsLast);
  const auto b = bias.contiguous();
  auto transformed = at::empty({1, kPoints * channels, tiles, 1},
                               input.options().memory_format(at::MemoryFormat::ChannelsLast));
  const float* xs = x.data_ptr<float>();
  float* vs = transformed.data_ptr<float>();
  for_each_tile(batch, rows, cols, [&](int64_t tile, int64_t image, int64_t r, int64_t c) {
    for (int64_t c0 = 0; c0 < channels; c0 += kBlock) {
      input_tile(xs + image * height * width * channels, height, width, channels,
                 r * kOut - 1, c * kOut - 1, c0, std::min(kBlock, channels - c0),
                 vs + tile * kPoints * channels);
    }
  });
  const auto m = products(transformed, transformed_kernel(weight, transformed.sizes()));
  auto output = at::empty({batch, out_channels, height, width},
                          input.options().memory_format(at::MemoryFormat::ChannelsLast));
  const float* ms = m.data_ptr<float>();
  const float* bs = b.data_ptr<float>();
  float* ys = output.data_ptr<float>();
  for_each_tile(batch, rows, cols, [&](int64_t tile, int64_t image, int64_t r, int64_t c) {
    for (int64_t k0 = 0; k0 < out_channels; k0 += kBlock) {
      output_tile(ms + tile * kPoints * out_channels, out_channels, bs, relu, height, width,
                  out_channels, r * kOut, c * kOut, k0, std::min(kBlock, out_channels - k0),
                  ys + image * height * width * out_channels);
    }
  });
  return output;
}

}  // namespace

TORCH_LIBRARY_IMPL(bladesmith, CPU, m) { m.impl("winograd_conv3x3", &conv3x3); }

}  // namespace bladesmith
