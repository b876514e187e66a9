// Weight-only quantized matrix products for a few activation rows (GEMVs), on CPU.
//
// A decode step reads every weight once per token, so it runs at the speed the weight bytes stream
// from memory, if the kernel keeps up with them. These do much as llama.cpp's do: the activation rows
// are rounded to int8 (one scale per 8 values, where llama.cpp has one per 32) and multiplied with
// the int8 or 4-bit weights in integers (maddubs, madd: two instructions per 32 products), the sums
// scaled in fp32. Widening both sides to fp32 for FMAs instead would take ~25 instructions per 32
// 4-bit weights and leave the kernel bound by its instructions rather than by memory. Weight rows
// are split across PyTorch's intra-op threads, and up to 8 activation rows share each loaded weight
// vector; with many rows (prefill) they keep up with a dense fp32 matmul (on bf16, the ops hand
// over to a layer's dense copy where that wins). With AVX-512 the int4 GEMV multiplies 4 groups per
// instruction and the int8 one 2 blocks, with VNNI's dpbusd where the CPU has it.
#include <ATen/core/Tensor.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

constexpr int64_t kRowsPerTask = 16;
constexpr int64_t kRowsPerTile = 32;
constexpr int kRowsPerBlock = 8;  // activation rows that share each weight load (over_row_blocks)
// Activation rows per block in the row GEMVs (int4_rows, int6_rows). Their low terms (int4: each
// group's low times its activation sum; 6-bit: the -32 offset) have FMA chains of their own: for up
// to kInlineLowRows rows in the loop over the weights, beside the products; for more in a pass of
// their own after it, which leaves AVX2's 16 vector registers to the products of 8 rows (with the
// low terms beside them, 8 rows spill). Both add a row's terms in the same order, so a row's result
// does not depend on its block. int4_rows with AVX-512, whose 32 registers hold them, keeps them in
// the loop.
constexpr int kRowGemvRowsPerBlock = 8;
constexpr int kInlineLowRows = 4;

// Runs kernel(rows, m0, r0, r1) over blocks of activation rows (m0: the block's first; rows: its
// size, as a std::integral_constant for the kernel's template: RowsPerBlock while that many are
// left, then the rest as one block, whose weights are then loaded once), each over weight rows (or
// tiles of them) [r0, r1): PyTorch's intra-op threads split the N weight rows, per_task at least to
// a task, and each thread takes its rows per_tile at a time through every block of activation rows,
// so that with many activation rows the tile's weights are read from memory once, then from cache.
template <int RowsPerBlock = kRowsPerBlock, typename Kernel>
void over_row_blocks(int64_t M, int64_t N, const Kernel& kernel, int64_t per_task = kRowsPerTask,
                     int64_t per_tile = kRowsPerTile) {
  at::parallel_for(0, N, per_task, [&](int64_t begin, int64_t end) {
    for (int64_t r0 = begin; r0 < end; r0 += per_tile) {
      const int64_t r1 = std::min(end, r0 + per_tile);
      int64_t m0 = 0;
      for (; M - m0 >= RowsPerBlock; m0 += RowsPerBlock)
        kernel(std::integral_constant<int, RowsPerBlock>{}, m0, r0, r1);
      if (M > m0) simd::with_constant<RowsPerBlock - 1>(M - m0, [&](auto rows) { kernel(rows, m0, r0, r1); });
    }
  });
}

// A block's four activation scales (quantize_blocks) for the int32 lanes of its products: [0-3] twice
inline __m256 lane_scales(const float* block_scales) {
  return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(block_scales));
}

// The int4 GEMV unpacks the nibbles of kUnit groups with one load (4 with AVX-512, 2 with AVX2; see
// int4_rows), so the activations it multiplies them with come in units of kUnit blocks of 32, the
// first halves (elements 0-15) of the unit's blocks, then their second halves: block b of a unit at
// [16 b, 16 b + 16) and [16 kUnit + 16 b, ...). The blocks past the last full unit go in units half
// as large, down to a single block in element order. The offsets of block b's halves in a row of n:
#ifdef SIMD_AVX512
constexpr int64_t kUnit = 4;
#else
constexpr int64_t kUnit = 2;
#endif
inline void half_offsets(int64_t b, int64_t n, int64_t& first, int64_t& second) {
  int64_t start = 0;  // of the units of this size
  for (int64_t unit = kUnit; unit > 1; unit /= 2) {
    const int64_t whole = n / unit * unit;  // blocks in whole units
    if (b < whole) {
      first = start + b / unit * unit * 32 + b % unit * 16;
      second = first + unit * 16;
      return;
    }
    start += whole * 32, b -= whole, n -= whole;
  }
  first = start + b * 32;
  second = first + 16;
}

// Activation rows quantized for the GEMVs: q (M, K) int8 with one scale per 8 values, and per block
// of 32 the four scales (M, K / 32, 4 floats). A block's sub-block j holds its elements 4j..4j+3 and
// 16+4j..16+4j+3: the products that `madd` sums into int32 lanes j and j + 4 in both GEMVs, so each
// lane is scaled by one float of a vector ([scale 0-3] twice, or two groups' scales) at no extra
// integer work. Against one scale per 32, this cuts the rounding's cost in perplexity on the decode
// path: an outlier spoils fewer neighbours. With `sums`, the sum of scale x q over each block,
// (M, K / 32): the int4 GEMV's low terms then see the same x as its scaled ones, so the rounding
// errors stay centred, as the weights are. With `coarse`, a block's four scales are one, its largest
// magnitude's (for the tiles); with `consecutive`, scale j is that of values 8j..8j+7 (the 6-bit
// tiles'). The buffers are left unzeroed (std::vector would zero them: a pass more over them), as
// the quantization fills them whole.
struct QuantizedRows {
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> scales, sums;
};

// Where quantize_blocks stores the blocks: kRows in the rows' order; kHalves with each row's blocks'
// halves in the order in which the int4 GEMV unpacks the nibbles of several groups with one load
// (`half_offsets`); kRowBlocks with the rows regrouped into the blocks that over_row_blocks hands the
// tile kernel (8 at a time, then the 1-7 left), each block in its rows' place, group by group: its
// rows' 32 values, 4 scales and sum side by side. The tile kernel then reaches every row of its block
// from one pointer at offsets fixed when it is compiled, where a pointer per row would take more
// registers than the loop has and spill.
// kPairs has each pair of blocks in the order in which the int6 GEMV multiplies them
// (`int6_rows`): the first halves (`simd::int6_halves`) of both blocks, then their second halves, and
// per 16 values the sum (`sums`, (M, K / 16), times -32: Q6_K's offset). With `half_sums`, the
// kRowBlocks layout has those sums per 16 too (for the 6-bit tiles), in each block's place.
enum class Layout { kRows, kHalves, kRowBlocks, kPairs };

// The place of block b of row `row` (of M rows of row_blocks blocks) in the kRowBlocks layout
inline int64_t row_block_place(int64_t row, int64_t b, int64_t M, int64_t row_blocks) {
  const int64_t first = row / kRowsPerBlock * kRowsPerBlock, rows = std::min<int64_t>(kRowsPerBlock, M - first);
  return first * row_blocks + b * rows + row - first;
}

// 8 activations as float32 (bf16 widened, exactly)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

// Rows [first, first + count) of x (M, K), read from x_first (row first), into out
template <typename T>
void quantize_blocks(const T* x_first, int64_t first, int64_t count, int64_t M, int64_t K, QuantizedRows& out,
                     Layout layout, bool coarse, bool half_sums, bool consecutive) {
  const int64_t row_blocks = K / 32;
  const __m256 sign_bit = _mm256_set1_ps(-0.0f), zero = _mm256_setzero_ps(), top = _mm256_set1_ps(127.0f);
  for (int64_t g = 0; g < count * row_blocks; ++g) {
    __m256 v[4];
    for (int j = 0; j < 4; ++j) v[j] = load8(x_first + g * 32 + 8 * j);
    // v[0] and v[2] hold sub-blocks 0 (lanes 0-3) and 1 (lanes 4-7), v[1] and v[3] sub-blocks 2 and 3
    __m256 inverse[4];  // for v[j]
    float d[4];
    const auto invert = [&](__m256 largest) {
      return _mm256_and_ps(_mm256_div_ps(top, largest), _mm256_cmp_ps(largest, zero, _CMP_GT_OQ));
    };
    if (consecutive) {  // scale j for v[j]: values 8j..8j+7
      for (int j = 0; j < 4; ++j) {
        __m256 m = _mm256_andnot_ps(sign_bit, v[j]);
        m = _mm256_max_ps(m, _mm256_permute_ps(m, _MM_SHUFFLE(2, 3, 0, 1)));
        m = _mm256_max_ps(m, _mm256_permute_ps(m, _MM_SHUFFLE(1, 0, 3, 2)));
        m = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));  // every lane: the 8's largest
        inverse[j] = invert(m);
        d[j] = _mm256_cvtss_f32(_mm256_div_ps(m, top));
      }
    } else {
      __m256 largest[2];
      for (int h = 0; h < 2; ++h) {
        __m256 m = _mm256_max_ps(_mm256_andnot_ps(sign_bit, v[h]), _mm256_andnot_ps(sign_bit, v[h + 2]));
        m = _mm256_max_ps(m, _mm256_permute_ps(m, _MM_SHUFFLE(2, 3, 0, 1)));
        largest[h] = _mm256_max_ps(m, _mm256_permute_ps(m, _MM_SHUFFLE(1, 0, 3, 2)));  // each lane: its 4's
      }
      if (coarse) {
        const __m256 m = _mm256_max_ps(largest[0], largest[1]);
        largest[0] = largest[1] = _mm256_max_ps(m, _mm256_permute2f128_ps(m, m, 1));
      }
      for (int h = 0; h < (coarse ? 1 : 2); ++h) {  // divisions: coarse, the halves share theirs
        inverse[h] = invert(largest[h]);
        const __m256 scale = _mm256_div_ps(largest[h], top);
        d[2 * h] = _mm256_cvtss_f32(scale);
        d[2 * h + 1] = _mm256_cvtss_f32(_mm256_permute2f128_ps(scale, scale, 1));
      }
      if (coarse) {
        inverse[1] = inverse[0];
        d[2] = d[0], d[3] = d[1];
      }
      inverse[2] = inverse[0], inverse[3] = inverse[1];
    }
    __m256i words[4];
    for (int j = 0; j < 4; ++j)  // nearest, ties even
      words[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inverse[j]));
    // the packs work within 128-bit lanes; the permutation puts the 32 bytes back in order
    const __m256i bytes = _mm256_permutevar8x32_epi32(
        _mm256_packs_epi16(_mm256_packs_epi32(words[0], words[1]), _mm256_packs_epi32(words[2], words[3])),
        _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    const int64_t row = first + g / row_blocks, b = g % row_blocks;
    int64_t at = row * row_blocks + b;  // the block's place among all blocks, and its scales' and sum's
    if (layout == Layout::kPairs) {
      const __m256i halves = simd::int6_halves(bytes);
      int8_t* q = out.q.get() + row * K + b / 2 * 64 + b % 2 * 16;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm256_castsi256_si128(halves));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32), _mm256_extracti128_si256(halves, 1));
    } else if (layout == Layout::kHalves) {
      int64_t first_half, second_half;
      half_offsets(b, row_blocks, first_half, second_half);
      int8_t* q = out.q.get() + row * K;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + first_half), _mm256_castsi256_si128(bytes));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(q + second_half), _mm256_extracti128_si256(bytes, 1));
    } else {
      if (layout == Layout::kRowBlocks) at = row_block_place(row, b, M, row_blocks);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out.q.get() + at * 32), bytes);
    }
    float* block_scales = out.scales.get() + at * 4;
    block_scales[0] = d[0], block_scales[1] = d[1], block_scales[2] = d[2], block_scales[3] = d[3];
    if (out.sums != nullptr) {
      const __m256i lanes = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes), _mm256_set1_epi16(1));
      // lane l holds values 4l..4l+3: scale l / 2 (consecutive) or l % 4
      const __m256 lane_d = consecutive ? _mm256_setr_ps(d[0], d[0], d[1], d[1], d[2], d[2], d[3], d[3])
                                        : lane_scales(block_scales);
      const __m256 terms = _mm256_mul_ps(_mm256_cvtepi32_ps(lanes), lane_d);
      if (half_sums) {  // lanes 0-3 hold elements 0-15, lanes 4-7 elements 16-31
        out.sums[at * 2] = -32.0f * simd::sum4(_mm256_castps256_ps128(terms));
        out.sums[at * 2 + 1] = -32.0f * simd::sum4(_mm256_extractf128_ps(terms, 1));
      } else {
        out.sums[at] = simd::sum8(terms);
      }
    }
  }
}

