// Rotary embedding (rotate-half layout) of a step's queries or keys, for eager steps: PyTorch runs
// it as seven passes (two halves times cos and sin, a difference, a sum, a concatenation), a
// visible share of an eager prompt step. Here one pass reads each head once and writes it rotated,
// in float32. Compiled graphs call it too, so that eager and compiled steps round alike.
//
// rotary_write_kv does an eager attention layer's whole way from its fused q/k/v projection to the
// cache in one call: q and k rotated, k and v converted to the cache's dtype and written to their
// slots. Separately that is ten ops (a split, three reshapes, two rotations, two conversions, two
// index copies), whose dispatch costs a decode step of a small model more than their arithmetic.
// Eager steps only: a compiled graph fuses those ops itself.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

// Head `a` of dim values rotated into y, with the token's tables c and s (dim / 2 each): in float32,
// rounded to T as y is stored
template <typename T>
inline void rotate_head(const T* a, const T* c, const T* s, T* y, int64_t half) {
  using namespace simd;
  for (int64_t i = 0; i < half; i += kWidth) {
    const Vec first = load(a + i), second = load(a + half + i);
    const Vec cv = load(c + i), sv = load(s + i);
    store(y + i, fnmadd(second, sv, mul(first, cv)));
    store(y + half + i, fmadd(first, sv, mul(second, cv)));
  }
}

void check_tables(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t tokens, int64_t dim,
                  const char* op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, op, ": x must be float32 or bfloat16");
  TORCH_CHECK(dim % (2 * simd::kWidth) == 0, op, ": the head dimension must be a multiple of ", 2 * simd::kWidth);
  for (const at::Tensor* table : {&cos, &sin}) {
    TORCH_CHECK(table->scalar_type() == x.scalar_type() && table->is_contiguous() && table->numel() == tokens * dim / 2,
                op, ": cos and sin must be contiguous (tokens, 1, dim / 2) tables of x's dtype");
  }
}

// Calls f(x, cos, sin) with x's element type (float32 or bf16)
template <typename F>
void with_dtype(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const F& f) {
  if (x.scalar_type() == at::kFloat) {
    f(x.data_ptr<float>(), cos.data_ptr<float>(), sin.data_ptr<float>());
  } else {
    f(x.data_ptr<at::BFloat16>(), cos.data_ptr<at::BFloat16>(), sin.data_ptr<at::BFloat16>());
  }
}

// Row `from` (n values of T) converted into the cache's C, as Tensor.to rounds (to nearest even)
template <typename C, typename T>
inline void convert_row(const T* from, C* to, int64_t n) {
  for (int64_t i = 0; i < n; ++i) to[i] = static_cast<C>(static_cast<float>(from[i]));
}

}  // namespace

namespace tokenmill {

// x (tokens, heads, dim) with contiguous heads (a fused projection's output may be a strided view);
// cos, sin (tokens, 1, dim / 2) contiguous, of x's dtype; the result is contiguous
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rotary: x must be (tokens, heads, dim) with contiguous heads");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  check_tables(x, cos, sin, tokens, dim, "rotary");
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t row_stride = x.stride(0), grain = simd::rows_per_task(heads * dim);
  with_dtype(x, cos, sin, [&](const auto* in, const auto* c, const auto* s) {
    auto* o = static_cast<std::remove_const_t<std::remove_reference_t<decltype(*in)>>*>(out.data_ptr());
    at::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < heads; ++h)
          rotate_head(in + t * row_stride + h * dim, c + t * half, s + t * half, o + (t * heads + h) * dim, half);
    });
  });
  return out;
}

// qkv (tokens, (heads + 2 kv_heads) x dim): a step's fused q, k, v projection, rows with contiguous
// columns; cos, sin as for rotary; caches (slots, kv_heads, dim) contiguous, float32, float16 or
// bf16; slots (tokens) int64: where each token's k and v go. Writes k rotated and v, each rounded
// first to x's dtype (as rotary returns them) and then to the cache's, and returns q rotated
// (tokens, heads, dim), contiguous: the same values as rotary, Tensor.to and index_copy_.
at::Tensor rotary_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slots, int64_t heads) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rotary_write_kv: qkv must be (tokens, width) with contiguous rows");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.is_contiguous() && v_cache.scalar_type() == k_cache.scalar_type(),
              "rotary_write_kv: the caches must be contiguous (slots, kv_heads, dim) tensors of one dtype");
  const int64_t tokens = qkv.size(0), kv_heads = k_cache.size(1), dim = k_cache.size(2), half = dim / 2;
  TORCH_CHECK(qkv.size(1) == (heads + 2 * kv_heads) * dim,
              "rotary_write_kv: qkv's width must be (heads + 2 kv_heads) x the caches' head dimension");
  TORCH_CHECK(slots.dim() == 1 && slots.size(0) == tokens && slots.scalar_type() == at::kLong && slots.is_contiguous(),
              "rotary_write_kv: slots must be contiguous int64 (tokens)");
  check_tables(qkv, cos, sin, tokens, dim, "rotary_write_kv");
  const at::ScalarType cache_type = k_cache.scalar_type();
  TORCH_CHECK(cache_type == at::kFloat || cache_type == at::kHalf || cache_type == at::kBFloat16,
              "rotary_write_kv: the caches must be float32, float16 or bfloat16");
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "rotary_write_kv: slot ", slot[t], " is outside the cache");
  at::Tensor q = at::empty({tokens, heads, dim}, qkv.options());
  const int64_t row_stride = qkv.stride(0), kv_row = kv_heads * dim;
  const int64_t grain = simd::rows_per_task(qkv.size(1));
  with_dtype(qkv, cos, sin, [&](const auto* in, const auto* c, const auto* s) {
    using T = std::remove_const_t<std::remove_reference_t<decltype(*in)>>;
    T* out = static_cast<T*>(q.data_ptr());
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, cache_type, "rotary_write_kv", [&] {
      scalar_t* keys = k_cache.data_ptr<scalar_t>();
      scalar_t* values = v_cache.data_ptr<scalar_t>();
      at::parallel_for(0, tokens, grain, [&](int64_t t0, int64_t t1) {
        std::vector<T> rotated(dim);
        for (int64_t t = t0; t < t1; ++t) {
          const T* row = in + t * row_stride;
          const T *ct = c + t * half, *st = s + t * half;
          for (int64_t h = 0; h < heads; ++h) rotate_head(row + h * dim, ct, st, out + (t * heads + h) * dim, half);
          scalar_t* key_row = keys + slot[t] * kv_row;
          for (int64_t h = 0; h < kv_heads; ++h) {
            if constexpr (std::is_same_v<scalar_t, T>) {
              rotate_head(row + (heads + h) * dim, ct, st, key_row + h * dim, half);
            } else {
              rotate_head(row + (heads + h) * dim, ct, st, rotated.data(), half);
              convert_row(rotated.data(), key_row + h * dim, dim);
            }
          }
          convert_row(row + (heads + kv_heads) * dim, values + slot[t] * kv_row, kv_row);
        }
      });
    });
  });
  return q;
}

}  // namespace tokenmill
