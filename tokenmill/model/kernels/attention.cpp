// Decode attention over the paged KV cache: one query token per sequence, each attending to the
// cache rows its slot table names.
//
// A compiled graph's own version (broadcast products and sums, `_fused_decode_attention`) spends
// most of a small model's decode step outside the matmuls: its reductions run one after another in
// `omp single` sections, and its value sum walks the context once per 8 output lanes. Here a task
// takes one chunk of a sequence's context for one KV head (see `run`): scores by dot products, a
// max-subtracted exp and the value rows summed in fp32, each row read from memory once. A float32
// model's cache may hold float16 or bfloat16 rows, widened as they are loaded: a decode step of many
// sequences reads the whole cache, so half the bytes make it faster. A bfloat16 model's cache may
// be any of the three (`--kv-cache-dtype`): every combination attends here, so that a prompt's
// tokens do not depend on how the step is packed whatever the cache holds. A model with attention
// sinks (gpt-oss) gives each query head a logit that joins its softmax denominator, added where a
// head's chunks are merged.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

constexpr int64_t kMaxHeadDim = 512;
constexpr int64_t kChunk = 64;  // context positions per task
static_assert(kChunk % simd::kWidth == 0, "a chunk's scores are padded to whole vectors within it");

// Bit j set where the j-th of kChunk mask entries (bools) admits its key
inline uint64_t admitted_bits(const bool* mask) {
  static_assert(kChunk == 64, "one 64-bit word per chunk");
  uint64_t bits = 0;
  for (int half = 0; half < 2; ++half) {
    const __m256i entries = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(mask + 32 * half));
    const __m256i masked = _mm256_cmpeq_epi8(entries, _mm256_setzero_si256());
    bits |= static_cast<uint64_t>(~static_cast<uint32_t>(_mm256_movemask_epi8(masked))) << (32 * half);
  }
  return bits;
}

// Most query heads attended together: they share each key and value row loaded (and widened).
// AVX-512's 32 vector registers hold 8 heads' sums (head_scores, weighted_rows); AVX2's 16 hold 4.
constexpr int kMaxHeads = simd::kWidth == 16 ? 8 : 4;

// Requests the cache lines of a row of dim values into the cache level of Hint (_MM_HINT_T0: L1, T1: L2)
template <int Hint, typename C>
inline void prefetch_row(const C* row, int64_t dim) {
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t b = 0; b < dim * static_cast<int64_t>(sizeof(C)); b += 64)
    _mm_prefetch(bytes + b, static_cast<decltype(_MM_HINT_T0)>(Hint));  // an enum with GCC, an int with Clang
}

// scores[h * kChunk + j] = q[h] . row j, for H query heads at once: kWidth / H rows at a time, their
// H x (kWidth / H) dot products summed across lanes together (transposed_sums); with `prefetch`, the
// next key rows are asked for ahead of their loads, and the rows' values (at the same slots of
// `values`) for attend_chunk's second pass
template <int H, typename C>
void head_scores(const float (*q)[kMaxHeadDim], const C* base, const C* values, const int64_t* rows, int64_t count,
                 int64_t row_stride, int64_t dim, bool prefetch, float* scores) {
  using namespace simd;
  constexpr int R = kWidth / H;
  for (int64_t j = 0; j < count; j += R) {
    Vec acc[kWidth];
    const C* k[R];
    for (int i = 0; i < kWidth; ++i) acc[i] = zero();
    for (int r = 0; r < R; ++r) k[r] = base + rows[std::min(j + r, count - 1)] * row_stride;  // past the end: repeats
    // The rows' slots scatter over the cache's blocks, where the hardware prefetchers cannot
    // follow: the next R key rows are fetched into L1 now, and these rows' values into L2 for the
    // second pass. The key rows 3R ahead are asked into L2 as well, whose queue of misses is longer
    // than L1's.
    for (int64_t r = j; prefetch && r < std::min(count, j + R); ++r) {
      if (r + R < count) prefetch_row<_MM_HINT_T0>(base + rows[r + R] * row_stride, dim);
      if (r + 3 * R < count) prefetch_row<_MM_HINT_T1>(base + rows[r + 3 * R] * row_stride, dim);
      prefetch_row<_MM_HINT_T1>(values + (k[r - j] - base), dim);
    }
    for (int64_t i = 0; i < dim; i += kWidth) {
      Vec qv[H];
      for (int h = 0; h < H; ++h) qv[h] = load(q[h] + i);
      for (int r = 0; r < R; ++r) {
        const Vec kv = load(k[r] + i);
        for (int h = 0; h < H; ++h) acc[h * R + r] = fmadd(qv[h], kv, acc[h * R + r]);
      }
    }
    float lanes[kWidth];
    store(lanes, transposed_sums(acc));
    const int64_t n = std::min<int64_t>(R, count - j);
    for (int h = 0; h < H; ++h)
      for (int64_t r = 0; r < n; ++r) scores[h * kChunk + j + r] = lanes[h * R + r];
  }
}