// 32 products of unsigned weights q (4-bit, or the magnitudes of int8 ones) and int8 activations,
// summed in pairs to int16 (at most 2 x 127 x 127: no saturation)
inline __m256i products(__m256i q, const int8_t* x) {
  return _mm256_maddubs_epi16(q, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
}

// Partial sums per activation row in int8_rows: block (or AVX-512 pair of blocks) g goes into
// partial sum g % kInt8Partials, in order, and the partials add up in index order. The same split
// for every row count keeps a row's result independent of its batch; with one row the partials are
// independent FMA chains (one chain would wait on each FMA's latency), with more rows each row's
// chain is one of several in flight and the partials are summed one after another.
constexpr int kInt8Partials = 4;
// With several rows the partials take turns over stretches of kInt8ChunkBytes of each row, so that
// the stretch of every activation row (and its scales) stays in L1 while all kInt8Partials read it:
// over the whole row a wide layer's block of rows (8 x 8960 bytes and their scales) comes from L2
// once per partial. Each partial adds the same units in the same order as without the stretches.
constexpr int64_t kInt8ChunkBytes = 2048;

// total[i] = the sum over units u = 0..count-1 (blocks, or pairs of them, of unit_bytes weights)
// of what unit(u, acc) adds to acc[i], for M activation rows, split into kInt8Partials partials as
// above; V is the vector type, add its addition.
template <int M, typename V, typename Unit, typename Add>
void int8_partial_sums(int64_t count, int64_t unit_bytes, const Unit& unit, V zero, const Add& add,
                       V (&total)[M]) {
  constexpr int C = kInt8Partials;
  if constexpr (M == 1) {  // the C partials' chains interleaved
    V acc[C][1];
    for (int c = 0; c < C; ++c) acc[c][0] = zero;
    int64_t u = 0;
    for (; u + C <= count; u += C)
      for (int c = 0; c < C; ++c) unit(u + c, acc[c]);
    for (int c = 0; c < C; ++c)  // c a constant once unrolled: the partials stay in registers
      if (u + c < count) unit(u + c, acc[c]);
    total[0] = acc[0][0];
    for (int c = 1; c < C; ++c) total[0] = add(total[0], acc[c][0]);
  } else {  // one partial at a time (over each stretch), the rows' chains interleaved
    const int64_t stretch = std::max<int64_t>(1, kInt8ChunkBytes / unit_bytes / C) * C;  // a multiple of C
    if (count <= stretch) {  // one stretch: the partials go straight into total, in registers
      for (int c = 0; c < C; ++c) {
        V acc[M];
        for (int i = 0; i < M; ++i) acc[i] = zero;
        for (int64_t u = c; u < count; u += C) unit(u, acc);
        for (int i = 0; i < M; ++i) total[i] = c == 0 ? acc[i] : add(total[i], acc[i]);
      }
      return;
    }
    V partials[C][M];
    for (int c = 0; c < C; ++c)
      for (int i = 0; i < M; ++i) partials[c][i] = zero;
    for (int64_t start = 0; start < count; start += stretch) {
      const int64_t end = std::min(count, start + stretch);
      for (int c = 0; c < C; ++c) {
        V acc[M];
        for (int i = 0; i < M; ++i) acc[i] = partials[c][i];
        for (int64_t u = start + c; u < end; u += C) unit(u, acc);
        for (int i = 0; i < M; ++i) partials[c][i] = acc[i];
      }
    }
    for (int i = 0; i < M; ++i) {
      total[i] = partials[0][i];
      for (int c = 1; c < C; ++c) total[i] = add(total[i], partials[c][i]);
    }
  }
}

// y = x W^T * scale for int8 W (N, K), one scale per row, and x quantized by quantize_blocks
// (kRows): per block of 32, the products of the weights' magnitudes and the activations with
// the weights' signs (maddubs multiplies unsigned by signed bytes), scaled by its lanes' scales, summed
// into kInt8Partials partials. Each weight row is done on its own: two sharing each activation load
// would need twice the accumulators, more than AVX2's 16 registers hold.
#ifndef SIMD_AVX512
template <int M, typename T>
void int8_rows(const int8_t* xq, const float* scales, int64_t K, const int8_t* weight, const T* scale, T* y,
               int64_t N, int64_t row0, int64_t row1) {
  const int64_t blocks = K / 32;
  const __m256i ones = _mm256_set1_epi16(1);
  for (int64_t o = row0; o < row1; ++o) {
    const int8_t* row = weight + o * K;
    // block g into acc (one per activation row)
    const auto block = [&](int64_t g, __m256* acc) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * 32));
      const __m256i magnitudes = _mm256_sign_epi8(w, w);
      for (int i = 0; i < M; ++i) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + g * 32));
        const __m256i sums = _mm256_madd_epi16(_mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(xv, w)), ones);
        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), lane_scales(scales + (i * blocks + g) * 4), acc[i]);
      }
    };
    __m256 total[M];
    int8_partial_sums<M>(blocks, 32, block, _mm256_setzero_ps(), [](__m256 a, __m256 b) { return _mm256_add_ps(a, b); },
                         total);
    const float s = static_cast<float>(scale[o]);
    for (int i = 0; i < M; ++i) y[i * N + o] = T(simd::sum8(total[i]) * s);
  }
}
#else
// acc plus each int32 lane's sum of 4 products of unsigned and signed bytes: one dpbusd with VNNI,
// else maddubs and madd (the products of 4-bit q or int8 magnitudes fit int16 in pairs)
inline __m512i dot4(__m512i acc, __m512i unsigned_q, __m512i signed_x) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, unsigned_q, signed_x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(unsigned_q, signed_x), _mm512_set1_epi16(1)));
#endif
}

// With AVX-512, the same over two blocks per vector (lanes 0-7: block g, 8-15: g + 1), a last odd
// block in the lower half with zeros above it. The weights' signs go onto the activations by a masked
// subtraction (AVX-512 has no sign_epi8), and with VNNI one dpbusd makes each lane's int32 sum of 4
// products, where maddubs and madd take two instructions.

template <int M, typename T>
void int8_rows(const int8_t* xq, const float* scales, int64_t K, const int8_t* weight, const T* scale, T* y,
               int64_t N, int64_t row0, int64_t row1) {
  const int64_t blocks = K / 32, pairs = (blocks + 1) / 2;
  // each lane's scale from a pair's 8 (quantize_blocks: lanes j and j + 4 hold a block's sub-block j)
  const __m512i scale_lanes = _mm512_setr_epi32(0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7, 4, 5, 6, 7);
  const auto load_bytes = [](const int8_t* p, bool single) {
    return single ? _mm512_zextsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))
                  : _mm512_loadu_si512(p);
  };
  for (int64_t o = row0; o < row1; ++o) {
    const int8_t* row = weight + o * K;
    // pair p, blocks 2p and 2p + 1 (or 2p alone, the last of an odd count), into acc (one per row)
    const auto pair = [&](int64_t p, __m512* acc) {
      const int64_t g = 2 * p;
      const bool single = g + 1 == blocks;
      const __m512i w = load_bytes(row + g * 32, single);
      const __m512i magnitudes = _mm512_abs_epi8(w);
      const __mmask64 negative = _mm512_movepi8_mask(w);
      for (int i = 0; i < M; ++i) {
        const __m512i xv = load_bytes(xq + i * K + g * 32, single);
        const __m512i sums =
            dot4(_mm512_setzero_si512(), magnitudes, _mm512_mask_sub_epi8(xv, negative, _mm512_setzero_si512(), xv));
        const float* s = scales + (i * blocks + g) * 4;
        const __m512 pair_scales = single ? _mm512_zextps128_ps512(_mm_loadu_ps(s)) : _mm512_castps256_ps512(_mm256_loadu_ps(s));
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_permutexvar_ps(scale_lanes, pair_scales), acc[i]);
      }
    };
    __m512 total[M];
    int8_partial_sums<M>(pairs, 64, pair, _mm512_setzero_ps(), [](__m512 a, __m512 b) { return _mm512_add_ps(a, b); },
                         total);
    const float s = static_cast<float>(scale[o]);
    for (int i = 0; i < M; ++i) y[i * N + o] = T(_mm512_reduce_add_ps(total[i]) * s);
  }
}
#endif

// quantize_blocks runs over PyTorch's intra-op threads, kQuantizeElementsPerTask activations each:
// on the calling thread alone it is a visible share of a prompt's product with a narrow weight (a
// down projection) and of a decode step's many rows. Fewer rows than a task's stay on the calling
// thread, where a fork would cost more than it saves; a smaller value spreads smaller batches.
constexpr int64_t kQuantizeElementsPerTask = 8 * 1024;

template <typename T>
QuantizedRows quantize_rows(const at::Tensor& x, bool with_sums, Layout layout, bool coarse = false,
                            bool half_sums = false, bool consecutive = false) {
  const int64_t M = x.size(0), K = x.size(1), blocks = K / 32;
  const at::Tensor xc = x.contiguous();
  const T* xs = xc.data_ptr<T>();
  half_sums = half_sums || layout == Layout::kPairs;
  const int64_t sums_per_block = half_sums ? 2 : 1;
  QuantizedRows rows{std::unique_ptr<int8_t[]>(new int8_t[M * K]), std::unique_ptr<float[]>(new float[M * blocks * 4]),
                     with_sums ? std::unique_ptr<float[]>(new float[M * blocks * sums_per_block]) : nullptr};
  at::parallel_for(0, M, std::max<int64_t>(1, kQuantizeElementsPerTask / K), [&](int64_t begin, int64_t end) {
    quantize_blocks(xs + begin * K, begin, end - begin, M, K, rows, layout, coarse, half_sums, consecutive);
  });
  return rows;
}

// y = x W^T * scale, for x (M, K), W (N, K) int8 and scale (N) (one per row); x, scale and y are
// all T, bfloat16 or float32.
template <typename T>
at::Tensor int8_gemv_as(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1), blocks = K / 32;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantizedRows xq = quantize_rows<T>(x, false, Layout::kRows);
  const int8_t* w = weight.data_ptr<int8_t>();
  const T* s = scale.data_ptr<T>();
  over_row_blocks(M, N, [&](auto rows, int64_t m0, int64_t r0, int64_t r1) {
    int8_rows<decltype(rows)::value>(xq.q.get() + m0 * K, xq.scales.get() + m0 * blocks * 4, K, w, s,
                                     y.data_ptr<T>() + m0 * N, N, r0, r1);
  });
  return y;
}

void int8_gemv_checks(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "int8_gemv: x must be a 2-D bfloat16 or float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kChar && weight.is_contiguous(),
              "int8_gemv: the weight must be a contiguous 2-D int8 tensor");
  TORCH_CHECK(x.size(1) == weight.size(1) && weight.size(1) % 32 == 0,
              "int8_gemv: x's width must equal the weight's, a multiple of 32");
  TORCH_CHECK(scale.scalar_type() == dtype && scale.numel() == weight.size(0) && scale.is_contiguous(),
              "int8_gemv: scale must hold one contiguous value per weight row, of x's dtype");
}

at::Tensor int8_gemv(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  int8_gemv_checks(x, weight, scale);
  return x.scalar_type() == at::kFloat ? int8_gemv_as<float>(x, weight, scale)
                                       : int8_gemv_as<at::BFloat16>(x, weight, scale);
}

}  // namespace

namespace tokenmill {

// The same product for any number of rows, by the fastest means at hand for that number: the GEMV
// above up to max_gemv_rows, else a dense matmul (bound by arithmetic) with the layer's dense copy,
// or with chunks of chunk_rows int8 rows dequantized one at a time (a large output head keeps no
// dense copy). Deciding here, at run time, lets one compiled graph serve every batch size without a
// guard on it.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& dense, int64_t max_gemv_rows, int64_t chunk_rows) {
  if (x.size(0) <= max_gemv_rows) return int8_gemv(x, weight, scale);
  if (dense.has_value()) return at::linear(x, *dense);
  TORCH_CHECK(chunk_rows > 0, "int8_linear: chunk_rows must be positive");
  const int64_t N = weight.size(0);
  at::Tensor y = at::empty({x.size(0), N}, x.options());
  for (int64_t r0 = 0; r0 < N; r0 += chunk_rows) {
    const int64_t r1 = std::min(N, r0 + chunk_rows);
    at::Tensor part = y.narrow(1, r0, r1 - r0);
    at::mm_out(part, x, weight.slice(0, r0, r1).to(x.scalar_type()).t());  // int8 values are exact in bf16
  }
  return y.mul_(scale);
}

}  // namespace tokenmill

