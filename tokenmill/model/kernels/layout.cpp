// Loading: GGUF blocks to the kernels' forms, in one pass each where PyTorch takes many (several
// times as long; see the tuning log). Every function computes what the Python path it stands in for
// computes (quant_linear.py's `exact_groups`, `quantize_int8` of quant.py's dequantized rows,
// `pack_tiles`' tile bytes, `compact_tile_scales`) with the same float32 operations in the same
// order, so a model (finite weights) loads to the same bits with or without these kernels.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

constexpr int64_t kSuperBlock = 256;  // the K-quants' elements per block
constexpr int64_t kQ4KBytes = 144, kQ6KBytes = 210;
constexpr int64_t kGroup = 32, kWeightTileRows = 16;

float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// Sub-block j's (0-7) scale and low in the Q4_K block at b, w = scale * q + low: the block's d and
// dmin times the sub-block's 6-bit scale and min from the 12 scale bytes (ggml's get_scale_min_k4).
void q4_k_scale_low(const uint8_t* b, int j, float& scale, float& low) {
  const uint8_t* s = b + 4;
  int sc, mn;
  if (j < 4) {
    sc = s[j] & 63;
    mn = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
    mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
  scale = half_at(b) * static_cast<float>(sc);
  low = -(half_at(b + 2) * static_cast<float>(mn));
}

// Q6_K: values 32k..32k+31 of one half (128 values) of a block, as quant.py's `_q6_k`
// (q - 32) * (d * scale): value 32k + l takes its low 4 bits from byte l (k even) or l + 32 (k odd)
// of the half's 64 (the low nibble for k < 2, the high one after) and its high 2 bits from bits
// 2k, 2k + 1 of byte l of the half's 32; a scale covers 16 values. K is a template argument so
// that the shifts are constants and the loop vectorizes.
template <int K>
void q6_k_quarter(const uint8_t* __restrict ql, const uint8_t* __restrict qh, const int8_t* __restrict scales, float d,
                  float* __restrict out) {
  const uint8_t* __restrict low = ql + 32 * (K & 1);
  for (int half = 0; half < 2; ++half) {
    const float step = d * static_cast<float>(scales[2 * K + half]);
    for (int l = 16 * half; l < 16 * half + 16; ++l) {
      const int q = ((low[l] >> (4 * (K >> 1))) & 0x0F) | (((qh[l] >> (2 * K)) & 3) << 4);
      out[32 * K + l] = static_cast<float>(q - 32) * step;
    }
  }
}

// Q6_K: the 256 values of one block as float32.
void q6_k_values(const uint8_t* b, float* w) {
  const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half_at(b + 208);
  for (int g = 0; g < 2; ++g) {
    const uint8_t *ql = b + 64 * g, *qh = b + 128 + 32 * g;
    q6_k_quarter<0>(ql, qh, scales + 8 * g, d, w + 128 * g);
    q6_k_quarter<1>(ql, qh, scales + 8 * g, d, w + 128 * g);
    q6_k_quarter<2>(ql, qh, scales + 8 * g, d, w + 128 * g);
    q6_k_quarter<3>(ql, qh, scales + 8 * g, d, w + 128 * g);
  }
}

// Where each row of weights of `type` in blocks of block_size values (each (rows_i, cols /
// block_size * block_bytes) uint8) starts, the weights' rows stacked; `name` (the caller's) heads
// the errors
std::vector<const uint8_t*> stacked_rows(const std::vector<at::Tensor>& weights, int64_t cols, int64_t block_size,
                                         int64_t block_bytes, const char* name, const char* type) {
  TORCH_CHECK(!weights.empty() && cols % block_size == 0, name, ": give ", type, " weights of a multiple of ",
              block_size, " columns");
  const int64_t row_bytes = cols / block_size * block_bytes;
  std::vector<const uint8_t*> rows;
  for (const at::Tensor& w : weights) {
    TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() % row_bytes == 0, name,
                ": weights must be contiguous uint8 rows of ", row_bytes, " bytes (", type, ")");
    for (int64_t r = 0; r < w.numel() / row_bytes; ++r) rows.push_back(w.data_ptr<uint8_t>() + r * row_bytes);
  }
  return rows;
}