// acc[h * acc_stride + 0:N vectors] = sum_j probs[h * kChunk + j] * rows[j][0:N vectors] for H heads
template <int N, int H, typename C>
void weighted_rows(const float* probs, const C* base, const int64_t* rows, int64_t count, int64_t row_stride,
                   float* acc, int64_t acc_stride) {
  using namespace simd;
  Vec a[H][N];
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < N; ++i) a[h][i] = zero();
  for (int64_t j = 0; j < count; ++j) {
    const C* v = base + rows[j] * row_stride;
    Vec p[H];
    for (int h = 0; h < H; ++h) p[h] = set1(probs[h * kChunk + j]);
    for (int i = 0; i < N; ++i) {
      const Vec x = load(v + i * kWidth);
      for (int h = 0; h < H; ++h) a[h][i] = fmadd(p[h], x, a[h][i]);
    }
  }
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < N; ++i) store(acc + h * acc_stride + i * kWidth, a[h][i]);
}

// Attention of H query heads (q_in: H rows of dim) sharing one KV head over one chunk of a
// sequence's admitted keys (`rows`, `count` > 0 of them): per head, the chunk's score maximum, its
// sum of exp(score - maximum) and the exp-weighted sum of its value rows, which `merge_chunks`
// combines across chunks; head h's results at tops[h * part_stride], totals[...] and
// accs + h * part_stride * dim. `prefetch`: ask for the rows ahead of their loads (head_scores).
template <int H, typename T, typename C>
void attend_chunk(const T* q_in, const C* k_cache, const C* v_cache, const int64_t* rows, int64_t count,
                  int64_t row_stride, int64_t dim, float scale, std::optional<double> softcap, bool prefetch,
                  float* tops, float* totals, float* accs, int64_t part_stride) {
  using namespace simd;
  float q[H][kMaxHeadDim];
  float scores[H * kChunk];
  for (int h = 0; h < H; ++h)
    for (int64_t i = 0; i < dim; i += kWidth) store(q[h] + i, mul(load(q_in + h * dim + i), set1(scale)));
  head_scores<H>(q, k_cache, v_cache, rows, count, row_stride, dim, prefetch, scores);
  const int64_t padded = (count + kWidth - 1) / kWidth * kWidth;
  for (int h = 0; h < H; ++h) {
    float* s = scores + h * kChunk;
    if (softcap) {
      const float cap = static_cast<float>(*softcap);
      for (int64_t j = 0; j < count; ++j) s[j] = std::tanh(s[j] / cap) * cap;
    }
    std::fill(s + count, s + padded, -std::numeric_limits<float>::infinity());
    Vec top_lanes = set1(-std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < padded; j += kWidth) top_lanes = max(top_lanes, load(s + j));
    const float top = max_of(top_lanes);
    Vec total = zero();
    for (int64_t j = 0; j < padded; j += kWidth) {
      const Vec p = exp(sub(load(s + j), set1(top)));
      store(s + j, p);
      if (j + kWidth <= count) total = add(total, p);
    }
    float denominator = sum(total);
    for (int64_t j = count / kWidth * kWidth; j < count; ++j) denominator += s[j];
    tops[h * part_stride] = top;
    totals[h * part_stride] = denominator;
  }
  const int64_t acc_stride = part_stride * dim;
  // value vectors per pass: H x kMost sums in registers, beside the H probabilities and a row's
  // vector on AVX2 (16 registers: more sums would spill)
  constexpr int kMost = kWidth == 16 ? (H <= 2 ? 8 : H <= 4 ? 4 : 2) : (H == 1 ? 8 : H <= 3 ? 4 : 2);
  for (int64_t c = 0; c < dim;) {
    const int64_t left = (dim - c) / kWidth;
    // the widest pass that fits what is left: a power of two, at most kMost
    const int n = static_cast<int>(std::min<uint64_t>(kMost, std::bit_floor(static_cast<uint64_t>(left))));
    switch (n) {
      case 8: weighted_rows<8, H>(scores, v_cache + c, rows, count, row_stride, accs + c, acc_stride); break;
      case 4: weighted_rows<4, H>(scores, v_cache + c, rows, count, row_stride, accs + c, acc_stride); break;
      case 2: weighted_rows<2, H>(scores, v_cache + c, rows, count, row_stride, accs + c, acc_stride); break;
      default: weighted_rows<1, H>(scores, v_cache + c, rows, count, row_stride, accs + c, acc_stride);
    }
    c += n * kWidth;
  }
}

