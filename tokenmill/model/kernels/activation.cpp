// Gated activations of a fused gate/up projection, act(gate) * up, in one pass on CPU.
//
// Eagerly PyTorch runs gelu(gate), then the product: two passes over strided halves, and its bf16
// tanh-GELU is scalar-speed (1.2 ms for a 512 x 2048 prompt chunk of Gemma 3, against 0.24 ms here).
// Both activations are x * sigmoid(a): a = x for SiLU, a = 2 sqrt(2/pi) (x + 0.044715 x^3) for
// tanh-GELU, computed in fp32 with one rounding of the result. Compiled graphs fuse this themselves.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <string_view>

namespace {

// exp(x) for x in about [-87, 88]: 2^n * p(r), r = x - n ln2, |r| <= ln2/2 (rel. error ~2e-7).
inline __m512 exp_ps(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147180559945309f), x);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline void store16(at::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }

template <bool Gelu, typename T>
void gated_rows(const T* in, T* out, int64_t width, int64_t r0, int64_t r1) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t r = r0; r < r1; ++r) {
    const T* gate = in + r * 2 * width;
    const T* up = gate + width;
    T* y = out + r * width;
    for (int64_t j = 0; j < width; j += 16) {
      const __mmask16 m = width - j >= 16 ? 0xFFFF : (__mmask16)((1u << (width - j)) - 1);
      const __m512 g = load16(gate + j, m);
      __m512 a = g;  // silu(g) = g * sigmoid(g); gelu_tanh(g) = g * sigmoid(2 sqrt(2/pi) (g + 0.044715 g^3))
      if (Gelu) {
        const __m512 g3 = _mm512_mul_ps(_mm512_mul_ps(g, g), g);
        a = _mm512_mul_ps(_mm512_fmadd_ps(g3, _mm512_set1_ps(0.044715f), g), _mm512_set1_ps(1.5957691216057308f));
      }
      const __m512 act = _mm512_div_ps(g, _mm512_add_ps(one, exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), a))));
      store16(y + j, _mm512_mul_ps(act, load16(up + j, m)), m);
    }
  }
}

at::Tensor gated_activation(const at::Tensor& gate_up, std::string_view kind) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.is_contiguous() && gate_up.size(1) % 2 == 0,
              "gated_activation: expected a contiguous (tokens, 2 * width) tensor");
  TORCH_CHECK(kind == "silu" || kind == "gelu_tanh", "gated_activation: unknown activation ", kind);
  const int64_t rows = gate_up.size(0), width = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, width}, gate_up.options());
  const bool gelu = kind == "gelu_tanh";
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));
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
}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) { m.def("gated_activation(Tensor gate_up, str kind) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("gated_activation", &gated_activation); }
