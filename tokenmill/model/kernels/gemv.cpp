// Weight-only quantized matrix products whose means depend on the number of activation rows, on CPU.
//
// A decode step reads every weight once per token, so it runs at the speed the weight bytes stream
// from memory. PyTorch's `_weight_int8pack_mm` streams them at ~10 GB/s on a 2-core AVX-512 machine
// whose memory gives ~30; this kernel reaches ~25: each output row is one pass over its int8 row,
// widened to fp32 and multiplied with the activations (bf16 or fp32, widened to fp32) by FMAs
// (simd.h). Rows are split across PyTorch's intra-op threads, and up to 4 activation rows share each
// widened weight vector. The int4 kernel below works the same way on 4-bit groups. Wider batches
// are bound by arithmetic rather than bytes: for them the blocked product dequantizes a few weight
// rows at a time and multiplies them with every activation row, as a dense matmul would.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace {

constexpr int64_t kRowsPerTask = 16;
constexpr int kMaxActivationRows = 4;

// Runs kernel(rows, m0, r0, r1) over blocks of up to kMaxActivationRows activation rows (m0: the
// block's first; rows: its size, as a std::integral_constant for the kernel's template), each block
// over the weight rows [r0, r1) of PyTorch's intra-op threads.
template <typename Kernel>
void over_row_blocks(int64_t M, int64_t N, const Kernel& kernel) {
  for (int64_t m0 = 0; m0 < M; m0 += kMaxActivationRows) {
    const int64_t rows = std::min<int64_t>(kMaxActivationRows, M - m0);
    at::parallel_for(0, N, kRowsPerTask, [&](int64_t r0, int64_t r1) {
      switch (rows) {
        case 1: kernel(std::integral_constant<int, 1>{}, m0, r0, r1); break;
        case 2: kernel(std::integral_constant<int, 2>{}, m0, r0, r1); break;
        case 3: kernel(std::integral_constant<int, 3>{}, m0, r0, r1); break;
        default: kernel(std::integral_constant<int, 4>{}, m0, r0, r1); break;
      }
    });
  }
}

// Each activation row sums into C independent accumulators: with one row, two chains of FMAs
// (4 cycles each) bounded the kernel at ~4 bytes per cycle and core, half what it can stream.
template <int M, typename T>
void int8_rows(const float* x, int64_t K, const int8_t* weight, const T* scale, T* y,
               int64_t N, int64_t row0, int64_t row1) {
  using namespace simd;
  constexpr int C = M == 1 ? 4 : 2;
  for (int64_t o = row0; o < row1; ++o) {
    const int8_t* row = weight + o * K;
    Vec acc[M][C];
    for (int i = 0; i < M; ++i)
      for (int c = 0; c < C; ++c) acc[i][c] = zero();
    int64_t k = 0;
    for (; k + C * kWidth <= K; k += C * kWidth) {
      Vec w[C];
      for (int c = 0; c < C; ++c) w[c] = load(row + k + c * kWidth);
      for (int i = 0; i < M; ++i)
        for (int c = 0; c < C; ++c) acc[i][c] = fmadd(w[c], load(x + i * K + k + c * kWidth), acc[i][c]);
    }
    for (; k < K; k += kWidth) {  // K is a multiple of 32: whole vectors are left
      const Vec w = load(row + k);
      for (int i = 0; i < M; ++i) acc[i][0] = fmadd(w, load(x + i * K + k), acc[i][0]);
    }
    const float s = static_cast<float>(scale[o]);
    for (int i = 0; i < M; ++i) {
      Vec total = acc[i][0];
      for (int c = 1; c < C; ++c) total = add(total, acc[i][c]);
      y[i * N + o] = T(sum(total) * s);
    }
  }
}

// The contiguous rows xc as float32: themselves, or (bf16) widened once into `buffer`; a tensor op
// would cost more than it saves on these few rows.
template <typename T>
const float* float_rows(const at::Tensor& xc, std::vector<float>& buffer) {
  const T* xs = xc.data_ptr<T>();
  if constexpr (std::is_same_v<T, float>) {
    return xs;
  } else {
    buffer.resize(xc.numel());
    for (int64_t i = 0; i < xc.numel(); ++i) buffer[i] = static_cast<float>(xs[i]);
    return buffer.data();
  }
}