// out = sum_c exp(top_c - M) acc_c / sum_c exp(top_c - M) total_c over one head's chunks, M their
// largest maximum; chunks without an admitted key (total 0) are left out, zeros if all are. A sink
// (where not null) adds exp(sink - M) to the denominator, M then the larger of it and the maxima.
template <typename T>
void merge_chunks(const float* tops, const float* totals, const float* accs, int64_t chunks, int64_t dim,
                  const float* sink, T* out) {
  using namespace simd;
  float highest = *std::max_element(tops, tops + chunks);
  if (sink) highest = std::max(highest, *sink);
  float acc[kMaxHeadDim];
  std::fill(acc, acc + dim, 0.0f);
  float denominator = sink ? std::exp(*sink - highest) : 0.0f;
  for (int64_t c = 0; c < chunks; ++c) {
    if (totals[c] == 0.0f) continue;
    const float w = std::exp(tops[c] - highest);
    denominator += w * totals[c];
    for (int64_t i = 0; i < dim; i += kWidth) store(acc + i, fmadd(set1(w), load(accs + c * dim + i), load(acc + i)));
  }
  const Vec inv = set1(denominator > 0.0f ? 1.0f / denominator : 0.0f);
  for (int64_t i = 0; i < dim; i += kWidth) store(out + i, mul(load(acc + i), inv));
}

// The batch entry of the p-th in task order (of `batch`): the first, the last, the second, the
// last but one, ... The threads take contiguous ranges of tasks, and a prompt's tokens attend to
// ever more keys (their context grows one by one), so in position order the thread with the later
// tokens would have most of the work; paired from both ends, each range has about its share.
inline int64_t balanced_entry(int64_t p, int64_t batch) { return p % 2 ? batch - 1 - p / 2 : p / 2; }