namespace {

// The int4 GEMV's pairs of groups: the 32 bytes of groups g and g + 1 hold, in their low nibbles,
// elements 0-15 of both and, in their high nibbles, elements 16-31 (the order of quantize_blocks'
// pairs), so one load and three instructions unpack two groups.
inline void unpack_pair(const uint8_t* p, __m256i& q_low, __m256i& q_high) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  q_low = _mm256_and_si256(b, nibble);
  q_high = _mm256_and_si256(_mm256_srli_epi16(b, 4), nibble);
}

// The pair's q x sums times the groups' steps as int32: lanes 0-3 add up to group g's, lanes 4-7 to
// group g + 1's (steps: 8 int16 copies of each). Two int16 products of at most 2 x 63 x 127 each,
// 5- and 6-bit q included, still fit int16 when added; times a step of at most 2^15 - 1, their pair
// fits int32.
inline __m256i pair_sums(__m256i q_low, __m256i q_high, const int8_t* x, __m256i steps) {
  return _mm256_madd_epi16(_mm256_add_epi16(products(q_low, x), products(q_high, x + 32)), steps);
}

// Bytes of fifth bits per weight row: 16 per block of 4 groups, a last partial block padded
inline int64_t fifth_row_bytes(int64_t groups) { return (groups + 3) / 4 * 16; }

// A block of 4 groups' fifth bits (16 bytes at p) as 4 planes: in vector k (0-3, the order the int4
// GEMV unpacks: the first pair's low nibbles, its high ones, then the second pair's), bit 4 of byte j
// is that vector's fifth bit at position j. Byte b of the block holds in bit k the bit of vector k at
// position b, and in bit 4 + k the one at position 16 + b; the lower lane is moved up to bits 4-7 so
// that vector k is then the planes shifted right by k and masked with 16 (`fifth_vector`): three
// instructions per 32 weights, where expanding 32 bits to 32 bytes by a shuffle and a compare
// takes six.
inline __m256i fifth_planes(const uint8_t* p) {
  const __m256i block = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_blend_epi32(_mm256_slli_epi16(block, 4), block, 0xF0);
}

// Vector k of `fifth_planes`: 16 in the bytes whose nibble has its fifth bit set, else 0
inline __m256i fifth_vector(__m256i planes, int k) {
  return _mm256_and_si256(_mm256_srl_epi16(planes, _mm_cvtsi32_si128(k)), _mm256_set1_epi8(0x10));
}

// Group g's low from a row's (step, low) pairs, whose lows are float16 bits
inline float low_of(const int16_t* step_low, int64_t g) {
  return simd::to_float(c10::Half(step_low[2 * g + 1], c10::Half::from_bits()));
}

// The lows of groups g to g + 7 from a row's (step, low) pairs, times per_unit
inline __m256 octet_lows(const int16_t* step_low, int64_t g, __m256 per_unit) {
  const __m256i low_bytes = _mm256_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,  //
                                             2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i picked =
      _mm256_shuffle_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(step_low + 2 * g)), low_bytes);
  const __m128i halves = _mm256_castsi256_si128(_mm256_permute4x64_epi64(picked, _MM_SHUFFLE(0, 0, 2, 0)));
  return _mm256_mul_ps(_mm256_cvtph_ps(halves), per_unit);
}

// The rounding of the activations adds a relative error of ~0.4% per product, less than llama.cpp's
// Q8 activations (one scale per 32); `tokenmill perplexity --decode` measures its cost.
//
// y = x W^T for W (N, K) in 4-bit groups of 32 along K, w = step x unit x q + low with q in 0..15:
// row o's group g is the 16 bytes nibbles[o][16 g:], byte j holding q of element 32 g + j in its low
// nibble and of element 32 g + 16 + j in its high one; (step, low) are steps_lows[o][g] (int16 and
// the bits of a float16: one stream of memory with the nibbles, as a decode step reads them) and
// unit units[o] (> 0). x comes quantized by quantize_blocks (kHalves). Integer steps let
// `madd` weigh each group's products as it sums them, where a float scale would take a multiply
// per group and activation row (6 instructions per 64 products and row instead of 7); the sums are
// scaled by the activation scales, the total by the unit. The low terms are low times
// the group's sum of x (`sums`), divided by the unit so that they can share the accumulators.
//
// With Fifth, q is 5-bit (0..31, GGUF's Q5_0, Q5_1 and Q5_K exactly), with 16 bytes of fifth bits per
// block of 4 groups (the last one padded) at fifth[o][4 g:], as `fifth_planes` reads them.
template <int M, bool Fifth, typename T>
void int4_rows(const int8_t* xq, const float* scales, const float* sums, int64_t K, const uint8_t* nibbles,
               const uint8_t* fifth, const int16_t* steps_lows, const float* units, T* y, int64_t N, int64_t row0,
               int64_t row1) {
  const int64_t groups = K / 32;
#ifdef SIMD_AVX512
  // a quad's (step, low) x 4: its 4 lows' bits
  const __m128i quad_lows_bits = _mm_setr_epi8(2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1);
#else
  // a quad's (step, low) x 4 (16 bytes, in both halves) as the int16 multipliers of its first pair
  // (steps 0 and 1) and of its second (2 and 3)
  const __m256i first_pair = _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1,  //
                                              4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5, 4, 5);
  const __m256i second_pair = _mm256_add_epi8(first_pair, _mm256_set1_epi8(8));
#endif
  for (int64_t o = row0; o < row1; ++o) {
    const uint8_t* row = nibbles + o * groups * 16;
    const uint8_t* fifth_row = Fifth ? fifth + o * fifth_row_bytes(groups) : nullptr;
    const int16_t* step_low = steps_lows + o * groups * 2;
    const float unit = units[o];
    // low_terms: their own FMA chains, so that a row's sums are added in the same order whatever its
    // batch. With AVX-512 a quad at a time in the loop, groups outside quads in `tail`; on AVX2 8
    // groups at a time (`add_low_terms`), groups past the last 8 in `tail`. In units of `unit`, as
    // acc; tail in plain ones.
    __m256 acc[M], low_terms[M];
    float tail[M];
    for (int i = 0; i < M; ++i) acc[i] = low_terms[i] = _mm256_setzero_ps(), tail[i] = 0.0f;
#ifdef SIMD_AVX512
    const __m128 per_unit = _mm_set1_ps(1.0f / unit);
    __m512 wide[M];
    for (int i = 0; i < M; ++i) wide[i] = _mm512_setzero_ps();
#else
    const __m256 per_unit = _mm256_set1_ps(1.0f / unit);
    const auto add_low_terms = [&](int64_t h) {  // groups h to h + 7
      const __m256 lows = octet_lows(step_low, h, per_unit);
      for (int i = 0; i < M; ++i)
        low_terms[i] = _mm256_fmadd_ps(lows, _mm256_loadu_ps(sums + i * groups + h), low_terms[i]);
    };
#endif
    int64_t g = 0;
    for (; g + 4 <= groups; g += 4) {
      const __m128i quad = _mm_loadu_si128(reinterpret_cast<const __m128i*>(step_low + 2 * g));
#ifdef SIMD_AVX512
      const __m128 quad_lows = _mm_mul_ps(_mm_cvtph_ps(_mm_shuffle_epi8(quad, quad_lows_bits)), per_unit);
      for (int i = 0; i < M; ++i) {
        const __m128 quad_sums = _mm_loadu_ps(sums + i * groups + g);  // 4 lanes; the other 4 are 0 x 0
        low_terms[i] = _mm256_fmadd_ps(_mm256_zextps128_ps256(quad_lows), _mm256_zextps128_ps256(quad_sums),
                                       low_terms[i]);
      }
      // the quad's 4 groups in one vector: 128-bit lane L holds group g + L's elements 0-15 in
      // q_low and 16-31 in q_high (the activations' units of 4, quantize_blocks), and its step
      const __m512i b = _mm512_loadu_si512(row + g * 16), nibble = _mm512_set1_epi8(0x0F);
      __m512i q_low = _mm512_and_si512(b, nibble), q_high = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
      if constexpr (Fifth) {  // vectors 0 and 2 of the planes under q_low, 1 and 3 under q_high
        const __m256i planes = fifth_planes(fifth_row + g * 4);
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(planes), _mm256_srli_epi16(planes, 2), 1);
        const __m512i bit = _mm512_set1_epi8(0x10);
        q_low = _mm512_or_si512(q_low, _mm512_and_si512(both, bit));
        q_high = _mm512_or_si512(q_high, _mm512_and_si512(_mm512_srli_epi16(both, 1), bit));
      }
      const __m512i quad_steps = _mm512_shuffle_epi8(
          _mm512_broadcast_i32x4(quad),
          _mm512_set_epi32(0x0D0C0D0C, 0x0D0C0D0C, 0x0D0C0D0C, 0x0D0C0D0C, 0x09080908, 0x09080908, 0x09080908,
                           0x09080908, 0x05040504, 0x05040504, 0x05040504, 0x05040504, 0x01000100, 0x01000100,
                           0x01000100, 0x01000100));
      for (int i = 0; i < M; ++i) {
        const int8_t* x = xq + i * K + g * 32;
        const __m512i pairs = _mm512_add_epi16(_mm512_maddubs_epi16(q_low, _mm512_loadu_si512(x)),
                                               _mm512_maddubs_epi16(q_high, _mm512_loadu_si512(x + 64)));
        const __m512i dots = _mm512_madd_epi16(pairs, quad_steps);
        wide[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_loadu_ps(scales + (i * groups + g) * 4), wide[i]);
      }
#else
      if constexpr (M <= kInlineLowRows) {
        if (g % 8 == 4) add_low_terms(g - 4);
      }
      const __m256i quad_steps = _mm256_broadcastsi128_si256(quad);
      __m256i planes = _mm256_setzero_si256();
      if constexpr (Fifth) planes = fifth_planes(fifth_row + g * 4);
      for (int h = 0; h < 4; h += 2) {
        __m256i q_low, q_high;
        unpack_pair(row + (g + h) * 16, q_low, q_high);
        if constexpr (Fifth) {
          q_low = _mm256_or_si256(q_low, fifth_vector(planes, h));
          q_high = _mm256_or_si256(q_high, fifth_vector(planes, h + 1));
        }
        const __m256i pair_steps = _mm256_shuffle_epi8(quad_steps, h == 0 ? first_pair : second_pair);
        for (int i = 0; i < M; ++i) {
          const __m256i dots = pair_sums(q_low, q_high, xq + i * K + (g + h) * 32, pair_steps);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_loadu_ps(scales + (i * groups + g + h) * 4),
                                   acc[i]);
        }
      }
#endif
    }
#ifndef SIMD_AVX512
    if constexpr (M > kInlineLowRows) {
      for (int64_t h = 0; h + 8 <= groups; h += 8) add_low_terms(h);
    }
    for (int64_t h = groups / 8 * 8; h < groups; ++h) {
      const float low = low_of(step_low, h);
      for (int i = 0; i < M; ++i) tail[i] += low * sums[i * groups + h];
    }
#endif
    const int64_t block_start = g;  // the groups left: a pair, or a last unpaired one, or both
    __m256i planes = _mm256_setzero_si256();
    if constexpr (Fifth) {
      if (g < groups) planes = fifth_planes(fifth_row + g * 4);
    }
    for (; g < groups; g += 2) {
      const int k = static_cast<int>(g - block_start);  // the group's first vector in the planes
      if (g + 1 < groups) {
        __m256i q_low, q_high;
        unpack_pair(row + g * 16, q_low, q_high);
        if constexpr (Fifth) {
          q_low = _mm256_or_si256(q_low, fifth_vector(planes, k));
          q_high = _mm256_or_si256(q_high, fifth_vector(planes, k + 1));
        }
        const __m256i pair_steps =
            _mm256_set_m128i(_mm_set1_epi16(step_low[2 * g + 2]), _mm_set1_epi16(step_low[2 * g]));
#ifdef SIMD_AVX512
        const float low0 = low_of(step_low, g), low1 = low_of(step_low, g + 1);
#endif
        for (int i = 0; i < M; ++i) {
          const __m256i dots = pair_sums(q_low, q_high, xq + i * K + g * 32, pair_steps);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_loadu_ps(scales + (i * groups + g) * 4), acc[i]);
#ifdef SIMD_AVX512
          const float* s = sums + i * groups + g;
          tail[i] += low0 * s[0] + low1 * s[1];
#endif
        }
      } else {  // bytes in element order: lanes j and j + 4 hold sub-block j
        const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * 16));
        __m256i q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
        if constexpr (Fifth) {  // elements 0-15 from vector k, 16-31 from k + 1, both at positions 0-15
          const __m256i lower = _mm256_permute2x128_si256(planes, planes, 0x00);
          const __m256i shifts = _mm256_setr_epi32(k, k, k, k, k + 1, k + 1, k + 1, k + 1);
          q = _mm256_or_si256(q, _mm256_and_si256(_mm256_srlv_epi32(lower, shifts), _mm256_set1_epi8(0x10)));
        }
        const __m256i step = _mm256_set1_epi16(step_low[2 * g]);