// y = x W^T * scale, for x (M, K), W (N, K) int8 and scale (N) (one per row); x, scale and y are
// all T, bfloat16 or float32.
template <typename T>
at::Tensor int8_gemv_as(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
  std::vector<float> widened;
  const float* xf = float_rows<T>(xc, widened);
  const int8_t* w = weight.data_ptr<int8_t>();
  const T* s = scale.data_ptr<T>();
  over_row_blocks(M, N, [&](auto rows, int64_t m0, int64_t r0, int64_t r1) {
    int8_rows<decltype(rows)::value>(xf + m0 * K, K, w, s, y.data_ptr<T>() + m0 * N, N, r0, r1);
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

// Products with more activation rows than the GEMV serves, without a dense copy of the weight: each
// block of kBlockRows weight rows is dequantized to fp32 once, into a buffer that stays in L1, and
// multiplied with every activation row by a register-blocked tile of kTileRows x kBlockRows dot
// products (12 accumulators, the weights loaded once per step for three rows). The int8 bytes are
// read from memory once per call, where a chunked matmul converts them to fp32 in memory first.
constexpr int kBlockRows = 4;
constexpr int kTileRows = 3;

template <int MR>
inline void dot_tile(const float* x, int64_t K, const float* w, float* out) {
  using namespace simd;
  Vec acc[MR][kBlockRows];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kBlockRows; ++j) acc[i][j] = zero();
  for (int64_t k = 0; k < K; k += kWidth) {
    Vec wv[kBlockRows];
    for (int j = 0; j < kBlockRows; ++j) wv[j] = load(w + j * K + k);
    for (int i = 0; i < MR; ++i) {
      const Vec xv = load(x + i * K + k);
      for (int j = 0; j < kBlockRows; ++j) acc[i][j] = fmadd(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kBlockRows; ++j) out[i * kBlockRows + j] = sum(acc[i][j]);
}

// y (M, N) = x (M, K) W^T for x bfloat16 or float32 (y the same), where dequantize(o, w) writes
// weight row o as K floats at w.
template <typename T, typename Dequantize>
at::Tensor blocked_product(const at::Tensor& x, int64_t N, const Dequantize& dequantize) {
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
  std::vector<float> widened;
  const float* xf = float_rows<T>(xc, widened);
  T* out_rows = y.data_ptr<T>();
  const int64_t blocks = (N + kBlockRows - 1) / kBlockRows;
  at::parallel_for(0, blocks, 4, [&](int64_t b0, int64_t b1) {
    std::vector<float> w(kBlockRows * K);
    float out[kTileRows * kBlockRows];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t o0 = b * kBlockRows, rows = std::min<int64_t>(kBlockRows, N - o0);
      for (int64_t j = 0; j < kBlockRows; ++j) {
        if (j < rows) dequantize(o0 + j, w.data() + j * K);
        else std::fill_n(w.data() + j * K, K, 0.0f);
      }
      for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
        const int64_t mr = std::min<int64_t>(kTileRows, M - m0);
        if (mr == 3) dot_tile<3>(xf + m0 * K, K, w.data(), out);
        else if (mr == 2) dot_tile<2>(xf + m0 * K, K, w.data(), out);
        else dot_tile<1>(xf + m0 * K, K, w.data(), out);
        for (int64_t i = 0; i < mr; ++i)
          for (int64_t j = 0; j < rows; ++j) out_rows[(m0 + i) * N + o0 + j] = T(out[i * kBlockRows + j]);
      }
    }
  });
  return y;
}

template <typename T>
at::Tensor int8_blocked_as(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale) {
  const int64_t K = weight.size(1);
  const int8_t* wq = weight.data_ptr<int8_t>();
  const T* s = scale.data_ptr<T>();
  return blocked_product<T>(x, weight.size(0), [&](int64_t o, float* w) {
    using namespace simd;
    const Vec so = set1(static_cast<float>(s[o]));
    for (int64_t k = 0; k < K; k += kWidth) store(w + k, mul(load(wq + o * K + k), so));
  });
}

template <typename T>
at::Tensor int4_blocked_as(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scale_low) {
  const int64_t groups = x.size(1) / 32;
  const uint8_t* q = nibbles.data_ptr<uint8_t>();
  const at::Half* sl = scale_low.data_ptr<at::Half>();
  return blocked_product<T>(x, nibbles.size(0), [&](int64_t o, float* w) {
    using namespace simd;
    const uint8_t* row = q + o * groups * 16;
    const at::Half* row_sl = sl + o * groups * 2;
    for (int64_t g = 0; g < groups; ++g) {
      const Vec scale = set1(to_float(row_sl[2 * g])), low = set1(to_float(row_sl[2 * g + 1]));
      for (int b = 0; b < 16; b += kWidth) {
        Vec q_low, q_high;
        load_nibbles(row + g * 16 + b, q_low, q_high);
        store(w + g * 32 + b, fmadd(q_low, scale, low));
        store(w + g * 32 + 16 + b, fmadd(q_high, scale, low));
      }
    }
  });
}

// The same product for any number of rows, by the fastest means at hand for that number: the GEMV
// above for a few rows (bound by weight bytes), the blocked product up to max_blocked_rows, else a
// dense matmul (bound by arithmetic) with the layer's dense copy, or with chunks of chunk_rows int8
// rows dequantized one at a time (a large output head keeps no dense copy). Deciding here, at run
// time, lets one compiled graph serve every batch size without a guard on it.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const c10::optional<at::Tensor>& dense, int64_t max_gemv_rows, int64_t max_blocked_rows,
                       int64_t chunk_rows) {
  if (x.size(0) <= max_gemv_rows) return int8_gemv(x, weight, scale);
  if (x.size(0) <= max_blocked_rows) {
    int8_gemv_checks(x, weight, scale);
    return x.scalar_type() == at::kFloat ? int8_blocked_as<float>(x, weight, scale)
                                         : int8_blocked_as<at::BFloat16>(x, weight, scale);
  }
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

// y = x W^T for W (N, K) in 4-bit groups of 32 along K, w = scale * q + low with q in 0..15: row o's
// group g is the 16 bytes nibbles[o][16 g:], byte j holding q of element 32 g + j in its low nibble
// and of element 32 g + 16 + j in its high one; (scale, low) are scale_low[o][g]. The sums of q x
// are taken per group (scaled once), and the low terms come from the group sums of x: two FMAs per
// weight pair.
template <int M, typename T>
void int4_rows(const float* x, const float* group_sums, int64_t K, const uint8_t* nibbles, const at::Half* scale_low,
               T* y, int64_t N, int64_t row0, int64_t row1) {
  using namespace simd;
  const int64_t groups = K / 32;
  for (int64_t o = row0; o < row1; ++o) {
    const uint8_t* row = nibbles + o * groups * 16;
    const at::Half* sl = scale_low + o * groups * 2;
    Vec acc[M];
    float offset[M];
    for (int i = 0; i < M; ++i) acc[i] = zero(), offset[i] = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      Vec dot[M][2];
      for (int i = 0; i < M; ++i) dot[i][0] = dot[i][1] = zero();
      for (int b = 0; b < 16; b += kWidth) {
        Vec q_low, q_high;  // elements b.. and 16 + b.. of the group
        load_nibbles(row + g * 16 + b, q_low, q_high);
        for (int i = 0; i < M; ++i) {
          const float* xg = x + i * K + g * 32 + b;
          dot[i][0] = fmadd(q_low, load(xg), dot[i][0]);
          dot[i][1] = fmadd(q_high, load(xg + 16), dot[i][1]);
        }
      }
      const Vec scale = set1(to_float(sl[2 * g]));
      const float low = to_float(sl[2 * g + 1]);
      for (int i = 0; i < M; ++i) {
        acc[i] = fmadd(add(dot[i][0], dot[i][1]), scale, acc[i]);
        offset[i] += low * group_sums[i * groups + g];
      }
    }
    for (int i = 0; i < M; ++i) y[i * N + o] = T(sum(acc[i]) + offset[i]);
  }
}

template <typename T>
at::Tensor int4_gemv_as(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scale_low) {
  const int64_t M = x.size(0), N = nibbles.size(0), K = x.size(1), groups = K / 32;
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor xc = x.contiguous();
  std::vector<float> widened;
  const float* xs = float_rows<T>(xc, widened);
  std::vector<float> sums(M * groups);
  for (int64_t i = 0; i < M * groups; ++i) {
    float s = 0.0f;
    for (int j = 0; j < 32; ++j) s += xs[i * 32 + j];
    sums[i] = s;
  }
  const uint8_t* w = nibbles.data_ptr<uint8_t>();
  const at::Half* sl = scale_low.data_ptr<at::Half>();
  over_row_blocks(M, N, [&](auto rows, int64_t m0, int64_t r0, int64_t r1) {
    int4_rows<decltype(rows)::value>(xs + m0 * K, sums.data() + m0 * groups, K, w, sl, y.data_ptr<T>() + m0 * N, N,
                                     r0, r1);
  });
  return y;
}

// The int4 product for any number of rows: the GEMV up to max_gemv_rows (bound by weight bytes),
// the blocked product up to max_blocked_rows or for a layer without a dense copy, the dense copy
// beyond (bound by arithmetic).
at::Tensor int4_rows_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& scale_low,
                            const c10::optional<at::Tensor>& dense, int64_t max_gemv_rows, int64_t max_blocked_rows) {
  const int64_t M = x.size(0);
  if (M > max_gemv_rows && M > max_blocked_rows && dense.has_value()) return at::linear(x, *dense);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "int4_rows_linear: x must be a 2-D bfloat16 or float32 tensor");
  const int64_t N = nibbles.size(0), K = x.size(1);
  TORCH_CHECK(K % 32 == 0 && nibbles.dim() == 2 && nibbles.size(1) * 2 == K &&
                  nibbles.scalar_type() == at::kByte && nibbles.is_contiguous(),
              "int4_rows_linear: nibbles must be contiguous uint8 (N, K / 2), K a multiple of 32");
  TORCH_CHECK(scale_low.scalar_type() == at::kHalf && scale_low.is_contiguous() && scale_low.numel() == N * K / 16,
              "int4_rows_linear: scale_low must be contiguous float16 (N, K / 32, 2)");
  if (M <= max_gemv_rows)
    return dtype == at::kFloat ? int4_gemv_as<float>(x, nibbles, scale_low)
                               : int4_gemv_as<at::BFloat16>(x, nibbles, scale_low);
  return dtype == at::kFloat ? int4_blocked_as<float>(x, nibbles, scale_low)
                             : int4_blocked_as<at::BFloat16>(x, nibbles, scale_low);
}

