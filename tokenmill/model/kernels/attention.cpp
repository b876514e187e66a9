// Decode attention over the paged KV cache: one query token per sequence, each attending to the
// cache rows its slot table names.
//
// A compiled graph's own version (broadcast products and sums, `_fused_decode_attention`) spends
// most of a small model's decode step outside the matmuls: its reductions run one after another in
// `omp single` sections, and its value sum walks the context once per 8 output lanes. Here a task
// takes one chunk of a sequence's context for one KV head (see `run`): scores by dot products, a
// max-subtracted exp and the value rows summed in fp32, each row read from memory once. A float32
// model's cache may hold float16 or bfloat16 rows, widened as they are loaded: a decode step of many
// sequences reads the whole cache, and half the bytes made SmolLM2's 16-21% faster.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "simd.h"

namespace {

constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kChunk = 64;  // context positions per task
static_assert(kChunk % simd::kWidth == 0, "a chunk's scores are padded to whole vectors within it");

template <typename T>
float dot(const float* q, const T* k, int64_t dim) {
  using namespace simd;
  Vec a = zero(), b = zero();
  int64_t i = 0;
  for (; i + 2 * kWidth <= dim; i += 2 * kWidth) {
    a = fmadd(load(q + i), load(k + i), a);
    b = fmadd(load(q + i + kWidth), load(k + i + kWidth), b);
  }
  if (i < dim) a = fmadd(load(q + i), load(k + i), a);
  return sum(add(a, b));
}

// The dot products of q with kWidth rows, as one vector
template <typename T>
simd::Vec dots(const float* q, const T* base, const int64_t* rows, int64_t row_stride, int64_t dim) {
  using namespace simd;
  Vec acc[kWidth];
  const T* k[kWidth];
  for (int r = 0; r < kWidth; ++r) {
    acc[r] = zero();
    k[r] = base + rows[r] * row_stride;
  }
  for (int64_t i = 0; i < dim; i += kWidth) {
    const Vec qv = load(q + i);
    for (int r = 0; r < kWidth; ++r) acc[r] = fmadd(qv, load(k[r] + i), acc[r]);
  }
  return transposed_sums(acc);
}

// acc[0:N vectors] = sum_j probs[j] * rows[j][0:N vectors], the sums held in registers
template <int N, typename T>
void weighted_rows(const float* probs, const T* base, const int64_t* rows, int64_t count, int64_t row_stride,
                   float* acc) {
  using namespace simd;
  Vec a[N];
  for (int i = 0; i < N; ++i) a[i] = zero();
  for (int64_t j = 0; j < count; ++j) {
    const T* v = base + rows[j] * row_stride;
    const Vec p = set1(probs[j]);
    for (int i = 0; i < N; ++i) a[i] = fmadd(p, load(v + i * kWidth), a[i]);
  }
  for (int i = 0; i < N; ++i) store(acc + i * kWidth, a[i]);
}

// Attention of one query head over one chunk of a sequence's admitted keys (`rows`, `count` > 0 of
// them): the chunk's score maximum, its sum of exp(score - maximum) and the exp-weighted sum of its
// value rows (`acc`), which `merge_chunks` combines across chunks. scores: scratch of count
// rounded up to kWidth.
template <typename T, typename C>
void attend_chunk(const T* q_in, const C* k_cache, const C* v_cache, const int64_t* rows, int64_t count,
                  int64_t row_stride, int64_t dim, float scale, std::optional<double> softcap, float* scores,
                  float& top_out, float& total_out, float* acc) {
  using namespace simd;
  float q[kMaxHeadDim];
  for (int64_t i = 0; i < dim; i += kWidth) store(q + i, mul(load(q_in + i), set1(scale)));
  int64_t j = 0;
  for (; j + kWidth <= count; j += kWidth) store(scores + j, dots(q, k_cache, rows + j, row_stride, dim));
  for (; j < count; ++j) scores[j] = dot(q, k_cache + rows[j] * row_stride, dim);
  if (softcap) {
    const float cap = static_cast<float>(*softcap);
    for (int64_t j = 0; j < count; ++j) scores[j] = std::tanh(scores[j] / cap) * cap;
  }
  const int64_t padded = (count + kWidth - 1) / kWidth * kWidth;
  std::fill(scores + count, scores + padded, -std::numeric_limits<float>::infinity());
  Vec top_lanes = set1(-std::numeric_limits<float>::infinity());
  for (int64_t j = 0; j < padded; j += kWidth) top_lanes = max(top_lanes, load(scores + j));
  float lanes[kWidth];
  store(lanes, top_lanes);
  const float top = *std::max_element(lanes, lanes + kWidth);
  Vec total = zero();
  for (int64_t j = 0; j < padded; j += kWidth) {
    const Vec p = exp(sub(load(scores + j), set1(top)));
    store(scores + j, p);
    if (j + kWidth <= count) total = add(total, p);
  }
  float denominator = sum(total);
  for (int64_t j = count / kWidth * kWidth; j < count; ++j) denominator += scores[j];
  for (int64_t c = 0; c < dim; c += 8 * kWidth) {
    switch (std::min<int64_t>(8, (dim - c) / kWidth)) {
      case 8: weighted_rows<8>(scores, v_cache + c, rows, count, row_stride, acc + c); break;
      case 4: weighted_rows<4>(scores, v_cache + c, rows, count, row_stride, acc + c); break;
      case 2: weighted_rows<2>(scores, v_cache + c, rows, count, row_stride, acc + c); break;
      default:
        for (int64_t i = c; i < dim; i += kWidth) weighted_rows<1>(scores, v_cache + i, rows, count, row_stride, acc + i);
    }
  }
  top_out = top;
  total_out = denominator;
}

// out = sum_c exp(top_c - M) acc_c / sum_c exp(top_c - M) total_c over one head's chunks, M their
// largest maximum; chunks without an admitted key (total 0) are left out, zeros if all are.
template <typename T>
void merge_chunks(const float* tops, const float* totals, const float* accs, int64_t chunks, int64_t dim, T* out) {
  using namespace simd;
  const float highest = *std::max_element(tops, tops + chunks);
  float acc[kMaxHeadDim] = {};
  float denominator = 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    if (totals[c] == 0.0f) continue;
    const float w = std::exp(tops[c] - highest);
    denominator += w * totals[c];
    for (int64_t i = 0; i < dim; i += kWidth) store(acc + i, fmadd(set1(w), load(accs + c * dim + i), load(acc + i)));
  }
  const Vec inv = set1(denominator > 0.0f ? 1.0f / denominator : 0.0f);
  for (int64_t i = 0; i < dim; i += kWidth) store(out + i, mul(load(acc + i), inv));
}

