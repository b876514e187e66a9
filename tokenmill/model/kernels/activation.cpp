// Gated activations of a fused gate/up projection, act(gate) * up, in one pass on CPU.
//
// Eagerly PyTorch runs gelu(gate), then the product: two passes over strided halves, and its bf16
// tanh-GELU runs at scalar speed. Both activations are x * sigmoid(a): a = x for SiLU,
// a = 2 sqrt(2/pi) (x + 0.044715 x^3) for tanh-GELU, computed in fp32 with one rounding of the
// result. Compiled graphs fuse this themselves.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <string_view>

#include "ops.h"
#include "simd.h"

namespace {

template <bool Gelu>
inline simd::Vec gated(simd::Vec g, simd::Vec up) {
  using namespace simd;
  Vec a = g;  // silu(g) = g * sigmoid(g); gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))
  if (Gelu) a = mul(fmadd(mul(mul(g, g), g), set1(0.044715f), g), set1(1.5957691216057308f));
  return mul(div(g, add(set1(1.0f), exp(sub(zero(), a)))), up);
}

template <bool Gelu, typename T>
void gated_rows(const T* in, T* out, int64_t width, int64_t r0, int64_t r1) {
  constexpr int64_t n = simd::kWidth;
  const int64_t full = width - width % n;
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = in + r * 2 * width;
    const T* up = gate + width;
    T* y = out + r * width;
    for (int64_t j = 0; j < full; j += n) simd::store(y + j, gated<Gelu>(simd::load(gate + j), simd::load(up + j)));
    if (full < width) {  // the row's last partial vector, through zero-padded copies
      T g[n] = {}, u[n] = {}, part[n];
      std::copy(gate + full, gate + width, g);
      std::copy(up + full, up + width, u);
      simd::store(part, gated<Gelu>(simd::load(g), simd::load(u)));
      std::copy(part, part + (width - full), y + full);
    }
  }
}

}  // namespace

namespace tokenmill {

at::Tensor gated_activation(const at::Tensor& gate_up, std::string_view kind) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gated_activation: expected a contiguous (tokens, 2 * width) tensor");
  TORCH_CHECK(kind == "silu" || kind == "gelu_tanh", "gated_activation: unknown activation ", kind);
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const bool gelu = kind == "gelu_tanh";
  const int64_t grain = simd::rows_per_task(width);
  AT_DISPATCH_SWITCH(gate_up.scalar_type(), "gated_activation",
    AT_DISPATCH_CASE(at::kBFloat16, [&] {
      const auto* in = gate_up.data_ptr<at::BFloat16>(); auto* o = out.data_ptr<at::BFloat16>();
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
        gelu ? gated_rows<true>(in, o, width, r0, r1) : gated_rows<false>(in, o, width, r0, r1);
      });
    })
    AT_DISPATCH_CASE(at::kFloat, [&] {
      const auto* in = gate_up.data_ptr<float>(); auto* o = out.data_ptr<float>();
      at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
        gelu ? gated_rows<true>(in, o, width, r0, r1) : gated_rows<false>(in, o, width, r0, r1);
      });
    }));
  return out;
}

}  // namespace tokenmill
