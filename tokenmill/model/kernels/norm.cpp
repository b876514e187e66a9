// RMSNorm of rows, for eager steps: PyTorch runs it as six passes over the activations (pow, mean,
// add, rsqrt, two products), a visible share of an eager prompt step of a small model. Here one
// pass sums the squares and one writes the scaled rows, in float32 as the model's RMSNorm computes
// (float32 or bfloat16 weights, widened).
// Compiled graphs fuse this themselves.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <cmath>

#include "ops.h"
#include "simd.h"

namespace {

template <typename T, typename W>
void norm_row(const T* x, const W* weight, T* y, int64_t dim, float eps) {
  using namespace simd;
  Vec a = zero(), b = zero();
  int64_t i = 0;
  for (; i + 2 * kWidth <= dim; i += 2 * kWidth) {
    const Vec u = load(x + i), v = load(x + i + kWidth);
    a = fmadd(u, u, a);
    b = fmadd(v, v, b);
  }
  if (i < dim) {
    const Vec u = load(x + i);
    a = fmadd(u, u, a);
  }
  const Vec scale = set1(1.0f / std::sqrt(sum(add(a, b)) / static_cast<float>(dim) + eps));
  for (int64_t j = 0; j < dim; j += kWidth) store(y + j, mul(mul(load(x + j), scale), load(weight + j)));
}

}  // namespace

namespace tokenmill {

// x (rows, dim) or (rows, heads, dim) with contiguous last dimension (the heads of a fused projection's
// output may be a strided view); the result is contiguous, in x's dtype
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1 && (x.dim() == 2 || x.stride(1) == x.size(2)),
              "rms_norm: x must be (rows, dim) or (rows, heads, dim) with contiguous heads");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "rms_norm: x must be float32 or bfloat16");
  const int64_t dim = x.size(-1), rows = x.size(0), heads = x.dim() == 3 ? x.size(1) : 1;
  TORCH_CHECK(dim % simd::kWidth == 0, "rms_norm: the dimension must be a multiple of ", simd::kWidth);
  TORCH_CHECK((weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16) &&
                  weight.is_contiguous() && weight.numel() == dim,
              "rms_norm: weight must be contiguous float32 or bfloat16 of x's last dimension");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t row_stride = x.stride(0), grain = simd::rows_per_task(heads * dim);
  const auto run = [&](auto* in, auto* o, auto* w) {
    at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t h = 0; h < heads; ++h)
          norm_row(in + r * row_stride + h * dim, w, o + (r * heads + h) * dim, dim, static_cast<float>(eps));
    });
  };
  const auto with_weight = [&](auto* in, auto* o) {
    if (weight.scalar_type() == at::kFloat) run(in, o, weight.data_ptr<float>());
    else run(in, o, weight.data_ptr<at::BFloat16>());
  };
  if (x.scalar_type() == at::kFloat) with_weight(x.data_ptr<float>(), out.data_ptr<float>());
  else with_weight(x.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>());
  return out;
}

}  // namespace tokenmill