// Tasks are (sequence, KV head, chunk of kChunk context positions): the query heads sharing a KV
// head attend together, up to kMaxHeads at a time, so that each row is loaded and widened once for
// all of them rather than once per head, and a batch of one still has tasks for every thread. The
// chunks' partial results are merged per (sequence, query head), in chunk order. Which thread runs a
// task, and which merges a head, changes nothing in the arithmetic, and neither do the prefetches.
//
// The software prefetches serve rows read once per step: a decode token's context, scattered over
// the cache's blocks. The tokens of a prompt chunk share their sequence's rows (their slot rows
// start alike), which each token's tasks find in cache after the first ones read them; there the
// prefetches and their address arithmetic only cost instructions, so entries whose neighbour in the
// batch starts at the same slot attend without them (tuning log: `head_scores` prefetch).
template <typename T, typename C>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots,
         const at::Tensor& mask, at::Tensor& out, double scale, std::optional<double> softcap,
         const float* sinks) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), context = slots.size(1);
  const int64_t kv_heads = k_cache.size(1), group = heads / kv_heads, row_stride = kv_heads * dim;
  const int64_t chunks = (context + kChunk - 1) / kChunk;
  // a KV head's query heads in as few passes as kMaxHeads allows, of even sizes (9: 5 and 4)
  const int64_t passes = (group + kMaxHeads - 1) / kMaxHeads, per_pass = (group + passes - 1) / passes;
  const T* qp = q.data_ptr<T>();
  const C* kp = k_cache.data_ptr<C>();
  const C* vp = v_cache.data_ptr<C>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const bool* mp = mask.data_ptr<bool>();
  T* op = out.data_ptr<T>();
  if (chunks == 0) {  // no keys: zeros, as for a sequence whose keys are all masked
    out.zero_();
    return;
  }
  std::vector<char> prefetched(batch);  // per entry: whether its tasks prefetch (see above)
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t first = sp[b * context];
    prefetched[b] = !((b > 0 && sp[(b - 1) * context] == first) || (b + 1 < batch && sp[(b + 1) * context] == first));
  }
  // Partial results by (sequence, query head, chunk), for the (sequence, KV head) pairs whose tasks
  // a thread's range of tasks cuts: their chunks' partials meet here, and the pair is merged once
  // every thread is done. A pair whose tasks a thread holds whole is merged by it as its last chunk
  // ends, from partials in a buffer of its own, which stays in cache: a prompt's tokens would
  // otherwise write and read back megabytes of partials a layer. Both merge the same values alike.
  const int64_t parts = batch * heads * chunks;
  const at::Tensor partials = at::empty({parts * (dim + 2)}, q.options().dtype(at::kFloat));
  float* tops = partials.data_ptr<float>();
  float* totals = tops + parts;
  float* accs = totals + parts;
  std::vector<int64_t> cut_pairs;  // (sequence b, KV head g) as b * kv_heads + g
  std::mutex cut_pairs_lock;
  // merges the chunks' partials of (b, g), its query heads' at stride `chunks`, into their outputs
  const auto merge_pair = [&](int64_t b, int64_t g, const float* pair_tops, const float* pair_totals,
                              const float* pair_accs) {
    for (int64_t h = 0; h < group; ++h) {
      const int64_t head = g * group + h;
      merge_chunks(pair_tops + h * chunks, pair_totals + h * chunks, pair_accs + h * chunks * dim, chunks, dim,
                   sinks ? sinks + head : nullptr, op + (b * heads + head) * dim);
    }
  };
  // A task's rows: the cache slots of its chunk's admitted positions, in position order, and their
  // count. A whole chunk's mask is read 32 entries at a time: one admitted whole (a prompt's keys
  // before its diagonal, a decode token's context) is read in place from the slot table, one
  // admitted in part (the diagonal, a window's edge) compacted into `buffer`, one not at all
  // skipped, so a prompt's tokens do not walk the masked part of their table entry by entry.
  const auto task_rows = [&](int64_t t, int64_t* buffer, int64_t& count) -> const int64_t* {
    const int64_t b = balanced_entry(t / (kv_heads * chunks), batch), c = t % chunks;
    const int64_t first = c * kChunk, end = std::min(context, first + kChunk);
    const int64_t* s = sp + b * context + first;
    const bool* m = mp + b * context + first;
    if (end - first == kChunk) {
      const uint64_t bits = admitted_bits(m);
      if (bits == ~uint64_t{0}) {
        count = kChunk;
        return s;
      }
      count = 0;
      for (uint64_t left = bits; left != 0; left &= left - 1) buffer[count++] = s[std::countr_zero(left)];
      return buffer;
    }
    count = 0;
    for (int64_t j = 0; j < end - first; ++j) {
      buffer[count] = s[j];
      count += m[j];
    }
    return buffer;
  };
  at::parallel_for(0, batch * kv_heads * chunks, 1, [&](int64_t t0, int64_t t1) {
    int64_t row_buffers[2][kChunk];
    int buffer = 0;  // row_buffers' entry that `rows` may point into; the next task takes the other
    int64_t count = 0;
    const int64_t* rows = task_rows(t0, row_buffers[buffer], count);
    // the partials of a (sequence, KV head) held whole: by (query head of the KV head, chunk)
    const std::unique_ptr<float[]> own(new float[group * chunks * (dim + 2)]);
    float* own_tops = own.get();
    float* own_totals = own_tops + group * chunks;
    float* own_accs = own_totals + group * chunks;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = balanced_entry(t / (kv_heads * chunks), batch);
      const int64_t g = t / chunks % kv_heads, c = t % chunks;
      const bool whole = t - c >= t0 && t - c + chunks <= t1;  // this range holds (b, g)'s every chunk
      if (!whole && (t == t0 || t + 1 == t1)) {
        const std::lock_guard<std::mutex> hold(cut_pairs_lock);
        cut_pairs.push_back(b * kv_heads + g);
      }
      // The next task's key and value rows are asked into L2 while this one computes: head_scores
      // prefetches only a few rows ahead within a chunk, so each chunk's first rows would
      // otherwise wait on memory.
      int64_t next_count = 0;
      const int64_t* next_rows = nullptr;
      if (t + 1 < t1) {
        next_rows = task_rows(t + 1, row_buffers[1 - buffer], next_count);
        const int64_t next_g = (t + 1) / chunks % kv_heads;
        const bool next_prefetched = prefetched[balanced_entry((t + 1) / (kv_heads * chunks), batch)];
        for (int64_t j = 0; next_prefetched && j < next_count; ++j) {
          prefetch_row<_MM_HINT_T1>(kp + next_g * dim + next_rows[j] * row_stride, dim);
          prefetch_row<_MM_HINT_T1>(vp + next_g * dim + next_rows[j] * row_stride, dim);
        }
      }
      // (b, g)'s partials: its query heads' at stride `chunks`, from chunk 0 of its first head
      const int64_t pair_part = whole ? 0 : (b * heads + g * group) * chunks;
      float* pair_tops = whole ? own_tops : tops + pair_part;
      float* pair_totals = whole ? own_totals : totals + pair_part;
      float* pair_accs = whole ? own_accs : accs + pair_part * dim;
      for (int64_t h0 = 0; h0 < group; h0 += per_pass) {
        const int64_t n = std::min<int64_t>(per_pass, group - h0), part = h0 * chunks + c;
        for (int64_t h = 0; h < n; ++h) {
          pair_tops[part + h * chunks] = -std::numeric_limits<float>::infinity();
          pair_totals[part + h * chunks] = 0.0f;
        }
        if (count == 0) continue;  // merge_chunks leaves the chunk out
        const auto attend = [&](auto together) {  // the n heads, as a template argument
          attend_chunk<decltype(together)::value>(qp + (b * heads + g * group + h0) * dim, kp + g * dim, vp + g * dim,
                                                  rows, count, row_stride, dim, static_cast<float>(scale), softcap,
                                                  prefetched[b], pair_tops + part, pair_totals + part,
                                                  pair_accs + part * dim, chunks);
        };
        simd::with_constant<kMaxHeads>(n, attend);
      }
      if (whole && c + 1 == chunks) merge_pair(b, g, own_tops, own_totals, own_accs);
      rows = next_rows;
      count = next_count;
      buffer = 1 - buffer;
    }
  });
  std::sort(cut_pairs.begin(), cut_pairs.end());
  cut_pairs.erase(std::unique(cut_pairs.begin(), cut_pairs.end()), cut_pairs.end());
  for (const int64_t pair : cut_pairs) {
    const int64_t b = pair / kv_heads, g = pair % kv_heads, pair_part = (b * heads + g * group) * chunks;
    merge_pair(b, g, tops + pair_part, totals + pair_part, accs + pair_part * dim);
  }
}

}  // namespace