// The row layouts' unit of a row whose largest scale magnitude is peak: peak / 32767
// (quant_linear.py's MAX_STEP), 1 for a row of zero scales; and a scale's step, the scale in units
// rounded half to even
float row_unit(float peak) {
  const float unit = peak / 32767.0f;
  return unit > 0.0f ? unit : 1.0f;
}
int16_t step_of(float scale, float unit) {
  return static_cast<int16_t>(std::clamp(std::nearbyint(scale / unit), -32767.0f, 32767.0f));
}

// The int4 row layout's outputs for rows x cols weights (`pack_int4_rows`): nibbles (rows, cols / 2)
// uint8, steps_lows (rows, cols / 32, 2) int16 and units (rows) float32
struct Int4RowsOut {
  at::Tensor nibbles, steps_lows, units;
  uint8_t* nibbles_out;
  int16_t* steps_lows_out;
  float* units_out;

  Int4RowsOut(int64_t rows, int64_t cols, const at::TensorOptions& bytes)
      : nibbles(at::empty({rows, cols / 2}, bytes)),
        steps_lows(at::empty({rows, cols / kGroup, 2}, bytes.dtype(at::kShort))),
        units(at::empty({rows}, bytes.dtype(at::kFloat))),
        nibbles_out(nibbles.data_ptr<uint8_t>()),
        steps_lows_out(steps_lows.data_ptr<int16_t>()),
        units_out(units.data_ptr<float>()) {}

  // Row r's unit (its largest scale magnitude / 32767: quant_linear.py's MAX_STEP; 1 for a row of
  // zero scales), each group's step (its scale in units, rounded half to even) and its low's
  // float16 bits
  void set_scales(int64_t r, const float* scale, const float* low, int64_t groups) const {
    float peak = 0.0f;
    for (int64_t g = 0; g < groups; ++g) peak = std::max(peak, std::fabs(scale[g]));
    const float unit = units_out[r] = row_unit(peak);
    int16_t* sl = steps_lows_out + r * groups * 2;
    for (int64_t g = 0; g < groups; ++g) {
      sl[2 * g] = step_of(scale[g], unit);
      sl[2 * g + 1] = static_cast<int16_t>(c10::Half(low[g]).x);
    }
  }

  std::tuple<at::Tensor, at::Tensor, at::Tensor> tensors() const { return {nibbles, steps_lows, units}; }
};

// A float32 row w (cols, a multiple of simd::kWidth) quantized to int8 with one scale, as
// quant_linear.py's `quantize_int8`: scale = max(amax / 127, 1e-12), q = clamp(round-half-even(w /
// scale), -127, 127) into q_out; w is overwritten; returns the scale
float int8_row(float* w, int64_t cols, int8_t* __restrict q_out) {
  using namespace simd;
  Vec peaks = zero();
  for (int64_t i = 0; i < cols; i += kWidth) {
    const Vec v = load(w + i);
    peaks = max(peaks, max(v, sub(zero(), v)));
  }
  const float s = std::max(max_of(peaks) / 127.0f, static_cast<float>(1e-12));
  const Vec step = set1(s), lowest = set1(-127.0f), highest = set1(127.0f);
  for (int64_t i = 0; i < cols; i += kWidth) store(w + i, min(max(round(div(load(w + i), step)), lowest), highest));
  const float* __restrict rounded = w;
  for (int64_t i = 0; i < cols; ++i) q_out[i] = static_cast<int8_t>(static_cast<int>(rounded[i]));
  return s;
}

// rows x cols weights as int8 rows with one scale each (`int8_row`): q (rows, cols) int8 and scale
// (rows) float32; values(r, w) writes row r's float32 values into w
template <typename Values>
std::tuple<at::Tensor, at::Tensor> int8_rows_of(int64_t rows, int64_t cols, const at::TensorOptions& bytes,
                                                const Values& values) {
  at::Tensor q = at::empty({rows, cols}, bytes.dtype(at::kChar));
  at::Tensor scale = at::empty({rows}, bytes.dtype(at::kFloat));
  int8_t* q_out = q.data_ptr<int8_t>();
  float* scale_out = scale.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t end) {
    std::vector<float> w(cols);
    for (int64_t r = first; r < end; ++r) {
      values(r, w.data());
      scale_out[r] = int8_row(w.data(), cols, q_out + r * cols);
    }
  });
  return {q, scale};
}

