// Greedy sampling: the index of each row's highest logit; random sampling: the token at which each
// row's cumulative softmax first exceeds its uniform draw.
//
// PyTorch's max(dim=-1) with indices runs scalar code, a visible share of a decode step with a
// large vocabulary; here a vectorized pass finds the maximum and one its first position. Sampling
// with tensor ops (divide, softmax, cumsum) allocates a fresh tensor of the batch's logits for
// each; here three passes over each row allocate nothing.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "ops.h"
#include "simd.h"

namespace {

// The first index of x's highest value (of its first NaN, if any: torch.max's answer)
template <typename T>
int64_t row_argmax(const T* x, int64_t n) {
  using namespace simd;
  const int64_t full = n - n % kWidth;
  Vec best = set1(-std::numeric_limits<float>::infinity()), poison = zero();
  for (int64_t i = 0; i < full; i += kWidth) {
    const Vec v = load(x + i);
    best = max(best, v);
    poison = add(poison, sub(v, v));  // NaN from a NaN (or an infinity) on
  }
  float top = max_of(best);
  bool finite = !std::isnan(sum(poison));
  for (int64_t i = full; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    top = std::max(top, v);
    finite &= std::isfinite(v);
  }
  if (!finite) {  // the rare row with a non-finite value: a NaN is the answer
    for (int64_t i = 0; i < n; ++i)
      if (std::isnan(static_cast<float>(x[i]))) return i;
  }
  const Vec wanted = set1(top);
  for (int64_t i = 0; i < full; i += kWidth) {
    const uint32_t lanes = equal_lanes(load(x + i), wanted);
    if (lanes != 0) return i + __builtin_ctz(lanes);
  }
  for (int64_t i = full; i < n; ++i)
    if (static_cast<float>(x[i]) == top) return i;
  return 0;  // an empty row
}

template <typename T>
void argmax_rows(const at::Tensor& logits, at::Tensor& out) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const T* x = logits.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = row_argmax(x + r * n, n);
  });
}

// The index at which the running sum of exp((x - top) * inverse_temperature) over x > -inf first
// exceeds u times its total (u in [0, 1)): token i with probability softmax(x * inverse_temperature)_i.
// Tokens at -inf (filtered out) weigh exactly 0; a row whose sums round short of the threshold takes
// its last token of positive weight. A row without a finite maximum (all -inf, or a NaN) takes its
// argmax, which the sampler reports as unusable.
template <typename T>
int64_t row_sample(const T* x, int64_t n, float inverse_temperature, float u) {
  using namespace simd;
  const int64_t full = n - n % kWidth;
  Vec best = set1(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < full; i += kWidth) best = max(best, load(x + i));
  float top = max_of(best);
  for (int64_t i = full; i < n; ++i) top = std::max(top, static_cast<float>(x[i]));
  if (!std::isfinite(top)) return row_argmax(x, n);
  const float floor_value = -std::numeric_limits<float>::infinity();
  const Vec scale = set1(inverse_temperature), shift = set1(top * inverse_temperature), floor = set1(floor_value);
  const auto weights = [&](const T* p) {  // of kWidth logits
    const Vec v = load(p);
    return keep_greater(exp(sub(mul(v, scale), shift)), v, floor);
  };
  const auto weight = [&](int64_t i) {
    const float v = static_cast<float>(x[i]);
    return v > floor_value ? std::exp(v * inverse_temperature - top * inverse_temperature) : 0.0f;
  };
  Vec lanes = zero();
  for (int64_t i = 0; i < full; i += kWidth) lanes = add(lanes, weights(x + i));
  float total = sum(lanes);
  for (int64_t i = full; i < n; ++i) total += weight(i);
  const float threshold = u * total;
  float running = 0.0f;
  for (int64_t i = 0; i < full; i += kWidth) {
    const Vec w = weights(x + i);
    const float block = sum(w);
    if (running + block <= threshold) {
      running += block;
      continue;
    }
    alignas(64) float values[kWidth];
    store(values, w);
    for (int j = 0; j < kWidth; ++j) {
      running += values[j];
      if (values[j] > 0.0f && running > threshold) return i + j;
    }
  }
  for (int64_t i = full; i < n; ++i) {
    const float w = weight(i);
    running += w;
    if (w > 0.0f && running > threshold) return i;
  }
  for (int64_t i = n - 1; i > 0; --i)  // the sums fell short by rounding: the last token of positive weight
    if (weight(i) > 0.0f) return i;
  return 0;
}