#ifdef SIMD_AVX512
        const float low = low_of(step_low, g);
#endif
        for (int i = 0; i < M; ++i) {
          const __m256i dots = _mm256_madd_epi16(products(q, xq + i * K + g * 32), step);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), lane_scales(scales + (i * groups + g) * 4), acc[i]);
#ifdef SIMD_AVX512
          tail[i] += low * sums[i * groups + g];
#endif
        }
      }
    }
    for (int i = 0; i < M; ++i) {
      float total = simd::sum8(_mm256_add_ps(acc[i], low_terms[i]));
#ifdef SIMD_AVX512
      total += _mm512_reduce_add_ps(wide[i]);
#endif
      y[i * N + o] = T(total * unit + tail[i]);
    }
  }
}

template <typename T>
at::Tensor int4_gemv_as(const at::Tensor& x, const at::Tensor& nibbles, const uint8_t* fifth,
                        const at::Tensor& steps_lows, const at::Tensor& units) {
  const int64_t M = x.size(0), N = nibbles.size(0), K = x.size(1), groups = K / 32;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantizedRows xq = quantize_rows<T>(x, true, Layout::kHalves);
  const uint8_t* w = nibbles.data_ptr<uint8_t>();
  const int16_t* sl = steps_lows.data_ptr<int16_t>();
  const float* un = units.data_ptr<float>();
  over_row_blocks<kRowGemvRowsPerBlock>(M, N, [&](auto rows, int64_t m0, int64_t r0, int64_t r1) {
    constexpr int R = decltype(rows)::value;
    const float *row_scales = xq.scales.get() + m0 * groups * 4, *row_sums = xq.sums.get() + m0 * groups;
    const int8_t* row_q = xq.q.get() + m0 * K;
    T* out = y.data_ptr<T>() + m0 * N;
    if (fifth != nullptr) {
      int4_rows<R, true>(row_q, row_scales, row_sums, K, w, fifth, sl, un, out, N, r0, r1);
    } else {
      int4_rows<R, false>(row_q, row_scales, row_sums, K, w, nullptr, sl, un, out, N, r0, r1);
    }
  });
  return y;
}

}  // namespace

namespace tokenmill {

// The int4 (or, with fifth_bits, 5-bit) product for any number of rows: the GEMV up to max_gemv_rows
// or for a layer without a dense copy, the dense copy beyond.
at::Tensor int4_rows_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& steps_lows,
                            const at::Tensor& units, const std::optional<at::Tensor>& fifth_bits,
                            const std::optional<at::Tensor>& dense, int64_t max_gemv_rows) {
  if (x.size(0) > max_gemv_rows && dense.has_value()) return at::linear(x, *dense);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "int4_rows_linear: x must be a 2-D bfloat16 or float32 tensor");
  const int64_t N = nibbles.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0 && nibbles.dim() == 2 && nibbles.size(1) * 2 == K &&
                  nibbles.scalar_type() == at::kByte && nibbles.is_contiguous(),
              "int4_rows_linear: nibbles must be contiguous uint8 (N, K / 2), K a multiple of 32");
  TORCH_CHECK(steps_lows.scalar_type() == at::kShort && steps_lows.is_contiguous() && steps_lows.numel() == N * K / 16,
              "int4_rows_linear: steps_lows must be contiguous int16 (N, K / 32, 2)");
  TORCH_CHECK(units.scalar_type() == at::kFloat && units.is_contiguous() && units.numel() == N,
              "int4_rows_linear: units must be contiguous float32 (N)");
  const uint8_t* fifth = nullptr;
  if (fifth_bits.has_value()) {
    TORCH_CHECK(fifth_bits->scalar_type() == at::kByte && fifth_bits->is_contiguous() &&
                    fifth_bits->numel() == N * fifth_row_bytes(K / 32),
                "int4_rows_linear: fifth_bits must be contiguous uint8 (N, 16 per 4 groups of 32, rounded up)");
    fifth = fifth_bits->data_ptr<uint8_t>();
  }
  return dtype == at::kFloat ? int4_gemv_as<float>(x, nibbles, fifth, steps_lows, units)
                             : int4_gemv_as<at::BFloat16>(x, nibbles, fifth, steps_lows, units);
}

// The int4 counterpart (PyTorch's packed kernel below the crossover, the dense copy above it):
// written here only so that the choice is made at run time, inside one compiled graph. The packed
// kernel runs in the dtype of the scales: fp32 activations are rounded to bf16 for it (see
// QuantLinear).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                       int64_t group_size, const std::optional<at::Tensor>& dense, int64_t max_packed_rows) {
  if (x.size(0) > max_packed_rows && dense.has_value()) return at::linear(x, *dense);
  return at::_weight_int4pack_mm_for_cpu(x.to(scales_zeros.scalar_type()), packed, group_size, scales_zeros)
      .to(x.scalar_type());  // both no-ops where the dtypes agree
}

}  // namespace tokenmill

namespace {

// y = x W^T for W (N, K) of 6-bit q (0..63) in sub-blocks of 16 along K, w = step x unit x (q - 32):
// GGUF's Q6_K, whose 16-value scales are each a step (int16) of the row's unit units[o] (> 0), as
// the int4 row layout's. K is a multiple of 256 (Q6_K's blocks), so the groups of 32 come in quads.
// Per pair of groups (g, g + 1) the kernel multiplies two vectors of 32 q: `int6_halves`' first
// halves of both groups (group g in bytes 0-15, g + 1 in 16-31), then their second halves, each
// with the activations laid out alike (quantize_blocks, kPairs). maddubs then sums in each int16
// lane two products of one 16-value sub-block and one activation scale, and the two vectors' lanes
// add up in int16 (at most 4 x 63 x 127); `madd` weighs the sub-blocks' lanes (in each int32 lane,
// one of elements 0-15 and one of 16-31) by their steps as it sums them, so each int32 lane is one
// activation sub-block, as the int4 GEMV's: 6 instructions per 64 products and row, where the int8
// GEMV takes 10. The -32 offset is each sub-block's step times its activation sum (`sums`, times
// -32), in FMA chains of their own.
//
// Row o's pair (g, g + 1) is the 32 bytes nibbles[o][16 g:], byte b holding the low 4 bits of the
// first vector's q b in its low nibble and of the second's in its high one; the quad of groups
// from g (a multiple of 4) has the q's top 2 bits in the 32 bytes highs[o][8 g:], bits 2k, 2k + 1
// of byte b for vector k (the first pair's two, then the second's); steps[o][2 g + h] is the step
// of group g's half h.
template <int M, typename T>
void int6_rows(const int8_t* xq, const float* scales, const float* sums, int64_t K, const uint8_t* nibbles,
               const uint8_t* highs, const int16_t* steps, const float* units, T* y, int64_t N, int64_t row0,
               int64_t row1) {
  const int64_t groups = K / 32;
  // a quad's 8 steps (16 bytes) as the int16 multipliers of its first pair and of its second
  const __m256i first_pair = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  const __m256i second_pair = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
  const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  for (int64_t o = row0; o < row1; ++o) {
    const uint8_t* row = nibbles + o * groups * 16;
    const uint8_t* row_highs = highs + o * groups * 8;
    const int16_t* row_steps = steps + o * groups * 2;
    // low_terms: their own FMA chains, as int4_rows', a quad at a time; in units of the row's unit,
    // as acc
    __m256 acc[M], low_terms[M];
    for (int i = 0; i < M; ++i) acc[i] = low_terms[i] = _mm256_setzero_ps();
    const auto add_low_terms = [&](int64_t g, __m128i quad) {
      const __m256 quad_steps = _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(quad));
      for (int i = 0; i < M; ++i)
        low_terms[i] = _mm256_fmadd_ps(quad_steps, _mm256_loadu_ps(sums + (i * groups + g) * 2), low_terms[i]);
    };
    for (int64_t g = 0; g < groups; g += 4) {
      const __m128i quad = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row_steps + 2 * g));
      if constexpr (M <= kInlineLowRows) add_low_terms(g, quad);
      const __m256i tops = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row_highs + g * 8));
      for (int h = 0; h < 2; ++h) {
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + (g + 2 * h) * 16));
        // vectors 2h and 2h + 1: their top bits moved to bits 4-5
        const __m256i first_tops = h == 0 ? _mm256_slli_epi16(tops, 4) : tops;
        const __m256i second_tops = h == 0 ? _mm256_slli_epi16(tops, 2) : _mm256_srli_epi16(tops, 2);
        const __m256i q_first = _mm256_or_si256(_mm256_and_si256(b, nibble), _mm256_and_si256(first_tops, top));
        const __m256i q_second =
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(b, 4), nibble), _mm256_and_si256(second_tops, top));
        const __m256i pair_steps =
            _mm256_permutevar8x32_epi32(_mm256_castsi128_si256(quad), h == 0 ? first_pair : second_pair);
        for (int i = 0; i < M; ++i) {
          const int8_t* x = xq + i * K + (g + 2 * h) * 32;
          const __m256i dots = pair_sums(q_first, q_second, x, pair_steps);
          acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dots), _mm256_loadu_ps(scales + (i * groups + g + 2 * h) * 4),
                                   acc[i]);
        }
      }
    }
    if constexpr (M > kInlineLowRows) {
      for (int64_t g = 0; g < groups; g += 4)
        add_low_terms(g, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row_steps + 2 * g)));
    }
    const float unit = units[o];
    for (int i = 0; i < M; ++i) y[i * N + o] = T(simd::sum8(_mm256_add_ps(acc[i], low_terms[i])) * unit);
  }
}

template <typename T>
at::Tensor int6_gemv_as(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& highs,
                        const at::Tensor& steps, const at::Tensor& units) {
  const int64_t M = x.size(0), N = nibbles.size(0), K = x.size(1), groups = K / 32;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const QuantizedRows xq = quantize_rows<T>(x, true, Layout::kPairs);
  over_row_blocks<kRowGemvRowsPerBlock>(M, N, [&](auto rows, int64_t m0, int64_t r0, int64_t r1) {
    int6_rows<decltype(rows)::value>(xq.q.get() + m0 * K, xq.scales.get() + m0 * groups * 4,
                                     xq.sums.get() + m0 * groups * 2, K, nibbles.data_ptr<uint8_t>(),
                                     highs.data_ptr<uint8_t>(), steps.data_ptr<int16_t>(), units.data_ptr<float>(),
                                     y.data_ptr<T>() + m0 * N, N, r0, r1);
  });
  return y;
}

}  // namespace

namespace tokenmill {

// The int6 product for any number of rows: the GEMV up to max_gemv_rows or for a layer without a
// dense copy, the dense copy beyond.
at::Tensor int6_rows_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& highs,
                            const at::Tensor& steps, const at::Tensor& units, const std::optional<at::Tensor>& dense,
                            int64_t max_gemv_rows) {
  if (x.size(0) > max_gemv_rows && dense.has_value()) return at::linear(x, *dense);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "int6_rows_linear: x must be a 2-D bfloat16 or float32 tensor");
  const int64_t N = nibbles.size(0), K = x.size(1);
  TORCH_CHECK(K % 256 == 0 && nibbles.dim() == 2 && nibbles.size(1) * 2 == K && nibbles.scalar_type() == at::kByte &&
                  nibbles.is_contiguous(),
              "int6_rows_linear: nibbles must be contiguous uint8 (N, K / 2), K a multiple of 256");
  TORCH_CHECK(highs.scalar_type() == at::kByte && highs.is_contiguous() && highs.numel() == N * K / 4,
              "int6_rows_linear: highs must be contiguous uint8 (N, K / 4)");
  TORCH_CHECK(steps.scalar_type() == at::kShort && steps.is_contiguous() && steps.numel() == N * K / 16,
              "int6_rows_linear: steps must be contiguous int16 (N, K / 16)");
  TORCH_CHECK(units.scalar_type() == at::kFloat && units.is_contiguous() && units.numel() == N,
              "int6_rows_linear: units must be contiguous float32 (N)");
  return dtype == at::kFloat ? int6_gemv_as<float>(x, nibbles, highs, steps, units)
                             : int6_gemv_as<at::BFloat16>(x, nibbles, highs, steps, units);
}

}  // namespace tokenmill