// Group jj's (0-7) 16 bytes of the Q4_K block at b, byte i holding the group's element i in its
// low nibble and 16 + i in its high one (the int4 row layout's bytes; a tile's sub-block j takes
// bytes 4j..4j+3). Sub-blocks 2i and 2i + 1 are the low and high nibbles of bytes 32i..32i+31.
inline void q4_k_group_nibbles(const uint8_t* __restrict b, int jj, uint8_t* __restrict out) {
  const uint8_t* qs = b + 16 + (jj / 2) * 32;
  if (jj % 2)
    for (int i = 0; i < kGroup / 2; ++i) out[i] = (qs[i] >> 4) | (qs[16 + i] & 0xF0);
  else
    for (int i = 0; i < kGroup / 2; ++i) out[i] = (qs[i] & 0x0F) | (qs[16 + i] << 4);
}

}  // namespace

namespace tokenmill {

// Q4_K blocks (rows, cols / 256 * 144) uint8 -> q (rows, cols) uint8 in 0..15 and scale, low
// (rows, cols / 32) float32 with w = scale * q + low (`exact_groups`).
std::tuple<at::Tensor, at::Tensor, at::Tensor> q4_k_groups(const at::Tensor& blocks, int64_t rows, int64_t cols) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(), "q4_k_groups: blocks must be contiguous uint8");
  TORCH_CHECK(cols % kSuperBlock == 0 && blocks.numel() == rows * cols / kSuperBlock * kQ4KBytes,
              "q4_k_groups: ", blocks.numel(), " bytes are not Q4_K blocks of ", rows, " x ", cols);
  at::Tensor q = at::empty({rows, cols}, blocks.options());
  at::Tensor scale = at::empty({rows, cols / kGroup}, blocks.options().dtype(at::kFloat));
  at::Tensor low = at::empty_like(scale);
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* q_out = q.data_ptr<uint8_t>();
  float *scale_out = scale.data_ptr<float>(), *low_out = low.data_ptr<float>();
  const int64_t count = rows * cols / kSuperBlock;
  at::parallel_for(0, count, 256, [&](int64_t first, int64_t end) {
    for (int64_t n = first; n < end; ++n) {
      const uint8_t* b = in + n * kQ4KBytes;
      for (int j = 0; j < 8; ++j) {
        q4_k_scale_low(b, j, scale_out[n * 8 + j], low_out[n * 8 + j]);
        // sub-blocks 2i and 2i + 1: the low and high nibbles of bytes 32i..32i+31
        const uint8_t* __restrict qs = b + 16 + (j / 2) * 32;
        uint8_t* __restrict out = q_out + n * kSuperBlock + j * kGroup;
        for (int i = 0; i < kGroup; ++i) out[i] = j % 2 ? qs[i] >> 4 : qs[i] & 0x0F;
      }
    }
  });
  return {q, scale, low};
}

// Q4_K weights (each (rows_i, cols / 256 * 144) uint8) stacked by rows -> `pack_int4_rows` of their
// `q4_k_groups`, in one pass over the blocks and straight into the stacked outputs (`Int4RowsOut`).
std::tuple<at::Tensor, at::Tensor, at::Tensor> q4_k_int4_rows(const std::vector<at::Tensor>& weights, int64_t cols) {
  const std::vector<const uint8_t*> row_blocks =
      stacked_rows(weights, cols, kSuperBlock, kQ4KBytes, "q4_k_int4_rows", "Q4_K");
  const int64_t groups = cols / kGroup, rows = static_cast<int64_t>(row_blocks.size());
  const Int4RowsOut out(rows, cols, weights[0].options());
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t end) {
    std::vector<float> scale(groups), low(groups);
    for (int64_t r = first; r < end; ++r) {
      for (int64_t n = 0; n < cols / kSuperBlock; ++n) {
        const uint8_t* b = row_blocks[r] + n * kQ4KBytes;
        for (int j = 0; j < 8; ++j) {
          q4_k_scale_low(b, j, scale[n * 8 + j], low[n * 8 + j]);
          q4_k_group_nibbles(b, j, out.nibbles_out + r * cols / 2 + (n * 8 + j) * kGroup / 2);
        }
      }
      out.set_scales(r, scale.data(), low.data(), groups);
    }
  });
  return out.tensors();
}

