// Dense float32 y = x W^T (+ bias), batch invariant: every output element is summed in one fixed
// order, whatever the number of rows, the row's place among them and the threads.
//
// PyTorch's fp32 matmul (MKL, oneDNN) picks its kernel by the number of rows, and the kernels sum
// a row's products in different orders, so a row's last bits depend on its batch. Here each
// element y[i][j] has a vector accumulator over K: lane l sums x[i][k] w[j][k] for k = l, l + kWidth,
// ... in order with FMAs (the last, partial vector loaded with zeros past K), and the lanes are then
// added by one fixed tree (simd::transposed_sums, the same tree for every lane). Blocking only
// chooses which elements are computed together and where accumulators wait between blocks of K
// (stored and reloaded whole, exactly): it never changes an element's arithmetic.
//
// Register blocking: kTileRows rows x kTileCols weight rows (columns of y) a tile, kWidth
// accumulators in all, so one transposed_sums finishes a tile. Cache blocking: each thread takes
// column blocks of about kColumnBlockBytes of W per K slice (read from memory once, then from L2
// by every row tile), and K goes in slices of kKSlice, so that a row tile's slice of x stays in L1
// while the block's columns pass. Threads split the columns, never K.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "ops.h"
#include "simd.h"

namespace {

#ifdef SIMD_AVX512
constexpr int kTileRows = 4, kTileCols = 4;  // 16 accumulators of AVX-512's 32 registers
#else
constexpr int kTileRows = 2, kTileCols = 4;  // 8 accumulators of AVX2's 16 registers
#endif
static_assert(kTileRows * kTileCols == simd::kWidth, "a tile's sums fill one vector");

constexpr int64_t kColumnBlockBytes = 256 << 10;  // of W's K slice per column block: stays in L2
constexpr int64_t kKSlice = 1024;                 // x's elements per row and slice: stays in L1
constexpr int64_t kRowBlock = 256;                // rows whose accumulators wait between K slices

// The kWidth elements of p from k (fewer where K ends: zeros past it)
inline simd::Vec load_part(const float* p, int64_t count) {
#ifdef SIMD_AVX512
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << count) - 1), p);
#else
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), lanes));
#endif
}

// acc[i * kTileCols + j] += the products of x row i and W row j over [k0, k1) (k0 a multiple of
// kWidth; k1 == K or a multiple of kWidth), for the tile's first Rows rows (the others' stay as
// they are). Weight rows past W's edge are given as repeats of valid ones, so the loop has no
// branches; their results are dropped.
template <int Rows>
inline void tile_products(const float* const* x, const float* const* w, int64_t k0, int64_t k1, simd::Vec* acc) {
  using namespace simd;
  int64_t k = k0;
  for (; k + kWidth <= k1; k += kWidth) {
    Vec xv[kTileRows];
    for (int i = 0; i < Rows; ++i) xv[i] = load(x[i] + k);
    for (int j = 0; j < kTileCols; ++j) {
      const Vec wv = load(w[j] + k);
      for (int i = 0; i < Rows; ++i) acc[i * kTileCols + j] = fmadd(xv[i], wv, acc[i * kTileCols + j]);
    }
  }
  if (k < k1) {
    Vec xv[kTileRows];
    for (int i = 0; i < Rows; ++i) xv[i] = load_part(x[i] + k, k1 - k);
    for (int j = 0; j < kTileCols; ++j) {
      const Vec wv = load_part(w[j] + k, k1 - k);
      for (int i = 0; i < Rows; ++i) acc[i * kTileCols + j] = fmadd(xv[i], wv, acc[i * kTileCols + j]);
    }
  }
}

// One tile's products over [k0, k1) into acc, for its first `rows` rows
inline void tile_products(int64_t rows, const float* const* x, const float* const* w, int64_t k0, int64_t k1,
                          simd::Vec* acc) {
  switch (rows) {
    case 1: tile_products<1>(x, w, k0, k1, acc); break;
    case 2: tile_products<2>(x, w, k0, k1, acc); break;
#ifdef SIMD_AVX512
    case 3: tile_products<3>(x, w, k0, k1, acc); break;
#endif
    default: tile_products<kTileRows>(x, w, k0, k1, acc); break;
  }
}