// Tasks are (sequence, KV head, chunk of kChunk context positions): the query heads sharing a KV
// head take their turns over the same chunk while its rows are in cache, and a batch of one still
// has tasks for every thread. The chunks' partial results are merged per (sequence, query head).
template <typename T, typename C>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
         const at::Tensor& mask, at::Tensor& out, double scale, std::optional<double> softcap) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), context = slots.size(1);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads, row_stride = kv_heads * dim;
  const int64_t chunks = (context + kChunk - 1) / kChunk;
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  // partial results by (sequence, query head, chunk), each written by its task before it is merged
  const int64_t parts = batch * heads * chunks;
  const at::Tensor partials = at::empty({parts * (dim + 2)}, q.options().dtype(at::kFloat));
  float* tops = partials.data_ptr<float>();
  float* totals = tops + parts;
  float* accs = totals + parts;
  at::parallel_for(0, batch * kv_heads * chunks, 1, [&](int64_t t0, int64_t t1) {
    float scores[kChunk];
    int64_t rows[kChunk];
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / (kv_heads * chunks), g = t / chunks % kv_heads, c = t % chunks;
      const int64_t first = c * kChunk, end = std::min(context, first + kChunk);
      int64_t count = 0;
      for (int64_t j = first; j < end; ++j) {
        rows[count] = sp[b * context + j];
        count += mp[b * context + j];
      }
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const int64_t part = (b * heads + h) * chunks + c;
        tops[part] = -std::numeric_limits<float>::infinity();
        totals[part] = 0.0f;
        if (count == 0) continue;  // merge_chunks leaves the chunk out
        attend_chunk(qp + (b * heads + h) * dim, kp + g * dim, vp + g * dim, rows, count, row_stride, dim,
                     static_cast<float>(scale), softcap, scores, tops[part], totals[part], accs + part * dim);
      }
    }
  });
  at::parallel_for(0, batch * heads, 16, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      merge_chunks(tops + t * chunks, totals + t * chunks, accs + t * chunks * dim, chunks, dim, op + t * dim);
  });
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& mask, double scale,
                            std::optional<double> softcap) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: expected q (batch, heads, head_dim) and caches (slots, kv_heads, head_dim)");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim && heads % kv_heads == 0, "decode_attention: head shapes do not match");
  TORCH_CHECK(dim % simd::kWidth == 0 && dim <= kMaxHeadDim, "decode_attention: head_dim ", dim,
              " must be a multiple of ", simd::kWidth, " and at most ", kMaxHeadDim);
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == cache_dtype && (cache_dtype == q.scalar_type() ||
              (q.scalar_type() == at::kFloat && (cache_dtype == at::kHalf || cache_dtype == at::kBFloat16))),
              "decode_attention: the caches must share q's dtype, or be float16 or bfloat16 for a float32 q");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == batch,
              "decode_attention: slots must be int64 (batch, context)");
  const int64_t context = slots.size(1);
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.numel() == batch * context,
              "decode_attention: mask must be bool with one entry per slot");
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous(), mc = mask.contiguous();
  at::Tensor out = at::empty_like(qc);
  if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16, at::BFloat16>(qc, k_cache, v_cache, sc, mc, out, scale, softcap);
  } else if (cache_dtype == at::kHalf) {
    run<float, c10::Half>(qc, k_cache, v_cache, sc, mc, out, scale, softcap);
  } else if (cache_dtype == at::kBFloat16) {
    run<float, at::BFloat16>(qc, k_cache, v_cache, sc, mc, out, scale, softcap);
  } else {
    run<float, float>(qc, k_cache, v_cache, sc, mc, out, scale, softcap);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor mask, float scale, "
        "float? softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) { m.impl("decode_attention", &decode_attention); }