// Q4_K weights (each (rows_i, cols / 256 * 144) uint8) stacked by rows -> `tile_bytes` (4 bits) of
// their `q4_k_groups`' q, and those groups' scale and low (rows, cols / 32) float32, in one pass over
// the blocks: no q of a byte per weight in between, nor a copy of it per stacked weight.
std::tuple<at::Tensor, at::Tensor, at::Tensor> q4_k_tiles(const std::vector<at::Tensor>& weights, int64_t cols) {
  const std::vector<const uint8_t*> row_blocks =
      stacked_rows(weights, cols, kSuperBlock, kQ4KBytes, "q4_k_tiles", "Q4_K");
  const int64_t rows = static_cast<int64_t>(row_blocks.size());
  TORCH_CHECK(rows % kWeightTileRows == 0, "q4_k_tiles: rows must be a multiple of 16");
  const int64_t groups = cols / kGroup, tiles = rows / kWeightTileRows, blocks = cols / kSuperBlock;
  const at::TensorOptions bytes = weights[0].options();
  at::Tensor q_out = at::empty({tiles * groups * 4 * kWeightTileRows * 4}, bytes);  // [tile, group, j, c, e]
  at::Tensor scale = at::empty({rows, groups}, bytes.dtype(at::kFloat));
  at::Tensor low = at::empty_like(scale);
  float *scale_out = scale.data_ptr<float>(), *low_out = low.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t end) {
    for (int64_t t = first; t < end; ++t)
      for (int64_t c = 0; c < kWeightTileRows; ++c) {
        const int64_t row = t * kWeightTileRows + c;
        for (int64_t n = 0; n < blocks; ++n) {
          const uint8_t* b = row_blocks[row] + n * kQ4KBytes;
          for (int jj = 0; jj < 8; ++jj) {  // the block's sub-blocks: groups 8n + jj of the row
            const int64_t g = n * 8 + jj;
            q4_k_scale_low(b, jj, scale_out[row * groups + g], low_out[row * groups + g]);
            uint8_t nibbles[kGroup / 2];
            q4_k_group_nibbles(b, jj, nibbles);
            uint8_t* out = q_out.data_ptr<uint8_t>() + (t * groups + g) * 4 * kWeightTileRows * 4 + 4 * c;
            for (int j = 0; j < 4; ++j) std::memcpy(out + j * kWeightTileRows * 4, nibbles + 4 * j, 4);
          }
        }
      }
  });
  return {q_out, scale, low};
}

// Q4_0 weights (blocks of 32 values in 18 bytes: d, then 16 bytes whose byte j holds element j in
// its low nibble and 16 + j in its high one; w = d q - 8 d) or Q4_1 ones (20 bytes: d, m, the same
// 16; w = d q + m), each (rows_i, cols / 32 * block bytes) uint8, stacked by rows -> `pack_int4_rows`
// of their `exact_groups`, in one pass, as `q4_k_int4_rows`: a block's 16 bytes are the row
// layout's nibbles as they are.
std::tuple<at::Tensor, at::Tensor, at::Tensor> q4_int4_rows(const std::vector<at::Tensor>& weights, int64_t cols,
                                                           bool with_min) {
  const int64_t block_bytes = with_min ? 20 : 18, header = block_bytes - kGroup / 2;
  const std::vector<const uint8_t*> row_blocks =
      stacked_rows(weights, cols, kGroup, block_bytes, "q4_int4_rows", with_min ? "Q4_1" : "Q4_0");
  const int64_t groups = cols / kGroup, rows = static_cast<int64_t>(row_blocks.size());
  const Int4RowsOut out(rows, cols, weights[0].options());
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t end) {
    std::vector<float> scale(groups), low(groups);
    for (int64_t r = first; r < end; ++r) {
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* b = row_blocks[r] + g * block_bytes;
        scale[g] = half_at(b);
        low[g] = with_min ? half_at(b + 2) : -8.0f * scale[g];
        std::memcpy(out.nibbles_out + (r * groups + g) * kGroup / 2, b + header, kGroup / 2);
      }
      out.set_scales(r, scale.data(), low.data(), groups);
    }
  });
  return out.tensors();
}