namespace {

// Tiles: the same products as an outer product, for the many activation rows of a prompt (AVX-512
// with VNNI). The GEMVs above keep a weight row's dot products in lanes that must be summed across
// at the end of every row and block of 8 activation rows (a large share of their instructions on
// narrow layers); here 16 weight rows (a tile) sit side by side in the lanes of a vector, each
// activation element is broadcast to them, and the sums land in 16 outputs at once. A tile stores,
// per group of 32 and quarter j of it (elements 4j..4j+3 and 16+4j..16+4j+3), the q of the tile's 16
// rows at those elements as two vectors of 64 bytes, byte 4c + e holding row c's q at element 4j + e
// in the first and 16 + 4j + e in the second. 4-bit q share bytes (the first vector in the low
// nibbles, the second in the high: 64 bytes per quarter), 8-bit q take one byte each (128), and 5-bit
// q add a 64-bit mask of fifth bits per vector. Each group's float scale and low per row come apart
// (tile_scales: (N / 16, K / 32, 2, 16), float32 or float16, or one float32 pair per row for all
// groups, (N / 16, 1, 2, 16): an int8 row's q + 128 and -128 x its scale), so that
// w = scale x q + low. dpbusd makes each row's sum of 4 products per instruction, and a group's 8 of
// them add up in int32 lanes.
//
// The activations come with one scale per 8 (x_block 8, as for the GEMVs) or per group of 32
// (x_block 32: quantize_blocks, coarse). Per 32 a group's 8 dpbusd add up in int32 lanes and are
// converted and scaled once instead of four times, which makes the kernel faster, but rounds small
// activations next to large ones more coarsely, which costs the MLP's down projections (whose
// inputs hold the outliers) the most perplexity: models take 8 there and 32 elsewhere
// (`QuantLinear.x_block`, `quant_linear.FINE_X_BLOCK`).
// Tiles need VNNI: without it, dot4's pairs of products of int8 q + 128 (up to 255) with x overflow int16.
#if defined(SIMD_AVX512) && defined(__AVX512VNNI__)
#define TILES_BUILT 1
#endif

#ifdef TILES_BUILT
// acc plus dpbusd of unsigned_q with the 4 activation bytes at x in every lane, x read by the
// instruction's own broadcast operand ({1to16}). GCC emits _mm512_set1_epi32 of a load as a
// vpbroadcastd of its own, one more instruction for every vpdpbusd of the tile loop; the asm
// folds it into the operand (tuning log: `quant_tiles_linear`).
typedef int32_t __attribute__((may_alias, aligned(1))) four_bytes;
inline __m512i dot4_broadcast(__m512i acc, __m512i unsigned_q, const int8_t* x) {
  __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(unsigned_q), "m"(*reinterpret_cast<const four_bytes*>(x)));
  return acc;
}

// Bytes of one tile's q per group (Bits 4, 6 or 8), and of its fifth-bit masks (5-bit)
constexpr int64_t tile_group_bytes(int bits) { return bits == 8 ? 512 : bits == 6 ? 384 : 256; }
constexpr int64_t kTileFifthGroupBytes = 64;
// Groups ahead of the products that a thread asks the memory for (16: 4 KB of 4-bit tiles, the
// L2 streamer's reach ends at each 4 KB page). The hardware prefetchers do not keep up with the
// short streams of small layers, so without these requests a batch-1 step reads its weights well
// below the memory's speed. The distance is not critical (half or twice it serve as well). Only the
// first block of activation rows asks (quant_tiles' prefetch).
constexpr int64_t kTilePrefetchGroups = 16;

// 16 scales or lows of a tile, as float32 or float16 (S)
inline __m512 load_scales(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load_scales(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Compact tile scales (S = uint8_t), for the K-quants' two levels: per tile and block of 8 groups,
// kCompactBlockBytes bytes holding each group's 16 scale multiples and 16 low multiples (uint8),
// then the block's 16 scale units and 16 low units (float32). A group's scale is multiple x unit,
// exact in float32 as the packer checks, so the products equal those with float32 scales; 48 bytes
// a group where float32 takes 128 (4.75 bits a 4-bit weight against 6).
constexpr int64_t kCompactGroups = 8;
constexpr int64_t kCompactBlockBytes = kCompactGroups * 32 + 128;

// Group g's 16 scales and 16 lows of the tile whose scales start at ts
template <typename S>
inline void group_scales(const S* ts, int64_t g, __m512& scale, __m512& low) {
  if constexpr (std::is_same_v<S, uint8_t>) {
    const uint8_t* block = ts + (g / kCompactGroups) * kCompactBlockBytes;
    const uint8_t* multiples = block + (g % kCompactGroups) * 32;
    const float* units = reinterpret_cast<const float*>(block + kCompactGroups * 32);
    const auto widen = [](const uint8_t* p) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
    };
    scale = _mm512_mul_ps(widen(multiples), _mm512_loadu_ps(units));
    low = _mm512_mul_ps(widen(multiples + 16), _mm512_loadu_ps(units + 16));
  } else {
    scale = load_scales(ts + g * 32);
    low = load_scales(ts + g * 32 + 16);
  }
}

// Elements of S per tile of a layer's tile scales with this many groups (per group, or per row)
template <typename S>
constexpr int64_t tile_scales_size(int64_t groups, bool row_scales) {
  if constexpr (std::is_same_v<S, uint8_t>) return groups / kCompactGroups * kCompactBlockBytes;
  return (row_scales ? 1 : groups) * 32;
}

// xq, scales and sums: a block of M activation rows in quantize_blocks' kRowBlocks layout. The output
// rows are float32 (y) or bf16 (y_bf16, where not null): a choice made at run time, once per tile and
// row, rather than a template argument, which would double the kernel's instantiations and the
// build's time for the same loop. row_totals:
// with one scale and low per weight row (tile_scales (N / 16, 1, 2, 16)), each activation row's sum
// of x, whose product with the low is added once after the last group; else nullptr. prefetch: whether
// to ask the memory for the weights ahead; over_row_blocks' first block of activation rows does, and
// the later blocks find the tiles in cache, where the requests would take load slots for nothing.
template <int M, int Bits, bool Fifth, bool Fine, typename S>
void quant_tiles(const int8_t* xq, const float* scales, const float* sums, const float* row_totals, int64_t K,
                 const uint8_t* tiles, const uint8_t* fifth, const S* tile_scales, float* y, at::BFloat16* y_bf16,
                 int64_t N, int64_t tile0, int64_t tile1, bool prefetch) {
  const bool row_scales = row_totals != nullptr;
  const int64_t groups = K / 32, scale_stride = row_scales ? 0 : 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
  for (int64_t t = tile0; t < tile1; ++t) {
    const uint8_t* q = tiles + t * groups * tile_group_bytes(Bits);
    const S* ts = tile_scales + t * tile_scales_size<S>(groups, row_scales);
    __m512 acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      if (prefetch) {  // into the task's next tiles, or past them: a prefetch never faults
        const int64_t ahead = g + kTilePrefetchGroups;
        const char* bytes = reinterpret_cast<const char*>(q + ahead * tile_group_bytes(Bits));
        for (int64_t line = 0; line < tile_group_bytes(Bits); line += 64) _mm_prefetch(bytes + line, _MM_HINT_T0);
        if constexpr (std::is_same_v<S, uint8_t>)
          _mm_prefetch(reinterpret_cast<const char*>(ts + ahead * kCompactBlockBytes / kCompactGroups), _MM_HINT_T0);
        else
          _mm_prefetch(reinterpret_cast<const char*>(ts + ahead * scale_stride), _MM_HINT_T0);
        if constexpr (Fifth)
          _mm_prefetch(reinterpret_cast<const char*>(fifth + (t * groups + ahead) * kTileFifthGroupBytes), _MM_HINT_T0);
      }
      __m512i whole[M];  // each row's integer sums over the group, under its one activation scale
      __m512 fine[M];    // the group's sums scaled by the activations' scales
      if constexpr (!Fine)
        for (int i = 0; i < M; ++i) whole[i] = _mm512_setzero_si512();
#pragma GCC unroll 4
      for (int j = 0; j < 4; ++j) {
        __m512i first, second;
        if constexpr (Bits == 8) {
          first = _mm512_loadu_si512(q + (g * 4 + j) * 128);
          second = _mm512_loadu_si512(q + (g * 4 + j) * 128 + 64);
        } else {
          const __m512i b = _mm512_loadu_si512(q + (g * 4 + j) * 64);
          first = _mm512_and_si512(b, nibble);
          second = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
          if constexpr (Fifth) {
            const uint8_t* masks = fifth + (t * groups + g) * kTileFifthGroupBytes + j * 16;
            __mmask64 m0, m1;
            std::memcpy(&m0, masks, 8);
            std::memcpy(&m1, masks + 8, 8);
            first = _mm512_mask_add_epi8(first, m0, first, bit4);
            second = _mm512_mask_add_epi8(second, m1, second, bit4);
          }
        }
        for (int i = 0; i < M; ++i) {
          const int8_t* x = xq + (g * M + i) * 32 + 4 * j;
          if constexpr (Fine) {  // a scale per quarter j: its sums converted and scaled apart
            const __m512i d = dot4_broadcast(dot4_broadcast(_mm512_setzero_si512(), first, x), second, x + 16);
            fine[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_set1_ps(scales[(g * M + i) * 4 + j]),
                                      j != 0 ? fine[i] : row_scales ? acc[i] : _mm512_setzero_ps());
          } else {
            whole[i] = dot4_broadcast(dot4_broadcast(whole[i], first, x), second, x + 16);
          }
        }
      }
      if constexpr (!Fine)
        for (int i = 0; i < M; ++i) {
          const __m512 sums_x = _mm512_cvtepi32_ps(whole[i]), scale_x = _mm512_set1_ps(scales[(g * M + i) * 4]);
          fine[i] = row_scales ? _mm512_fmadd_ps(sums_x, scale_x, acc[i]) : _mm512_mul_ps(sums_x, scale_x);
        }
      if (row_scales) {  // fine already holds acc: the rows' scale and low apply once, after the last group
        for (int i = 0; i < M; ++i) acc[i] = fine[i];
        continue;
      }
      __m512 group_scale, group_low;
      group_scales(ts, g, group_scale, group_low);
      for (int i = 0; i < M; ++i) {
        acc[i] = _mm512_fmadd_ps(fine[i], group_scale, acc[i]);
        acc[i] = _mm512_fmadd_ps(group_low, _mm512_set1_ps(sums[g * M + i]), acc[i]);
      }
    }
    if (row_scales) {
      __m512 row_scale, row_low;
      group_scales(ts, 0, row_scale, row_low);
      for (int i = 0; i < M; ++i)
        acc[i] = _mm512_fmadd_ps(row_low, _mm512_set1_ps(row_totals[i]), _mm512_mul_ps(acc[i], row_scale));
    }
    // bf16 rounded in vector registers (simd::store): rounding one lane at a time would cost a
    // large share of a small product
    for (int i = 0; i < M; ++i)
      y_bf16 != nullptr ? simd::store(y_bf16 + i * N + t * 16, acc[i]) : simd::store(y + i * N + t * 16, acc[i]);
  }
}

// Tiles per task, and per chunk of tiles that each block of activation rows passes through while
// the chunk's weights stay in cache
constexpr int64_t kTilesPerTask = 2;
constexpr int64_t kTilesPerChunk = 4;

// A tile kernel's (M, N) output in x's dtype T, which it writes as float or as bf16 values: a new
// tensor, or `into` (checked by quant_tiles_linear_into)
template <typename T>
struct TileOutput {
  at::Tensor y;
  float* f32;          // y's values where T is float, else null
  at::BFloat16* bf16;  // y's values where T is bf16, else null
  TileOutput(const at::Tensor& x, int64_t N, const std::optional<at::Tensor>& into)
      : y(into.has_value() ? *into : at::empty({x.size(0), N}, x.options())),
        f32(std::is_same_v<T, float> ? y.data_ptr<float>() : nullptr),
        bf16(std::is_same_v<T, float> ? nullptr : y.data_ptr<at::BFloat16>()) {}
  float* f32_at(int64_t offset) const { return f32 ? f32 + offset : nullptr; }
  at::BFloat16* bf16_at(int64_t offset) const { return bf16 ? bf16 + offset : nullptr; }
};