// The int4 counterpart (PyTorch's packed kernel below the crossover, the dense copy above it):
// written here only so that the choice is made at run time, inside one compiled graph. The packed
// kernel runs in the dtype of the scales: fp32 activations are rounded to bf16 for it (see
// QuantLinear).
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                       int64_t group_size, const c10::optional<at::Tensor>& dense, int64_t max_packed_rows) {
  if (x.size(0) > max_packed_rows && dense.has_value()) return at::linear(x, *dense);
  return at::_weight_int4pack_mm_for_cpu(x.to(scales_zeros.scalar_type()), packed, group_size, scales_zeros)
      .to(x.scalar_type());  // both no-ops where the dtypes agree
}

}  // namespace

TORCH_LIBRARY(tokenmill, m) {
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_zeros, int group_size, Tensor? dense, "
        "int max_packed_rows) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? dense, int max_gemv_rows, int max_blocked_rows, "
        "int chunk_rows) -> Tensor");
  m.def("int4_rows_linear(Tensor x, Tensor nibbles, Tensor scale_low, Tensor? dense, int max_gemv_rows, "
        "int max_blocked_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("int8_linear", &int8_linear);
  m.impl("int4_linear", &int4_linear);
  m.impl("int4_rows_linear", &int4_rows_linear);
}