template <typename T>
void sample_rows(const at::Tensor& logits, const float* inverse_temperature, const float* uniforms, at::Tensor& out) {
  const int64_t rows = logits.size(0), n = logits.size(1);
  const T* x = logits.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) o[r] = row_sample(x + r * n, n, inverse_temperature[r], uniforms[r]);
  });
}

}  // namespace

namespace tokenmill {

at::Tensor sample_ids(const at::Tensor& logits, const at::Tensor& inverse_temperature, const at::Tensor& uniforms) {
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "sample_ids: logits must be a 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(logits.size(1) > 0, "sample_ids: logits must have at least one column");
  const int64_t rows = logits.size(0);
  TORCH_CHECK(inverse_temperature.scalar_type() == at::kFloat && inverse_temperature.numel() == rows &&
                  uniforms.scalar_type() == at::kFloat && uniforms.numel() == rows,
              "sample_ids: inverse_temperature and uniforms must hold one float32 per row");
  const at::Tensor x = logits.contiguous(), t = inverse_temperature.contiguous(), u = uniforms.contiguous();
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) sample_rows<float>(x, t.data_ptr<float>(), u.data_ptr<float>(), out);
  else sample_rows<at::BFloat16>(x, t.data_ptr<float>(), u.data_ptr<float>(), out);
  return out;
}

at::Tensor greedy_ids(const at::Tensor& logits) {
  TORCH_CHECK(logits.dim() == 2 && (logits.scalar_type() == at::kFloat || logits.scalar_type() == at::kBFloat16),
              "greedy_ids: logits must be a 2-D float32 or bfloat16 tensor");
  TORCH_CHECK(logits.size(1) > 0, "greedy_ids: logits must have at least one column");
  const at::Tensor x = logits.contiguous();
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  if (x.scalar_type() == at::kFloat) argmax_rows<float>(x, out);
  else argmax_rows<at::BFloat16>(x, out);
  return out;
}

// Sets to -inf, in place, the logits of float32 row rows[i] whose bit in row i of the int32 bitmask
// bits is clear (bit b of word w: token 32 w + b; tokens past the words count as clear). One pass
// over each row's words: a tensor expansion of the bits to the vocabulary costs ~15x as long.
void ban_disallowed_(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "ban_disallowed_: logits must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && bits.scalar_type() == at::kInt &&
                  bits.dim() == 2 && bits.size(0) == rows.size(0),
              "ban_disallowed_: rows must be int64 (R) and bits int32 (R, words)");
  const int64_t n = logits.size(1), words = bits.size(1);
  const at::Tensor r = rows.contiguous(), b = bits.contiguous();
  const int64_t* row_ids = r.data_ptr<int64_t>();
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(b.data_ptr<int32_t>());
  float* x = logits.data_ptr<float>();
  const float banned = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < r.size(0); ++i) {
    TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < logits.size(0), "ban_disallowed_: a row is out of range");
  }
  at::parallel_for(0, r.size(0), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* row = x + row_ids[i] * n;
      for (int64_t w = 0; w * 32 < n; ++w) {
        const uint32_t allowed = w < words ? mask[i * words + w] : 0;
        if (allowed == 0xFFFFFFFFu) continue;
        float* part = row + w * 32;
        const int64_t count = std::min<int64_t>(32, n - w * 32);
        if (allowed == 0) {  // most words of a grammar's mask: nothing allowed
          std::fill_n(part, count, banned);
        } else if (count == 32) {  // branch-free: the bits of a word are as good as random
          for (int j = 0; j < 32; ++j) part[j] = (allowed >> j) & 1u ? part[j] : banned;
        } else {
          for (int64_t j = 0; j < count; ++j) part[j] = (allowed >> j) & 1u ? part[j] : banned;
        }
      }
    }
  });
}

}  // namespace tokenmill
