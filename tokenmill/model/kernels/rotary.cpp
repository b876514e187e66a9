// Rotary embedding (rotate-half layout) of a step's queries or keys, for eager steps: PyTorch runs
// it as seven passes (two halves times cos and sin, a difference, a sum, a concatenation), a
// visible share of an eager prompt step. Here one pass reads each head once and writes it rotated,
// in float32 as a compiled graph computes it. Compiled graphs fuse this themselves.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "simd.h"

namespace {

// x (tokens, heads, dim) with contiguous heads (a fused projection's output may be a strided view);
// cos, sin (tokens, 1, dim / 2) contiguous, of x's dtype; the result is contiguous
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: x must be (tokens, heads, dim) with contiguous heads");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "rotary: x must be float32 or bfloat16");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(dim % (2 * simd::kWidth) == 0, "rotary: the head dimension must be a multiple of ", 2 * simd::kWidth);
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == x.scalar_type() && table->is_contiguous() && table->numel() == tokens * half,
                "rotary: cos and sin must be contiguous (tokens, 1, dim / 2) tables of x's dtype");
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t row_stride = x.stride(0), grain = simd::rows_per_task(heads * dim);
  const auto run = [&](const auto* in, const auto* c, const auto* s, auto* o) {
    using namespace simd;
    at::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t h = 0; h < heads; ++h) {
          const auto* a = in + t * row_stride + h * dim;
          auto* y = o + (t * heads + h) * dim;
          for (int64_t i = 0; i < half; i += kWidth) {
            const Vec first = load(a + i), second = load(a + half + i);
            const Vec cv = load(c + t * half + i), sv = load(s + t * half + i);
            store(y + i, fnmadd(second, sv, mul(first, cv)));
            store(y + half + i, fmadd(first, sv, mul(second, cv)));
          }
        }
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>(), out.data_ptr<float>());
  } else {
    run(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>(),
        out.data_ptr<at::BFloat16>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) { m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("rotary", &rotary); }