namespace tokenmill {

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& mask, double scale,
                            std::optional<double> softcap, const std::optional<at::Tensor>& sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.sizes() == k_cache.sizes(),
              "decode_attention: expected q (batch, heads, head_dim) and caches (slots, kv_heads, head_dim)");
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2), kv_heads = k_cache.size(1);
  TORCH_CHECK(k_cache.size(2) == dim && heads % kv_heads == 0, "decode_attention: head shapes do not match");
  TORCH_CHECK(dim % simd::kWidth == 0 && dim <= kMaxHeadDim, "decode_attention: head_dim ", dim,
              " must be a multiple of ", simd::kWidth, " and at most ", kMaxHeadDim);
  const auto cache_dtype = k_cache.scalar_type();
  TORCH_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16,
              "decode_attention: q must be float32 or bfloat16");
  TORCH_CHECK(v_cache.scalar_type() == cache_dtype &&
              (cache_dtype == at::kFloat || cache_dtype == at::kHalf || cache_dtype == at::kBFloat16),
              "decode_attention: the caches must be float32, float16 or bfloat16, both alike");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "decode_attention: caches must be contiguous");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 2 && slots.size(0) == batch,
              "decode_attention: slots must be int64 (batch, context)");
  const int64_t context = slots.size(1);
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.numel() == batch * context,
              "decode_attention: mask must be bool with one entry per slot");
  at::Tensor sinks_f;
  if (sinks) {
    TORCH_CHECK(sinks->numel() == heads, "decode_attention: sinks must have one logit per query head");
    sinks_f = sinks->to(at::kFloat).contiguous();
  }
  const float* sp = sinks ? sinks_f.data_ptr<float>() : nullptr;
  const at::Tensor qc = q.contiguous(), sc = slots.contiguous(), mc = mask.contiguous();
  at::Tensor out = at::empty_like(qc);
  const auto over_cache = [&](auto query) {  // q's type, as a value
    using T = decltype(query);
    if (cache_dtype == at::kHalf) {
      run<T, c10::Half>(qc, k_cache, v_cache, sc, mc, out, scale, softcap, sp);
    } else if (cache_dtype == at::kBFloat16) {
      run<T, at::BFloat16>(qc, k_cache, v_cache, sc, mc, out, scale, softcap, sp);
    } else {
      run<T, float>(qc, k_cache, v_cache, sc, mc, out, scale, softcap, sp);
    }
  };
  if (q.scalar_type() == at::kBFloat16) {
    over_cache(at::BFloat16{});
  } else {
    over_cache(float{});
  }
  return out;
}

}  // namespace tokenmill