template <int Bits, bool Fifth, bool Fine, typename T, typename S>
at::Tensor quant_tiles_as(const at::Tensor& x, const at::Tensor& tiles, const uint8_t* fifth,
                          const at::Tensor& tile_scales, const std::optional<at::Tensor>& into) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / 32, N = tile_scales.size(0) * 16;
  const TileOutput<T> out(x, N, into);
  if (M == 0) return out.y;
  const QuantizedRows xq = quantize_rows<T>(x, true, Layout::kRowBlocks, !Fine);
  std::vector<float> totals;  // per activation row, for weights with one scale per row (quant_tiles)
  if (!std::is_same_v<S, uint8_t> && tile_scales.size(1) == 1) {
    totals.assign(M, 0.0f);
    for (int64_t i = 0; i < M; ++i)
      for (int64_t g = 0; g < groups; ++g) totals[i] += xq.sums[row_block_place(i, g, M, groups)];
  }
  const uint8_t* q = tiles.data_ptr<uint8_t>();
  const S* ts = tile_scales.data_ptr<S>();
  over_row_blocks(
      M, N / 16,
      [&](auto rows, int64_t m0, int64_t t0, int64_t t1) {
        quant_tiles<decltype(rows)::value, Bits, Fifth, Fine, S>(
            xq.q.get() + m0 * K, xq.scales.get() + m0 * groups * 4, xq.sums.get() + m0 * groups,
            totals.empty() ? nullptr : totals.data() + m0, K, q, fifth, ts, out.f32_at(m0 * N),
            out.bf16_at(m0 * N), N, t0, t1, m0 == 0);
      },
      kTilesPerTask, kTilesPerChunk);
  return out.y;
}

// 6-bit tiles (GGUF's Q6_K, exact): w = d x step x (q - 32), q in 0..63, an int8 step per 16
// values and a float d per 256 of a row. A group's q come as the 4-bit tiles' nibbles plus a
// vector of top bits per pair of quarters (`tile_group_bytes(6)`: 384 bytes). The group's first and
// second halves (the quarters' first and second vectors) have scales of their own, so their sums
// are kept apart, each starting from the activations' sum over its 16 values times -32
// (quantize_rows' `half_sums`) for the offset. With x_block 8 the activations take one scale per 8
// consecutive values (`consecutive`) rather than per quarter: a pair of quarters' first vectors
// (values 8p..8p+7) then share one, as do their second ones, so each pair's sums are converted
// and scaled once per half, where the quarters' scales would span both halves and take twice the
// conversions. The scales, per tile and block of 8 groups (kQ6BlockBytes): the int8 steps [group,
// half, row], then the rows' d (float32). 6.6 bits a weight where int8 re-rounded per row takes 8.
constexpr int64_t kQ6BlockBytes = kCompactGroups * 32 + 64;

// M activation rows of a kRowBlocks block of `stride` rows (xq, scales and half_sums at its first).
// A group's halves go through one after the other, each over both pairs of quarters, so that a row
// holds two accumulators at a time (its half's sum and its own), 16 for a block of 8, which stay in
// the vector registers with either x_block; the block's rows share each group's unpacked q.
template <int M, bool Fine>
void q6_tiles(const int8_t* xq, const float* scales, const float* half_sums, int64_t stride, int64_t K,
              const uint8_t* tiles, const uint8_t* tile_scales, float* y, at::BFloat16* y_bf16, int64_t N,
              int64_t tile0, int64_t tile1, bool prefetch) {
  const int64_t groups = K / 32;
  const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
  // (a & nibble) | b: the low 4 bits of a, then b's top bits (already in bits 4-5, the rest zero)
  const auto join = [&](__m512i a, __m512i b) { return _mm512_ternarylogic_epi32(a, b, nibble, 0xEC); };
  for (int64_t t = tile0; t < tile1; ++t) {
    const uint8_t* q = tiles + t * groups * tile_group_bytes(6);
    const uint8_t* ts = tile_scales + t * (groups / kCompactGroups) * kQ6BlockBytes;
    __m512 acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* group = q + g * tile_group_bytes(6);
      if (prefetch) {  // as quant_tiles
        const char* bytes = reinterpret_cast<const char*>(group + kTilePrefetchGroups * tile_group_bytes(6));
        for (int64_t line = 0; line < tile_group_bytes(6); line += 64) _mm_prefetch(bytes + line, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(ts + (g + kTilePrefetchGroups) * kQ6BlockBytes / kCompactGroups),
                     _MM_HINT_T0);
      }
      const int8_t* xg = xq + g * stride * 32;  // row i's values at xg + 32 i
      const float *sg = scales + g * stride * 4, *hg = half_sums + g * stride * 2;
      const uint8_t* block = ts + (g / kCompactGroups) * kQ6BlockBytes;
      const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(block + kCompactGroups * 32));
      const int8_t* steps = reinterpret_cast<const int8_t*>(block + (g % kCompactGroups) * 32);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m512 half_scale = _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(steps + 16 * h)))),
            d);
        __m512i whole[M];  // each row's integer sums over the half under its one activation scale
        __m512 part[M];    // -32 x the activations' sum over the half, plus the sums scaled by their scales
        for (int i = 0; i < M; ++i) {
          part[i] = _mm512_set1_ps(hg[i * 2 + h]);
          whole[i] = _mm512_setzero_si512();
        }
#pragma GCC unroll 2
        for (int p = 0; p < 2; ++p) {
          const __m512i tops = _mm512_loadu_si512(group + 256 + p * 64);
          const __m512i even = _mm512_loadu_si512(group + 2 * p * 64);
          const __m512i odd = _mm512_loadu_si512(group + 2 * p * 64 + 64);
          // the half's vectors of quarters 2p and 2p + 1: first halves with the top bits from bits 0-1
          // and 4-5, second halves from bits 2-3 and 6-7
          const __m512i q0 =
              h == 0 ? join(even, _mm512_and_si512(_mm512_slli_epi16(tops, 4), top))
                     : join(_mm512_srli_epi16(even, 4), _mm512_and_si512(_mm512_slli_epi16(tops, 2), top));
          const __m512i q1 =
              h == 0 ? join(odd, _mm512_and_si512(tops, top))
                     : join(_mm512_srli_epi16(odd, 4), _mm512_and_si512(_mm512_srli_epi16(tops, 2), top));
          for (int i = 0; i < M; ++i) {
            const int8_t* x = xg + i * 32 + 16 * h + 8 * p;  // values 16h + 8p..
            const __m512i start = Fine ? _mm512_setzero_si512() : whole[i];
            const __m512i sums = dot4_broadcast(dot4_broadcast(start, q0, x), q1, x + 4);
            if constexpr (Fine)  // the consecutive 8 values' scale, 8p.. in half h: scale 2h + p
              part[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(sg[i * 4 + 2 * h + p]), part[i]);
            else
              whole[i] = sums;
          }
        }
        for (int i = 0; i < M; ++i) {
          if constexpr (!Fine)
            part[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(whole[i]), _mm512_set1_ps(sg[i * 4]), part[i]);
          acc[i] = _mm512_fmadd_ps(part[i], half_scale, acc[i]);
        }
      }
    }
    for (int i = 0; i < M; ++i)
      y_bf16 != nullptr ? simd::store(y_bf16 + i * N + t * 16, acc[i]) : simd::store(y + i * N + t * 16, acc[i]);
  }
}

template <bool Fine, typename T>
at::Tensor q6_tiles_as(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales,
                       const std::optional<at::Tensor>& into) {
  const int64_t M = x.size(0), K = x.size(1), groups = K / 32, N = tile_scales.size(0) * 16;
  const TileOutput<T> out(x, N, into);
  if (M == 0) return out.y;
  const QuantizedRows xq = quantize_rows<T>(x, true, Layout::kRowBlocks, !Fine, true, Fine);
  const uint8_t* q = tiles.data_ptr<uint8_t>();
  const uint8_t* ts = tile_scales.data_ptr<uint8_t>();
  over_row_blocks(
      M, N / 16,
      [&](auto rows, int64_t m0, int64_t t0, int64_t t1) {
        q6_tiles<decltype(rows)::value, Fine>(xq.q.get() + m0 * K, xq.scales.get() + m0 * groups * 4,
                                              xq.sums.get() + m0 * groups * 2, decltype(rows)::value, K, q, ts,
                                              out.f32_at(m0 * N), out.bf16_at(m0 * N), N, t0, t1, m0 == 0);
      },
      kTilesPerTask, kTilesPerChunk);
  return out.y;
}

// AMX: with many activation rows the tile kernel's integer products give way to the CPU's matrix
// unit, fed bf16. Each (tile, group) of weights is dequantized once (w = scale x q + low, rounded to
// bf16 as a dense copy is) into a B tile, 16 k-pairs x 16 weight rows, which then multiplies every
// block of 16 activation rows (A tiles, read in place from the bf16 rows) with tdpbf16ps into fp32
// C tiles that hold the sums over the whole row: no activation rounding, no per-group scaling of
// outputs. The dequantization (~150 vector instructions a group of 512 weights) does not depend on
// the number of rows, so this wins from about a block of rows on (`quant_linear.AMX_MIN_TOKENS`);
// the weights stay in their bytes.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define AMX_BUILT 1
#include <sys/syscall.h>
#include <unistd.h>