// Q6_K weights (each (rows_i, cols / 256 * 210) uint8) stacked by rows -> the int6 row layout of
// `int6_rows_linear`: nibbles (rows, cols / 2) uint8, highs (rows, cols / 4) uint8, steps
// (rows, cols / 16) int16 and units (rows) float32, w = step x unit x (q - 32). A row's unit is
// its largest 16-value scale (d x scale, as `q6_k_values`) in magnitude / 32767 (1 for a row of
// zero scales), each step its scale in units rounded half to even, as `Int4RowsOut`'s.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> q6_k_int6_rows(const std::vector<at::Tensor>& weights,
                                                                         int64_t cols) {
  const std::vector<const uint8_t*> row_blocks =
      stacked_rows(weights, cols, kSuperBlock, kQ6KBytes, "q6_k_int6_rows", "Q6_K");
  const int64_t blocks = cols / kSuperBlock, rows = static_cast<int64_t>(row_blocks.size());
  const at::TensorOptions bytes = weights[0].options();
  at::Tensor nibbles = at::empty({rows, cols / 2}, bytes), highs = at::empty({rows, cols / 4}, bytes);
  at::Tensor steps = at::empty({rows, cols / 16}, bytes.dtype(at::kShort));
  at::Tensor units = at::empty({rows}, bytes.dtype(at::kFloat));
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t end) {
    std::vector<float> scale(cols / 16);
    const __m256i nibble = _mm256_set1_epi8(0x0F), two_bits = _mm256_set1_epi8(3);
    for (int64_t r = first; r < end; ++r) {
      float peak = 0.0f;
      for (int64_t n = 0; n < blocks; ++n) {
        const uint8_t* b = row_blocks[r] + n * kQ6KBytes;
        const float d = half_at(b + 208);
        for (int s = 0; s < 16; ++s) {
          scale[n * 16 + s] = d * static_cast<float>(reinterpret_cast<const int8_t*>(b + 192)[s]);
          peak = std::max(peak, std::fabs(scale[n * 16 + s]));
        }
      }
      const float unit = units.data_ptr<float>()[r] = row_unit(peak);
      int16_t* row_steps = steps.data_ptr<int16_t>() + r * cols / 16;
      for (int64_t s = 0; s < cols / 16; ++s) row_steps[s] = step_of(scale[s], unit);
      for (int64_t n = 0; n < blocks; ++n) {
        const uint8_t* b = row_blocks[r] + n * kQ6KBytes;
        __m256i halves[8];  // group k's q (as q6_k_quarter: half k / 4, quarter k % 4) in int6_halves' order
        for (int k = 0; k < 8; ++k) {
          const int half = k / 4, quarter = k % 4;
          const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * half + 32 * (quarter & 1)));
          const __m256i top = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * half));
          const __m256i q = _mm256_or_si256(
              _mm256_and_si256(_mm256_srl_epi16(low, _mm_cvtsi32_si128(4 * (quarter >> 1))), nibble),
              _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(top, _mm_cvtsi32_si128(2 * quarter)), two_bits), 4));
          halves[k] = simd::int6_halves(q);
        }
        uint8_t* row_nibbles = nibbles.data_ptr<uint8_t>() + r * cols / 2 + n * kSuperBlock / 2;
        uint8_t* row_highs = highs.data_ptr<uint8_t>() + r * cols / 4 + n * kSuperBlock / 4;
        for (int quad = 0; quad < 2; ++quad) {
          __m256i tops = _mm256_setzero_si256();
          for (int pair = 0; pair < 2; ++pair) {  // the pair's first halves, then its second ones
            const __m256i a = halves[4 * quad + 2 * pair], c = halves[4 * quad + 2 * pair + 1];
            const __m256i vectors[2] = {_mm256_permute2x128_si256(a, c, 0x20), _mm256_permute2x128_si256(a, c, 0x31)};
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_nibbles + (4 * quad + 2 * pair) * 16),
                                _mm256_or_si256(_mm256_and_si256(vectors[0], nibble),
                                                _mm256_slli_epi16(_mm256_and_si256(vectors[1], nibble), 4)));
            for (int v = 0; v < 2; ++v)  // vector 2 pair + v's top bits to bits 2 (2 pair + v) and up
              tops = _mm256_or_si256(tops, _mm256_sll_epi16(_mm256_and_si256(_mm256_srli_epi16(vectors[v], 4), two_bits),
                                                            _mm_cvtsi32_si128(2 * (2 * pair + v))));
          }
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(row_highs + quad * 32), tops);
        }
      }
    }
  });
  return {nibbles, highs, steps, units};
}

