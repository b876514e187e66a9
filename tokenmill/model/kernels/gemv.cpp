// Weight-only quantized matrix products whose means depend on the number of activation rows, on CPU.
//
// A decode step reads every weight once per token, so it runs at the speed the weight bytes stream
// from memory. PyTorch's `_weight_int8pack_mm` streams them at ~10 GB/s on a 2-core AVX-512 machine
// whose memory gives ~30; this kernel reaches ~25: each output row is one pass over its int8 row,
// widened to fp32 and multiplied with the (fp32) activations by FMAs (simd.h). Rows are split across
// PyTorch's intra-op threads, and up to 4 activation rows share each widened weight vector.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kRowsPerTask = 16;
constexpr int kMaxActivationRows = 4;

template <int M>
void int8_rows(const float* x, int64_t K, const int8_t* weight, const at::BFloat16* scale, at::BFloat16* y,
               int64_t N, int64_t row0, int64_t row1) {
  using namespace simd;
  for (int64_t o = row0; o < row1; ++o) {
    const int8_t* row = weight + o * K;
    Vec acc[M][2];
    for (int i = 0; i < M; ++i) acc[i][0] = acc[i][1] = zero();
    for (int64_t k = 0; k < K; k += 2 * kWidth) {  // K is a multiple of 32, two vectors or more
      const Vec w0 = load(row + k), w1 = load(row + k + kWidth);
      for (int i = 0; i < M; ++i) {
        acc[i][0] = fmadd(w0, load(x + i * K + k), acc[i][0]);
        acc[i][1] = fmadd(w1, load(x + i * K + k + kWidth), acc[i][1]);
      }
    }
    const float s = static_cast<float>(scale[o]);
    for (int i = 0; i < M; ++i) y[i * N + o] = at::BFloat16(sum(add(acc[i][0], acc[i][1])) * s);
  }
}

// y = x W^T * scale, for x (M, K) bfloat16, W (N, K) int8 and scale (N) bfloat16 (one per row).
at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_gemv: x must be a 2-D bfloat16 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_gemv: the weight must be a contiguous 2-D int8 tensor");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(x.size(1) == K && K % 32 == 0, "int8_gemv: x's width must equal the weight's, a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == at::kBFloat16 && scale.numel() == N && scale.is_contiguous(),
              "int8_gemv: scale must hold one contiguous bfloat16 per weight row");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  std::vector<float> xf(M * K);  // widened once here: a tensor op would cost more than it saves
  const at::Tensor xc = x.contiguous();
  const at::BFloat16* xs = xc.data_ptr<at::BFloat16>();
  for (int64_t i = 0; i < M * K; ++i) xf[i] = static_cast<float>(xs[i]);
  const int8_t* w = weight.data_ptr<int8_t>();
  const at::BFloat16* s = scale.data_ptr<at::BFloat16>();
  for (int64_t m0 = 0; m0 < M; m0 += kMaxActivationRows) {
    const int64_t rows = std::min<int64_t>(kMaxActivationRows, M - m0);
    const float* xp = xf.data() + m0 * K;
    at::BFloat16* yp = y.data_ptr<at::BFloat16>() + m0 * N;
    at::parallel_for(0, N, kRowsPerTask, [&](int64_t r0, int64_t r1) {
      switch (rows) {
        case 1: int8_rows<1>(xp, K, w, s, yp, N, r0, r1); break;
        case 2: int8_rows<2>(xp, K, w, s, yp, N, r0, r1); break;
        case 3: int8_rows<3>(xp, K, w, s, yp, N, r0, r1); break;
        default: int8_rows<4>(xp, K, w, s, yp, N, r0, r1); break;
      }
    });
  }
  return y;
}

// The same product for any number of rows, by the fastest means at hand for that number: the
// kernel above for a few rows (bound by weight bytes), else a bf16 matmul (bound by arithmetic) with
// the layer's dense copy, or with bf16 chunks of the int8 rows dequantized one at a time (a large
// output head keeps no dense copy). Deciding here, at run time, lets one compiled graph serve every
// batch size without a guard on it.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& dense, int64_t max_gemv_rows) {
  if (x.size(0) <= max_gemv_rows) return int8_gemv(x, weight, scale);
  if (dense.has_value()) return at::linear(x, *dense);
  constexpr int64_t kChunkRows = 8192;  // 10 MB of bf16 for a 640-wide head: stays in cache
  const int64_t N = weight.size(0);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  for (int64_t r0 = 0; r0 < N; r0 += kChunkRows) {
    const int64_t r1 = std::min(N, r0 + kChunkRows);
    at::Tensor part = y.narrow(1, r0, r1 - r0);
    at::mm_out(part, x, weight.slice(0, r0, r1).to(x.scalar_type()).t());  // int8 values are exact in bf16
  }
  return y.mul_(scale);
}

// The int4 counterpart (PyTorch's packed kernel below the crossover, the dense copy above it):
// written here only so that the choice is made at run time, inside one compiled graph.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                       int64_t group_size, const c10::optional<at::Tensor>& dense, int64_t max_packed_rows) {
  if (x.size(0) <= max_packed_rows || !dense.has_value())
    return at::_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_zeros);
  return at::linear(x, *dense);
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_zeros, int group_size, Tensor? dense, "
        "int max_packed_rows) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? dense, int max_gemv_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
}