// Linux hands out the AMX state only to processes that ask (oneDNN asks too; asking twice is fine)
bool amx_permitted() {
  static const bool permitted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return permitted;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// All 16 rows x 64 bytes. amx_tiles: tmm0-3 C (up to 4 blocks of 16 activation rows), tmm4 A, tmm5 B;
// amx_tiles_panels: tmm0-3 C (2 x 2), tmm4-5 A, tmm6-7 B. GCC 12's _tile_loadconfig tells the
// compiler it reads only the pointer, which lets it drop the stores that fill the struct; the
// empty asm that reads the whole struct keeps them.
void load_tile_config() {
  TileConfig config;
  for (int i = 0; i < 8; ++i) config.rows[i] = 16, config.colsb[i] = 64;
  __asm__ volatile("" : : "m"(config));
  _tile_loadconfig(&config);
}

// Byte indices (in byte 1 of each int32 lane, for mask_permutexvar_epi8) that take a tile vector's
// bytes (4c + e: row c's q at element base + e) to a B tile row: lane l of the first half holds row
// l / 2 at element base + l % 2 (even) or base + 2 + l % 2 (odd), the second half rows 8-15
inline __m512i b_row_indices(bool odd, bool second_half) {
  alignas(64) int32_t lanes[16];
  for (int l = 0; l < 16; ++l) lanes[l] = (4 * (l / 2) + l % 2 + (odd ? 2 : 0) + (second_half ? 32 : 0)) << 8;
  return _mm512_load_si512(lanes);
}

// q to bf16 scale x q + low, 32 at a time. A q byte dropped into bits 8-15 of 1.0f makes the float
// 1 + q 2^-15, so one FMA with scale 2^15 and low - scale 2^15 gives the weight, no conversion
// (the low's rounding errs by at most scale / 512, 16x less than the bf16 weight's rounding).
struct Dequantizer {
  const __m512i index[2][2] = {{b_row_indices(false, false), b_row_indices(false, true)},
                               {b_row_indices(true, false), b_row_indices(true, true)}};
  const __m512i pair_first = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  const __m512i pair_second = _mm512_setr_epi32(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14, 15, 15);
  const __m512i one = _mm512_set1_epi32(0x3F800000);
  static constexpr __mmask64 kByte1 = 0x2222222222222222ULL;
  static constexpr float kMagicScale = 32768.0f;

  // The two B rows (k-pairs base / 2 and base / 2 + 1) of a tile vector v for elements base..base+3
  inline void rows(__m512i v, const __m512 (&scale)[2], const __m512 (&low)[2], uint16_t* out) const {
    for (int odd = 0; odd < 2; ++odd) {
      __m512 half[2];
      for (int h = 0; h < 2; ++h) {
        const __m512 q = _mm512_castsi512_ps(_mm512_mask_permutexvar_epi8(one, kByte1, index[odd][h], v));
        half[h] = _mm512_fmadd_ps(q, scale[h], low[h]);
      }
      _mm512_storeu_si512(out + odd * 32, (__m512i)_mm512_cvtne2ps_pbh(half[1], half[0]));
    }
  }

  // The permuted scales and lows (low minus the magic scale) that `rows` takes, of 16 rows'
  inline void pairs(__m512 group_scale, __m512 l, __m512 (&scale)[2], __m512 (&low)[2]) const {
    const __m512 s = _mm512_mul_ps(group_scale, _mm512_set1_ps(kMagicScale));
    scale[0] = _mm512_permutexvar_ps(pair_first, s), scale[1] = _mm512_permutexvar_ps(pair_second, s);
    low[0] = _mm512_sub_ps(_mm512_permutexvar_ps(pair_first, l), scale[0]);
    low[1] = _mm512_sub_ps(_mm512_permutexvar_ps(pair_second, l), scale[1]);
  }

  // A group of a 6-bit tile (q6_tiles' layout: w = scale x (q - 32), its halves of 16 values with
  // scales of their own) as a B tile
  inline void group6(const uint8_t* q, __m512 first_scale, __m512 second_scale, uint16_t* out) const {
    __m512 scale[2][2], low[2][2];
    const __m512 offset = _mm512_set1_ps(-32.0f);
    pairs(first_scale, _mm512_mul_ps(first_scale, offset), scale[0], low[0]);
    pairs(second_scale, _mm512_mul_ps(second_scale, offset), scale[1], low[1]);
    const __m512i nibble = _mm512_set1_epi8(0x0F), top = _mm512_set1_epi8(0x30);
    const auto join = [&](__m512i a, __m512i b) { return _mm512_ternarylogic_epi32(a, b, nibble, 0xEC); };
    for (int p = 0; p < 2; ++p) {  // quarters 2p (even) and 2p + 1 (odd), their top bits as q6_tiles reads them
      const __m512i tops = _mm512_loadu_si512(q + 256 + p * 64);
      const __m512i even = _mm512_loadu_si512(q + 2 * p * 64), odd = _mm512_loadu_si512(q + 2 * p * 64 + 64);
      rows(join(even, _mm512_and_si512(_mm512_slli_epi16(tops, 4), top)), scale[0], low[0], out + (4 * p) * 32);
      rows(join(odd, _mm512_and_si512(tops, top)), scale[0], low[0], out + (4 * p + 2) * 32);
      rows(join(_mm512_srli_epi16(even, 4), _mm512_and_si512(_mm512_slli_epi16(tops, 2), top)), scale[1], low[1],
           out + (8 + 4 * p) * 32);
      rows(join(_mm512_srli_epi16(odd, 4), _mm512_and_si512(_mm512_srli_epi16(tops, 2), top)), scale[1], low[1],
           out + (8 + 4 * p + 2) * 32);
    }
  }

  // A group of a tile (its 16 rows' scales and lows) as a B tile (16 rows of 32 bf16: row p holds
  // elements 2p, 2p + 1 of each weight row)
  template <int Bits, bool Fifth>
  inline void group(const uint8_t* q, const uint8_t* fifth, __m512 group_scale, __m512 l, uint16_t* out) const {
    __m512 scale[2], low[2];
    pairs(group_scale, l, scale, low);
    const __m512i nibble = _mm512_set1_epi8(0x0F), bit4 = _mm512_set1_epi8(0x10);
    for (int j = 0; j < 4; ++j) {
      __m512i first, second;  // elements 4j..4j+3 and 16+4j..16+4j+3
      if constexpr (Bits == 8) {
        first = _mm512_loadu_si512(q + j * 128);
        second = _mm512_loadu_si512(q + j * 128 + 64);
      } else {
        const __m512i b = _mm512_loadu_si512(q + j * 64);
        first = _mm512_and_si512(b, nibble);
        second = _mm512_and_si512(_mm512_srli_epi16(b, 4), nibble);
        if constexpr (Fifth) {
          __mmask64 m0, m1;
          std::memcpy(&m0, fifth + j * 16, 8);
          std::memcpy(&m1, fifth + j * 16 + 8, 8);
          first = _mm512_mask_add_epi8(first, m0, first, bit4);
          second = _mm512_mask_add_epi8(second, m1, second, bit4);
        }
      }
      rows(first, scale, low, out + (2 * j) * 32);
      rows(second, scale, low, out + (8 + 2 * j) * 32);
    }
  }
};

// C tiles 0..Blocks-1 += A x B: A the Blocks blocks of 16 activation rows from x (rows of row_stride elements)
template <int Blocks>
inline void multiply_blocks(const uint16_t* x, int64_t row_stride, const uint16_t* b) {
  _tile_loadd(5, b, 64);
  _tile_loadd(4, x, row_stride * 2);
  _tile_dpbf16ps(0, 4, 5);
  if constexpr (Blocks > 1) {
    _tile_loadd(4, x + 16 * row_stride, row_stride * 2);
    _tile_dpbf16ps(1, 4, 5);
  }
  if constexpr (Blocks > 2) {
    _tile_loadd(4, x + 32 * row_stride, row_stride * 2);
    _tile_dpbf16ps(2, 4, 5);
  }
  if constexpr (Blocks > 3) {
    _tile_loadd(4, x + 48 * row_stride, row_stride * 2);
    _tile_dpbf16ps(3, 4, 5);
  }
}

template <int Blocks>
inline void zero_blocks() {
  _tile_zero(0);
  if constexpr (Blocks > 1) _tile_zero(1);
  if constexpr (Blocks > 2) _tile_zero(2);
  if constexpr (Blocks > 3) _tile_zero(3);
}

template <int Blocks>
inline void store_blocks(float* c) {
  _tile_stored(0, c, 64);
  if constexpr (Blocks > 1) _tile_stored(1, c + 256, 64);
  if constexpr (Blocks > 2) _tile_stored(2, c + 512, 64);
  if constexpr (Blocks > 3) _tile_stored(3, c + 768, 64);
}

constexpr int64_t kAmxBlocks = 4;  // C tiles: activation rows per pass, 64

// Group g of tile t of a layer's tiles (tile_scales: per group, compact, or one pair per row) into a
// B tile at out
template <int Bits, bool Fifth, typename S>
inline void dequantize_group(const Dequantizer& dequantizer, const uint8_t* tiles, const uint8_t* fifth,
                             const S* tile_scales, bool row_scales, int64_t groups, int64_t t, int64_t g,
                             uint16_t* out) {
  if constexpr (Bits == 6) {  // Q6_K's: d x step per half of a group, kQ6BlockBytes per block of 8 groups
    const uint8_t* block = tile_scales + (t * groups + g) / kCompactGroups * kQ6BlockBytes;
    const __m512 d = _mm512_loadu_ps(reinterpret_cast<const float*>(block + kCompactGroups * 32));
    const int8_t* steps = reinterpret_cast<const int8_t*>(block + (g % kCompactGroups) * 32);
    const auto half_scale = [&](int h) {
      return _mm512_mul_ps(
          _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(steps + 16 * h)))),
          d);
    };
    dequantizer.group6(tiles + (t * groups + g) * tile_group_bytes(6), half_scale(0), half_scale(1), out);
  } else {
    __m512 scale, low;
    group_scales(tile_scales + t * tile_scales_size<S>(groups, row_scales), row_scales ? 0 : g, scale, low);
    dequantizer.group<Bits, Fifth>(tiles + (t * groups + g) * tile_group_bytes(Bits),
                                   Fifth ? fifth + (t * groups + g) * kTileFifthGroupBytes : nullptr, scale, low, out);
  }
}

// The first `rows` rows of a stored C tile (16 x 16 fp32 at c) as bf16 into y's tile column t
inline void write_rows(const float* c, int64_t rows, uint16_t* y, int64_t N, int64_t t) {
  for (int64_t i = 0; i < rows; ++i) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i * N + t * 16),
                        (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(c + i * 16)));
  }
}

// y (M, N, bf16) = x (bf16, padded with zeros to Mp rows) W^T, for the tiles [tile0, tile1)
template <int Bits, bool Fifth, typename S>
void amx_tiles(const uint16_t* x, int64_t M, int64_t Mp, int64_t K, const uint8_t* tiles, const uint8_t* fifth,
               const S* tile_scales, bool row_scales, uint16_t* y, int64_t N, int64_t tile0, int64_t tile1) {
  const int64_t groups = K / 32;
  const Dequantizer dequantizer;
  thread_local std::vector<uint16_t> dequantized;  // the tile's B tiles, one per group
  dequantized.resize(groups * 512);
  uint16_t* b = dequantized.data();
  alignas(64) float c[kAmxBlocks * 256];
  load_tile_config();
  for (int64_t t = tile0; t < tile1; ++t) {
    const auto dequantize = [&](int64_t g) {
      dequantize_group<Bits, Fifth>(dequantizer, tiles, fifth, tile_scales, row_scales, groups, t, g, b + g * 512);
    };
    for (int64_t m0 = 0; m0 < Mp; m0 += 16 * kAmxBlocks) {
      const int64_t blocks = std::min<int64_t>(kAmxBlocks, (Mp - m0) / 16);
      const auto pass = [&](auto count) {
        constexpr int kBlocks = decltype(count)::value;
        zero_blocks<kBlocks>();
        if (m0 == 0) {  // each group's products one group behind its dequantization, which they overlap
          dequantize(0);
          for (int64_t g = 1; g < groups; ++g) {
            dequantize(g);
            multiply_blocks<kBlocks>(x + g * 32 - 32, K, b + g * 512 - 512);
          }
          multiply_blocks<kBlocks>(x + groups * 32 - 32, K, b + groups * 512 - 512);
        } else {
          for (int64_t g = 0; g < groups; ++g) multiply_blocks<kBlocks>(x + m0 * K + g * 32, K, b + g * 512);
        }
        store_blocks<kBlocks>(c);
      };
      switch (blocks) {
        case 1: pass(std::integral_constant<int, 1>{}); break;
        case 2: pass(std::integral_constant<int, 2>{}); break;
        case 3: pass(std::integral_constant<int, 3>{}); break;
        default: pass(std::integral_constant<int, 4>{}); break;
      }
      write_rows(c, std::min(16 * blocks, M - m0), y + m0 * N, N, t);
    }
  }
  _tile_release();
}

// One group's products for a block of RowBlocks x Cols C tiles (tmm0, 1: row block 0 x tiles 0, 1;
// tmm2, 3: row block 1): A (16 activation rows, from x in place) in tmm4 / tmm5, B (the tiles' B
// tiles, at b and b + b_stride) in tmm6 / tmm7. Each A serves both tiles, each B both row blocks.
template <int RowBlocks, int Cols>
inline void multiply_group_2x2(const uint16_t* x, int64_t K, const uint16_t* b, int64_t b_stride) {
  _tile_loadd(6, b, 64);
  _tile_loadd(4, x, K * 2);
  _tile_dpbf16ps(0, 4, 6);
  if constexpr (Cols > 1) {
    _tile_loadd(7, b + b_stride, 64);
    _tile_dpbf16ps(1, 4, 7);
  }
  if constexpr (RowBlocks > 1) {
    _tile_loadd(5, x + 16 * K, K * 2);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (Cols > 1) _tile_dpbf16ps(3, 5, 7);
  }
}

constexpr int64_t kAmxPanelBytes = 256 << 10;  // dequantized B tiles that many rows pass through in turn
constexpr int64_t kAmxPanelMinRows = 256;      // from these many (padded) rows on

// amx_tiles for many rows: there every tile takes all rows through its B tiles, 64 rows a pass, so
// the rows' A tiles come from L2 or beyond once per tile (a tile load from L2 costs more than the
// ~16 cycles of a product). Here the B tiles of a panel of tiles (kAmxPanelBytes) are dequantized
// once, while the first 32 rows pass through them, and each further 32 rows (their A tiles in L1)
// take the panel 2 tiles at a time: each load serves two products. With fewer rows than
// kAmxPanelMinRows the reloads are few and the panels do not pay.
template <int Bits, bool Fifth, typename S>
void amx_tiles_panels(const uint16_t* x, int64_t M, int64_t Mp, int64_t K, const uint8_t* tiles,
                      const uint8_t* fifth, const S* tile_scales, bool row_scales, uint16_t* y, int64_t N,
                      int64_t tile0, int64_t tile1) {
  const int64_t groups = K / 32, tile_stride = groups * 512;
  const Dequantizer dequantizer;
  const int64_t panel_tiles = std::max<int64_t>(2, kAmxPanelBytes / (groups * 1024)) / 2 * 2;
  thread_local std::vector<uint16_t> panel;
  panel.resize(std::min(panel_tiles, tile1 - tile0) * tile_stride);
  alignas(64) float c[4 * 256];
  load_tile_config();
  for (int64_t p0 = tile0; p0 < tile1; p0 += panel_tiles) {
    const int64_t p1 = std::min(tile1, p0 + panel_tiles);
    const auto dequantize = [&](int64_t t, int64_t g) {
      dequantize_group<Bits, Fifth>(dequantizer, tiles, fifth, tile_scales, row_scales, groups, t, g,
                                    panel.data() + (t - p0) * tile_stride + g * 512);
    };
    for (int64_t m0 = 0; m0 < Mp; m0 += 32) {
      const int row_blocks = Mp - m0 >= 32 ? 2 : 1;
      for (int64_t t = p0; t < p1; t += 2) {
        const int cols = p1 - t >= 2 ? 2 : 1;
        const uint16_t* a = x + m0 * K;
        const uint16_t* b = panel.data() + (t - p0) * tile_stride;
        const auto block = [&](auto row_count, auto col_count) {
          constexpr int kRows = decltype(row_count)::value, kCols = decltype(col_count)::value;
          zero_blocks<4>();  // those of a narrower edge block stay zero
          if (m0 == 0) {  // each group's products one group behind its dequantization, which they overlap
            for (int64_t g = 0; g <= groups; ++g) {
              if (g < groups) {
                dequantize(t, g);
                if constexpr (kCols > 1) dequantize(t + 1, g);
              }
              if (g > 0) multiply_group_2x2<kRows, kCols>(a + g * 32 - 32, K, b + g * 512 - 512, tile_stride);
            }
          } else {
            for (int64_t g = 0; g < groups; ++g)
              multiply_group_2x2<kRows, kCols>(a + g * 32, K, b + g * 512, tile_stride);
          }
          store_blocks<4>(c);
        };
        using One = std::integral_constant<int, 1>;
        using Two = std::integral_constant<int, 2>;
        if (row_blocks == 2) {
          if (cols == 2) block(Two{}, Two{});
          else block(Two{}, One{});
        } else {
          if (cols == 2) block(One{}, Two{});
          else block(One{}, One{});
        }
        for (int r = 0; r < row_blocks; ++r)
          for (int j = 0; j < cols; ++j)
            write_rows(c + (r * 2 + j) * 256, std::min<int64_t>(16, M - m0 - r * 16), y + (m0 + r * 16) * N, N, t + j);
      }
    }
  }
  _tile_release();
}