// Q6_K blocks (rows, cols / 256 * 210) uint8 -> each row quantized to int8 with one scale, as
// quant_linear.py's `quantize_int8` of the dequantized row: scale = max(amax / 127, 1e-12),
// q = clamp(round-half-even(w / scale), -127, 127).
std::tuple<at::Tensor, at::Tensor> q6_k_int8_rows(const at::Tensor& blocks, int64_t rows, int64_t cols) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "q6_k_int8_rows: blocks must be contiguous uint8");
  TORCH_CHECK(cols % kSuperBlock == 0 && blocks.numel() == rows * cols / kSuperBlock * kQ6KBytes,
              "q6_k_int8_rows: ", blocks.numel(), " bytes are not Q6_K blocks of ", rows, " x ", cols);
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  const int64_t row_bytes = cols / kSuperBlock * kQ6KBytes;
  return int8_rows_of(rows, cols, blocks.options(), [&](int64_t r, float* w) {
    for (int64_t k = 0; k < cols / kSuperBlock; ++k)
      q6_k_values(in + r * row_bytes + k * kQ6KBytes, w + k * kSuperBlock);
  });
}

// Q8_0 blocks (rows, cols / 32 * 34) uint8 (d, then 32 int8 q; w = d q, exact in float32) -> each
// row quantized to int8 with one scale, as `q6_k_int8_rows` (a Q8_0 embedding that is also the
// output head: Gemma 3's has 262k rows).
std::tuple<at::Tensor, at::Tensor> q8_0_int8_rows(const at::Tensor& blocks, int64_t rows, int64_t cols) {
  constexpr int64_t kQ8_0Bytes = 2 + kGroup;
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.is_contiguous(),
              "q8_0_int8_rows: blocks must be contiguous uint8");
  TORCH_CHECK(cols % kGroup == 0 && blocks.numel() == rows * cols / kGroup * kQ8_0Bytes, "q8_0_int8_rows: ",
              blocks.numel(), " bytes are not Q8_0 blocks of ", rows, " x ", cols);
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  const int64_t groups = cols / kGroup;
  return int8_rows_of(rows, cols, blocks.options(), [&](int64_t r, float* w) {
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* b = in + (r * groups + g) * kQ8_0Bytes;
      const float d = half_at(b);
      const int8_t* values = reinterpret_cast<const int8_t*>(b + 2);
      for (int64_t e = 0; e < kGroup; ++e) w[g * kGroup + e] = d * static_cast<float>(values[e]);
    }
  });
}

// `pack_tiles`' tile bytes of q (rows, cols): 4 bits (uint8 in 0..15; the two halves of each group
// share bytes as low and high nibbles) or 8 (int8, stored as q + 128). Per tile of 16 rows, group
// of 32 and sub-block j, byte 4c + e of each vector holds row c's q at element 4j + e of the
// group's first half, then of its second.
at::Tensor tile_bytes(const at::Tensor& q, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "tile_bytes: bits must be 4 or 8");
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.scalar_type() == (bits == 8 ? at::kChar : at::kByte),
              "tile_bytes: q must be contiguous 2-D, int8 for 8 bits, uint8 for 4");
  const int64_t rows = q.size(0), cols = q.size(1);
  TORCH_CHECK(rows % kWeightTileRows == 0 && cols % kGroup == 0,
              "tile_bytes: rows must be a multiple of 16, cols of 32");
  const int64_t groups = cols / kGroup, tiles = rows / kWeightTileRows, halves = bits == 8 ? 2 : 1;
  // [tile, group, j, half, c, e]
  at::Tensor out = at::empty({tiles * groups * 4 * halves * kWeightTileRows * 4}, q.options().dtype(at::kByte));
  const uint8_t* in = reinterpret_cast<const uint8_t*>(q.data_ptr());
  uint8_t* o = out.data_ptr<uint8_t>();
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t end) {
    for (int64_t t = first; t < end; ++t)
      for (int64_t g = 0; g < groups; ++g)
        for (int64_t j = 0; j < 4; ++j)
          for (int64_t h = 0; h < halves; ++h) {
            uint32_t* v =
                reinterpret_cast<uint32_t*>(o + (((t * groups + g) * 4 + j) * halves + h) * kWeightTileRows * 4);
            for (int64_t c = 0; c < kWeightTileRows; ++c) {
              const uint8_t* row = in + (t * kWeightTileRows + c) * cols + g * kGroup + 4 * j;
              uint32_t first_half, second_half;
              std::memcpy(&first_half, row + 16 * h, 4);
              if (bits == 8) {
                v[c] = first_half ^ 0x80808080u;
              } else {
                std::memcpy(&second_half, row + 16, 4);
                v[c] = (first_half & 0x0F0F0F0Fu) | ((second_half & 0x0F0F0F0Fu) << 4);
              }
            }
          }
  });
  return out;
}