// y's columns [col0, col1) (one task's column block) for all M rows: a block of kRowBlock rows at a
// time goes through K slice by slice, each row tile's slice of x (in L1) through every column tile
// of the block, whose slice of W stays in L2. Between slices each tile's accumulators wait in
// `waiting` (rows x columns of the row block, kWidth floats each).
void column_block(const float* x, const float* weight, const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                  int64_t col0, int64_t col1, std::vector<float>& waiting) {
  using namespace simd;
  const int64_t tiles = (col1 - col0 + kTileCols - 1) / kTileCols;
  if (K > kKSlice) waiting.resize(kRowBlock / kTileRows * tiles * kWidth * kWidth);
  for (int64_t block0 = 0; block0 < M; block0 += kRowBlock) {
    const int64_t block1 = std::min(M, block0 + kRowBlock);
    for (int64_t k0 = 0; k0 < K; k0 += kKSlice) {
      const int64_t k1 = std::min(K, k0 + kKSlice);
      const bool first = k0 == 0, last = k1 == K;
      for (int64_t row0 = block0; row0 < block1; row0 += kTileRows) {
        const int64_t rows = std::min<int64_t>(kTileRows, block1 - row0);
        const float* xr[kTileRows];
        for (int i = 0; i < rows; ++i) xr[i] = x + (row0 + i) * K;
        for (int64_t t = 0; t < tiles; ++t) {
          const int64_t c0 = col0 + t * kTileCols, cols = std::min<int64_t>(kTileCols, col1 - c0);
          const float* wr[kTileCols];
          for (int j = 0; j < kTileCols; ++j) wr[j] = weight + (c0 + std::min<int64_t>(j, cols - 1)) * K;
          float* tile_waiting = waiting.data() + ((row0 - block0) / kTileRows * tiles + t) * kWidth * kWidth;
          Vec acc[kWidth];
          for (int a = 0; a < kWidth; ++a) acc[a] = first ? zero() : load(tile_waiting + a * kWidth);
          tile_products(rows, xr, wr, k0, k1, acc);
          if (!last) {
            for (int a = 0; a < kWidth; ++a) store(tile_waiting + a * kWidth, acc[a]);
            continue;
          }
          alignas(64) float sums[kWidth];
          store(sums, transposed_sums(acc));
          for (int64_t i = 0; i < rows; ++i) {
            float* out = y + (row0 + i) * N + c0;
            const float* tile_row = sums + i * kTileCols;
            for (int64_t j = 0; j < cols; ++j) out[j] = bias ? tile_row[j] + bias[c0 + j] : tile_row[j];
          }
        }
      }
    }
  }
}

}  // namespace

namespace tokenmill {

// y (M, N) = x (M, K) W^T (+ bias) for float32 x, W (N, K) and bias (N)
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "dense_linear: x must be a 2-D float32 tensor");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "dense_linear: the weight must be a contiguous 2-D float32 tensor");
  TORCH_CHECK(x.size(1) == weight.size(1), "dense_linear: x's width must equal the weight's");
  const int64_t M = x.size(0), N = weight.size(0), K = weight.size(1);
  const float* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == N,
                "dense_linear: bias must be contiguous float32, one value per weight row");
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return b ? y.copy_(bias->expand({M, N})) : y.zero_();
  const at::Tensor xc = x.contiguous();
  const float* xs = xc.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  const int64_t slice = std::min(K, kKSlice);
  const int64_t block = std::max<int64_t>(kTileCols, kColumnBlockBytes / (slice * 4) / kTileCols * kTileCols);
  const int64_t blocks = (N + block - 1) / block;
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> waiting;
    for (int64_t c = begin; c < end; ++c)
      column_block(xs, w, b, ys, M, N, K, c * block, std::min(N, (c + 1) * block), waiting);
  });
  return y;
}

}  // namespace tokenmill