// y = x W^T for bf16 rows x
template <int Bits, bool Fifth, typename S>
at::Tensor amx_tiles_as(const at::Tensor& x, const at::Tensor& tiles, const uint8_t* fifth,
                        const at::Tensor& tile_scales) {
  const int64_t M = x.size(0), K = x.size(1), N = tile_scales.size(0) * 16, Mp = (M + 15) / 16 * 16;
  at::Tensor y = at::empty({M, N}, x.options());
  at::Tensor xp = x;  // padded with zeros to whole blocks of 16 rows
  if (Mp != M || !x.is_contiguous()) {
    xp = at::zeros({Mp, K}, x.options());
    xp.narrow(0, 0, M).copy_(x);
  }
  const uint16_t* xs = reinterpret_cast<const uint16_t*>(xp.data_ptr<at::BFloat16>());
  const uint8_t* q = tiles.data_ptr<uint8_t>();
  const S* ts = tile_scales.data_ptr<S>();
  // one scale and low per weight row (8-bit tiles' float32 ones); compact and 6-bit ones are per group
  const bool row_scales = !std::is_same_v<S, uint8_t> && tile_scales.size(1) == 1;
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  at::parallel_for(0, N / 16, kTilesPerTask, [&](int64_t t0, int64_t t1) {
    if (Mp >= kAmxPanelMinRows) amx_tiles_panels<Bits, Fifth, S>(xs, M, Mp, K, q, fifth, ts, row_scales, out, N, t0, t1);
    else amx_tiles<Bits, Fifth, S>(xs, M, Mp, K, q, fifth, ts, row_scales, out, N, t0, t1);
  });
  return y;
}
#endif
#endif

}  // namespace

namespace tokenmill {

namespace {

// quant_tiles_linear's products, written into `into` where given (whose shape and dtype
// quant_tiles_linear_into has checked) by the tile kernels, and copied there from the dense copy's
// or AMX's
at::Tensor tiles_products(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales,
                          const std::optional<at::Tensor>& fifth_masks, int64_t bits,
                          const std::optional<at::Tensor>& dense, int64_t max_tile_rows, int64_t x_block,
                          int64_t max_coarse_rows, int64_t amx_min_rows, const std::optional<at::Tensor>& into) {
  const auto written = [&](const at::Tensor& y) { return into.has_value() ? into->copy_(y) : y; };
  if (x.size(0) > max_tile_rows && dense.has_value()) return written(at::linear(x, *dense));
  if (max_coarse_rows >= 0 && x.size(0) > max_coarse_rows) x_block = 8;
#ifdef TILES_BUILT
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "quant_tiles_linear: x must be a 2-D bfloat16 or float32 tensor");
  TORCH_CHECK(bits == 4 || bits == 6 || bits == 8, "quant_tiles_linear: bits must be 4, 6 or 8");
  TORCH_CHECK(x_block == 8 || x_block == 32, "quant_tiles_linear: x_block must be 8 or 32");
  if (bits == 6) {
    const int64_t groups = x.size(1) / 32;
    TORCH_CHECK(tile_scales.scalar_type() == at::kByte && tile_scales.is_contiguous() && tile_scales.dim() == 3 &&
                    tile_scales.size(2) == kQ6BlockBytes && x.size(1) % 256 == 0 &&
                    tile_scales.size(1) * kCompactGroups == groups,
                "quant_tiles_linear: 6-bit tiles take uint8 tile_scales (N / 16, K / 256, 320), x's width K");
    TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                    tiles.numel() == tile_scales.size(0) * groups * tile_group_bytes(6) && !fifth_masks.has_value(),
                "quant_tiles_linear: 6-bit tiles must be contiguous uint8 of the weight's size, without fifth_masks");
    const auto products = [&](auto fine) {
      constexpr bool kFine = decltype(fine)::value;
      return dtype == at::kFloat ? q6_tiles_as<kFine, float>(x, tiles, tile_scales, into)
                                 : q6_tiles_as<kFine, at::BFloat16>(x, tiles, tile_scales, into);
    };
#ifdef AMX_BUILT
    if (dtype == at::kBFloat16 && amx_min_rows >= 0 && x.size(0) >= amx_min_rows && amx_permitted())
      return written(amx_tiles_as<6, false, uint8_t>(x, tiles, nullptr, tile_scales));
#endif
    return x_block == 8 ? products(std::true_type{}) : products(std::false_type{});
  }
  const bool half_scales = tile_scales.scalar_type() == at::kHalf;
  const bool compact_scales = tile_scales.scalar_type() == at::kByte;
  TORCH_CHECK(tile_scales.is_contiguous() &&
                  (compact_scales ? tile_scales.dim() == 3 && tile_scales.size(2) == kCompactBlockBytes
                                  : tile_scales.dim() == 4 && tile_scales.size(2) == 2 && tile_scales.size(3) == 16 &&
                                        (tile_scales.scalar_type() == at::kFloat ||
                                         (half_scales && tile_scales.size(1) > 1))),
              "quant_tiles_linear: tile_scales must be contiguous float32 (N / 16, K / 32 or 1, 2, 16), float16 "
              "(N / 16, K / 32, 2, 16) or compact uint8 (N / 16, K / 256, 384)");
  const int64_t tiles_count = tile_scales.size(0), groups = x.size(1) / 32;
  const int64_t scale_groups = tile_scales.size(1) * (compact_scales ? kCompactGroups : 1);
  TORCH_CHECK(x.size(1) % 32 == 0 && (scale_groups == groups || (!compact_scales && scale_groups == 1)),
              "quant_tiles_linear: x's width must be the weight's");
  TORCH_CHECK(tiles.scalar_type() == at::kByte && tiles.is_contiguous() &&
                  tiles.numel() == tiles_count * groups * tile_group_bytes(static_cast<int>(bits)),
              "quant_tiles_linear: tiles must be contiguous uint8 of the weight's size");
  const uint8_t* fifth = nullptr;
  if (fifth_masks.has_value()) {
    TORCH_CHECK(bits == 4 && fifth_masks->scalar_type() == at::kByte && fifth_masks->is_contiguous() &&
                    fifth_masks->numel() == tiles_count * groups * kTileFifthGroupBytes,
                "quant_tiles_linear: fifth_masks must be contiguous uint8 (N / 16, K / 32, 64), with 4-bit tiles");
    fifth = fifth_masks->data_ptr<uint8_t>();
  }
  // run(kind, scale) with kind 4, 5 (4-bit q with fifth bits) or 8 as an integral_constant and scale
  // a value of the tile scales' type (uint8_t: compact): the template arguments of either kernel
  const auto with_weights = [&](const auto& run) {
    const auto with_kind = [&](auto kind) {
      if (compact_scales) return run(kind, uint8_t{});
      return half_scales ? run(kind, c10::Half{}) : run(kind, float{});
    };
    if (bits == 8) return with_kind(std::integral_constant<int, 8>{});
    if (fifth != nullptr) return with_kind(std::integral_constant<int, 5>{});
    return with_kind(std::integral_constant<int, 4>{});
  };
#ifdef AMX_BUILT
  if (dtype == at::kBFloat16 && amx_min_rows >= 0 && x.size(0) >= amx_min_rows && amx_permitted()) {
    return with_weights([&](auto kind, auto scale) {
      constexpr int kKind = decltype(kind)::value;
      return written(amx_tiles_as<kKind == 8 ? 8 : 4, kKind == 5, decltype(scale)>(x, tiles, fifth, tile_scales));
    });
  }
#endif
  const auto products = [&](auto fine) {
    return with_weights([&](auto kind, auto scale) {
      constexpr int kKind = decltype(kind)::value, kBits = kKind == 8 ? 8 : 4;
      constexpr bool kFifth = kKind == 5, kFine = decltype(fine)::value;
      using S = decltype(scale);
      return dtype == at::kFloat
                 ? quant_tiles_as<kBits, kFifth, kFine, float, S>(x, tiles, fifth, tile_scales, into)
                 : quant_tiles_as<kBits, kFifth, kFine, at::BFloat16, S>(x, tiles, fifth, tile_scales, into);
    });
  };
  return x_block == 8 ? products(std::true_type{}) : products(std::false_type{});
#else
  TORCH_CHECK(false, "quant_tiles_linear needs AVX-512 with VNNI");
  return x;
#endif
}

}  // namespace

// y = x W^T for W in tiles (above): bits 4 (with fifth_masks: 5), 6 (Q6_K's, q6_tiles) or 8; beyond
// max_tile_rows rows, with the layer's dense copy where it has one. bf16 x of amx_min_rows rows or
// more (never if negative) goes to AMX where this build and the process have
// it; else x activations share an int8 scale per x_block (8 or 32), except that x_block 32 serves
// only up to max_coarse_rows rows (all if negative) and 8 beyond them. Every row is rounded and
// summed alike whatever the row count, so a row's result depends on its batch only through these
// two thresholds.
at::Tensor quant_tiles_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales,
                              const std::optional<at::Tensor>& fifth_masks, int64_t bits,
                              const std::optional<at::Tensor>& dense, int64_t max_tile_rows, int64_t x_block,
                              int64_t max_coarse_rows, int64_t amx_min_rows) {
  return tiles_products(x, tiles, tile_scales, fifth_masks, bits, dense, max_tile_rows, x_block, max_coarse_rows,
                        amx_min_rows, std::nullopt);
}

// quant_tiles_linear's products written into `into`, a contiguous (rows of x, N) tensor of x's
// dtype that a caller reuses from call to call: a large output (an output head's for a batch) as a
// new tensor would be mapped and faulted in afresh on every call once above glibc's heap limit
at::Tensor quant_tiles_linear_into(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales,
                                   const std::optional<at::Tensor>& fifth_masks, int64_t bits,
                                   const std::optional<at::Tensor>& dense, int64_t max_tile_rows, int64_t x_block,
                                   int64_t max_coarse_rows, int64_t amx_min_rows, at::Tensor into) {
  TORCH_CHECK(into.is_contiguous() && into.scalar_type() == x.scalar_type() && into.dim() == 2 &&
                  into.size(0) == x.size(0) && into.size(1) == tile_scales.size(0) * 16,
              "quant_tiles_linear_into: into must be a contiguous tensor of x's dtype, (rows of x, the weight's "
              "rows)");
  return tiles_products(x, tiles, tile_scales, fifth_masks, bits, dense, max_tile_rows, x_block, max_coarse_rows,
                        amx_min_rows, into);
}

// Whether this build has the tile kernel (AVX-512 with byte instructions and VNNI)
bool tiles_built() {
#ifdef TILES_BUILT
  return true;
#else
  return false;
#endif
}

// Whether the tile kernel can hand bf16 rows to AMX here (built for it, and Linux lets this process)
bool amx_usable() {
#ifdef AMX_BUILT
  return amx_permitted();
#else
  return false;
#endif
}

}  // namespace tokenmill