// Q6_K's q (0..63) of the 256 values of the block at b, into q: value 32k + l of half h takes its
// low 4 bits from byte l (k even) or l + 32 (k odd) of the half's 64 (the low nibble for k < 2, the
// high one after) and its high 2 from bits 2k, 2k + 1 of byte l of the half's 32 (the layout
// `q6_k_quarter` reads). Written as four stores per byte pair so that the loop vectorizes.
inline void q6_k_qs(const uint8_t* __restrict b, uint8_t* __restrict q) {
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = b + 64 * h;
    const uint8_t* qh = b + 128 + 32 * h;
    uint8_t* out = q + 128 * h;
    for (int l = 0; l < 32; ++l) {
      const uint8_t even = ql[l], odd = ql[l + 32], top = qh[l];
      out[l] = static_cast<uint8_t>((even & 0x0F) | ((top & 3) << 4));
      out[32 + l] = static_cast<uint8_t>((odd & 0x0F) | (((top >> 2) & 3) << 4));
      out[64 + l] = static_cast<uint8_t>((even >> 4) | (((top >> 4) & 3) << 4));
      out[96 + l] = static_cast<uint8_t>((odd >> 4) | (((top >> 6) & 3) << 4));
    }
  }
}

// Q6_K weights (each (rows_i, cols / 256 * 210) uint8, their rows stacked) in the 6-bit tile layout
// (quant_linear.py's `q6_tiles`): per tile of 16 rows and group of 32, 384 bytes: per quarter j,
// 64 bytes whose byte 4c + e holds row c's q at element 4j + e of the group in its low nibble
// and at 16 + 4j + e in its high one (the 4-bit tiles' bytes), then per pair p of quarters 64
// bytes whose byte 4c + e holds the top 2 bits of those q of quarter 2p (bits 0-1, 2-3) and
// 2p + 1 (bits 4-5, 6-7). The scales, per tile and block of 256 (a Q6_K block): each 16 values'
// int8 scale [group, half, c], then each row's d as float32 [c]; w = d x scale x (q - 32) exactly.
std::tuple<at::Tensor, at::Tensor> q6_k_tiles(const std::vector<at::Tensor>& weights, int64_t cols) {
  const std::vector<const uint8_t*> row_blocks =
      stacked_rows(weights, cols, kSuperBlock, kQ6KBytes, "q6_k_tiles", "Q6_K");
  const int64_t rows = static_cast<int64_t>(row_blocks.size());
  TORCH_CHECK(rows % kWeightTileRows == 0, "q6_k_tiles: rows must be a multiple of 16");
  constexpr int64_t kGroupBytes = 384, kBlockScaleBytes = 320, kBlockGroups = kSuperBlock / kGroup;
  const int64_t tiles = rows / kWeightTileRows, blocks = cols / kSuperBlock, groups = cols / kGroup;
  const at::TensorOptions bytes = weights[0].options();
  at::Tensor q_out = at::empty({tiles * groups * kGroupBytes}, bytes);
  at::Tensor scales_out = at::empty({tiles, blocks, kBlockScaleBytes}, bytes);
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t end) {
    uint8_t q[kWeightTileRows][kSuperBlock];
    for (int64_t t = first; t < end; ++t)
      for (int64_t n = 0; n < blocks; ++n) {
        uint8_t* scales = scales_out.data_ptr<uint8_t>() + (t * blocks + n) * kBlockScaleBytes;
        for (int64_t c = 0; c < kWeightTileRows; ++c) {
          const uint8_t* b = row_blocks[t * kWeightTileRows + c] + n * kQ6KBytes;
          q6_k_qs(b, q[c]);
          for (int s = 0; s < 16; ++s) scales[s * kWeightTileRows + c] = b[192 + s];  // s = 2 group + half
          const float d = half_at(b + 208);
          std::memcpy(scales + 256 + 4 * c, &d, 4);
        }
        // four values of a row at once, one per byte of a 32-bit word (q < 64: no bit crosses a byte)
        for (int64_t gb = 0; gb < kBlockGroups; ++gb) {
          uint8_t* out = q_out.data_ptr<uint8_t>() + (t * groups + n * kBlockGroups + gb) * kGroupBytes;
          for (int64_t c = 0; c < kWeightTileRows; ++c) {
            const uint8_t* v = q[c] + gb * kGroup;
            uint32_t tops[2] = {0, 0};
            for (int j = 0; j < 4; ++j) {
              uint32_t first, second;  // elements 4j.. and 16 + 4j.. of the group
              std::memcpy(&first, v + 4 * j, 4);
              std::memcpy(&second, v + 16 + 4 * j, 4);
              const uint32_t nibbles = (first & 0x0F0F0F0Fu) | ((second & 0x0F0F0F0Fu) << 4);
              const uint32_t bits = ((first >> 4) & 0x03030303u) | (((second >> 4) & 0x03030303u) << 2);
              std::memcpy(out + j * 64 + 4 * c, &nibbles, 4);
              tops[j / 2] |= bits << (4 * (j % 2));
            }
            std::memcpy(out + 256 + 4 * c, &tops[0], 4);
            std::memcpy(out + 256 + 64 + 4 * c, &tops[1], 4);
          }
        }
      }
  });
  return {q_out, scales_out};
}

