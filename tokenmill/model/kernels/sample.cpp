// Greedy sampling: the index of each row's highest logit.
//
// PyTorch's max(dim=-1) with indices runs scalar code: 6.9 ms for a decode step's 32 rows of Gemma 3's
// 262k logits (2 threads, Ice Lake Xeon), ~9% of the step, where a vectorized pass for the maximum
// and one for its first position take ~1 ms.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>

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

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) { m.def("greedy_ids(Tensor logits) -> Tensor"); }

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("greedy_ids", &greedy_ids); }
