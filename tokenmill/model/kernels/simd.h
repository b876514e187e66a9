// The few fp32 vector operations the kernels are written in, on AVX-512 where the CPU has it, else
// on AVX2 with FMA: one kernel source for both kinds of x86 machine this project runs on. Also the
// elementwise kernels' split of rows over threads.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace simd {

// Rows per task of the elementwise kernels (norm, rotary, gated activation): ~16k elements each, so
// that a decode step's few rows stay on the calling thread and a prompt's spread over all of them
inline int64_t rows_per_task(int64_t row_elements) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elements, 1));
}

// f(std::integral_constant<int, n>{}) for 0 < n <= N: a count known only at run time (the rows of
// a block, the heads of a pass) as a kernel template's constant
template <int N, typename F>
inline void with_constant(int64_t n, const F& f) {
  if constexpr (N > 1) {
    if (n != N) return with_constant<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// 32 bytes of a group of 32 values in element order as the int6 row layout's two halves (lower and
// upper 128 bits), for the weights (layout.cpp) and the activations (gemv.cpp) alike: the
// activation sub-block j's (elements 4j..4j+3 and 16+4j..16+4j+3) elements 4j, 4j + 1, 16 + 4j,
// 16 + 4j + 1 in bytes 4j..4j+3 of the first half, and 4j + 2, 4j + 3, 16 + 4j + 2, 16 + 4j + 3 in
// those of the second (see gemv.cpp's int6_rows).
inline __m256i int6_halves(__m256i bytes) {
  // lane 0: elements 0-7 and 16-23; lane 1: 8-15 and 24-31
  const __m256i lanes = _mm256_permute4x64_epi64(bytes, _MM_SHUFFLE(3, 1, 2, 0));
  const __m256i order = _mm256_setr_epi8(0, 1, 8, 9, 4, 5, 12, 13, 2, 3, 10, 11, 6, 7, 14, 15,  //
                                         0, 1, 8, 9, 4, 5, 12, 13, 2, 3, 10, 11, 6, 7, 14, 15);
  return _mm256_permute4x64_epi64(_mm256_shuffle_epi8(lanes, order), _MM_SHUFFLE(3, 1, 2, 0));
}

// The sum of 4 floats, (0 + 2) + (1 + 3)
inline float sum4(__m128 s) {
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// The sum of 8 floats: AVX2's vector, and the integer GEMVs' on either kind of machine (gemv.cpp)
inline float sum8(__m256 a) { return sum4(_mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1))); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define SIMD_AVX512 1  // for kernels with 512-bit integer code of their own (gemv.cpp)

constexpr int kWidth = 16;
using Vec = __m512;

inline Vec zero() { return _mm512_setzero_ps(); }
inline Vec set1(float v) { return _mm512_set1_ps(v); }
inline Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm512_div_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm512_min_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }   // a * b + c
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm512_fnmadd_ps(a, b, c); } // c - a * b
inline Vec round(Vec a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec times_pow2(Vec a, Vec n) { return _mm512_scalef_ps(a, n); }  // a * 2^n, n integral
inline float sum(Vec a) { return _mm512_reduce_add_ps(a); }
inline float max_of(Vec a) { return _mm512_reduce_max_ps(a); }
inline uint32_t equal_lanes(Vec a, Vec b) { return _mm512_cmp_ps_mask(a, b, _CMP_EQ_OQ); }  // bit i: lane i
inline Vec keep_greater(Vec v, Vec x, Vec floor) {  // v where x > floor, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, floor, _CMP_GT_OQ), v);
}
// lane i = sum(v[i]), for kWidth vectors: a tree of in-lane unpacks and cross-lane shuffles (~45
// instructions, against ~130 for 16 separate reductions)
inline Vec transposed_sums(const Vec* v) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: v[2i] at 0, 2 and v[2i+1] at 1, 3
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: v[4i + j] at j
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // the four 128-bit lanes of each quad summed: pairs of lanes, then pairs of those
  const __m512 h01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88), _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 h23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88), _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(h01, h23, 0x88), _mm512_shuffle_f32x4(h01, h23, 0xDD));
}

inline Vec load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline Vec load(const c10::BFloat16* p) {
  const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}
// kWidth bytes of packed 4-bit values, as floats: the low nibbles and the high nibbles
inline void load_nibbles(const uint8_t* p, Vec& low, Vec& high) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  low = _mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0xF)));
  high = _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4));
}
inline Vec load(const c10::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, Vec v) {  // rounded to nearest even, NaN kept NaN
  __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF))), 16);
  bits = _mm512_mask_mov_epi32(bits, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bits));
}

#elif defined(__AVX2__) && defined(__FMA__)

constexpr int kWidth = 8;
using Vec = __m256;

inline Vec zero() { return _mm256_setzero_ps(); }
inline Vec set1(float v) { return _mm256_set1_ps(v); }
inline Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
inline Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec div(Vec a, Vec b) { return _mm256_div_ps(a, b); }
inline Vec min(Vec a, Vec b) { return _mm256_min_ps(a, b); }
inline Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
inline Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec fnmadd(Vec a, Vec b, Vec c) { return _mm256_fnmadd_ps(a, b, c); }
inline Vec round(Vec a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline Vec times_pow2(Vec a, Vec n) {  // n within the normal exponents, as exp() keeps it
  const __m256i exponent = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_mul_ps(a, _mm256_castsi256_ps(_mm256_slli_epi32(exponent, 23)));
}
inline float sum(Vec a) { return sum8(a); }
inline float max_of(Vec a) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}
inline uint32_t equal_lanes(Vec a, Vec b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_EQ_OQ)); }  // bit i: lane i
inline Vec keep_greater(Vec v, Vec x, Vec floor) {  // v where x > floor, else 0
  return _mm256_and_ps(v, _mm256_cmp_ps(x, floor, _CMP_GT_OQ));
}
// lane i = sum(v[i]), for kWidth vectors: pairwise horizontal adds, then the two 128-bit halves
inline Vec transposed_sums(const Vec* v) {
  const Vec s0123 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const Vec s4567 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // s0123 = (0 1 2 3 | 0 1 2 3) partial sums from the low and high halves, likewise s4567
  return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

inline Vec load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline Vec load(const c10::BFloat16* p) {
  const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}
inline void load_nibbles(const uint8_t* p, Vec& low, Vec& high) {
  const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(0xF)));
  high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
}
inline Vec load(const c10::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline void store(c10::BFloat16* p, Vec v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  bits = _mm256_blendv_epi8(bits, _mm256_set1_epi32(0x7FC0), nan);
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

#else
#error "tokenmill's CPU kernels need AVX2 with FMA, or AVX-512"
#endif

inline float to_float(c10::Half h) { return _cvtsh_ss(h.x); }  // F16C, which every AVX2 CPU has

// exp(x) for x in about [-87, 88]: 2^n * p(r), r = x - n ln2, |r| <= ln2/2 (rel. error ~2e-7).
inline Vec exp(Vec x) {
  x = max(min(x, set1(88.0f)), set1(-87.0f));
  const Vec n = round(mul(x, set1(1.44269504088896341f)));
  const Vec r = fnmadd(n, set1(0.693147180559945309f), x);
  Vec p = set1(1.0f / 720);
  p = fmadd(p, r, set1(1.0f / 120));
  p = fmadd(p, r, set1(1.0f / 24));
  p = fmadd(p, r, set1(1.0f / 6));
  p = fmadd(p, r, set1(0.5f));
  p = fmadd(p, r, set1(1.0f));
  p = fmadd(p, r, set1(1.0f));
  return times_pow2(p, n);
}

}  // namespace simd