// `compact_tile_scales`: per-group scale and low (rows, groups) float32 as compact tile scales
// (rows / 16, groups / 8, 8 * 32 + 128) uint8, or nullopt where some value is no whole multiple
// (0-63) of its block's unit. Per tile, block of 8 groups: the multiples [group, scale/low, row c],
// then the units [scale/low, c] as float32 bytes; a unit is the block's value of largest magnitude
// (its first) / 63.
std::optional<at::Tensor> compact_scales(const at::Tensor& scale, const at::Tensor& low) {
  TORCH_CHECK(scale.dim() == 2 && scale.sizes() == low.sizes() && scale.scalar_type() == at::kFloat &&
                  low.scalar_type() == at::kFloat && scale.is_contiguous() && low.is_contiguous(),
              "compact_scales: scale and low must be contiguous float32 of one shape (rows, groups)");
  const int64_t rows = scale.size(0), groups = scale.size(1);
  constexpr int64_t kBlockGroups = 8, kBlockBytes = kBlockGroups * 32 + 128;
  TORCH_CHECK(rows % kWeightTileRows == 0 && groups % kBlockGroups == 0,
              "compact_scales: rows must be a multiple of 16, groups of 8");
  const int64_t tiles = rows / kWeightTileRows, blocks = groups / kBlockGroups;
  at::Tensor out = at::empty({tiles, blocks, kBlockBytes}, scale.options().dtype(at::kByte));
  const float* values[2] = {scale.data_ptr<float>(), low.data_ptr<float>()};
  uint8_t* o = out.data_ptr<uint8_t>();
  std::atomic<bool> fits{true};
  at::parallel_for(0, tiles, 1, [&](int64_t first, int64_t end) {
    for (int64_t t = first; t < end && fits.load(std::memory_order_relaxed); ++t)
      for (int64_t b = 0; b < blocks; ++b) {
        uint8_t* block = o + (t * blocks + b) * kBlockBytes;
        float* units = reinterpret_cast<float*>(block + kBlockGroups * 32);  // [scale/low, c]
        for (int sl = 0; sl < 2; ++sl)
          for (int64_t c = 0; c < kWeightTileRows; ++c) {
            const float* v = values[sl] + (t * kWeightTileRows + c) * groups + b * kBlockGroups;
            int64_t peak = 0;
            for (int64_t g = 1; g < kBlockGroups; ++g)
              if (std::fabs(v[g]) > std::fabs(v[peak])) peak = g;
            const float unit = v[peak] / 63.0f;
            std::memcpy(units + sl * kWeightTileRows + c, &unit, 4);
            for (int64_t g = 0; g < kBlockGroups; ++g) {
              const float multiple = unit == 0.0f ? 0.0f : std::nearbyint(v[g] / unit);
              const bool whole = multiple * unit == v[g] && multiple >= 0.0f && multiple <= 255.0f;
              if (!whole) fits.store(false, std::memory_order_relaxed);
              block[(g * 2 + sl) * kWeightTileRows + c] = whole ? static_cast<uint8_t>(multiple) : 0;
            }
          }
      }
  });
  if (!fits.load()) return std::nullopt;
  return out;
}

}  // namespace tokenmill
