// The kernels' entry points. bindings.cpp exposes them twice: registered as torch.ops.tokenmill.*
// (for compiled graphs, which trace through the dispatcher) and bound with pybind11 for eager calls
// from Python: a call through pybind11 skips the dispatcher's argument parsing, which costs several
// times as long and adds up over the few hundred small ops of an eager decode step (tuning log:
// `ops`). The kernel sources include only ATen's tensor and the ATen ops they call; the heavier
// headers of pybind11 and of the dispatcher's registration are bindings.cpp's alone, so only its
// translation unit parses them (tuning log: `SOURCE_COMPILE_SECONDS`).
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace tokenmill {

// gemv.cpp
bool tiles_built();  // whether this build has the tile kernel (AVX-512 with byte instructions and VNNI)
bool amx_usable();   // whether the tile kernel can hand bf16 rows to AMX here
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       const std::optional<at::Tensor>& dense, int64_t max_gemv_rows, int64_t chunk_rows);
at::Tensor int4_rows_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& steps_lows,
                            const at::Tensor& units, const std::optional<at::Tensor>& fifth_bits,
                            const std::optional<at::Tensor>& dense, int64_t max_gemv_rows);
at::Tensor int6_rows_linear(const at::Tensor& x, const at::Tensor& nibbles, const at::Tensor& highs,
                            const at::Tensor& steps, const at::Tensor& units, const std::optional<at::Tensor>& dense,
                            int64_t max_gemv_rows);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales_zeros,
                       int64_t group_size, const std::optional<at::Tensor>& dense, int64_t max_packed_rows);
at::Tensor quant_tiles_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales,
                              const std::optional<at::Tensor>& fifth_masks, int64_t bits,
                              const std::optional<at::Tensor>& dense, int64_t max_tile_rows, int64_t x_block,
                              int64_t max_coarse_rows, int64_t amx_min_rows);
at::Tensor quant_tiles_linear_into(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& tile_scales,
                                   const std::optional<at::Tensor>& fifth_masks, int64_t bits,
                                   const std::optional<at::Tensor>& dense, int64_t max_tile_rows, int64_t x_block,
                                   int64_t max_coarse_rows, int64_t amx_min_rows, at::Tensor into);
// dense.cpp
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias);
// norm.cpp, rotary.cpp, activation.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rotary_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                           at::Tensor& v_cache, const at::Tensor& slots, int64_t heads);
at::Tensor gated_activation(const at::Tensor& gate_up, std::string_view kind);
// attention.cpp
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& slots, const at::Tensor& mask, double scale, std::optional<double> softcap,
                            const std::optional<at::Tensor>& sinks);
// sample.cpp
at::Tensor greedy_ids(const at::Tensor& logits);
at::Tensor sample_ids(const at::Tensor& logits, const at::Tensor& inverse_temperature, const at::Tensor& uniforms);
void ban_disallowed_(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bits);

// layout.cpp (loading)
std::tuple<at::Tensor, at::Tensor, at::Tensor> q4_k_groups(const at::Tensor& blocks, int64_t rows, int64_t cols);
std::tuple<at::Tensor, at::Tensor, at::Tensor> q4_k_int4_rows(const std::vector<at::Tensor>& weights, int64_t cols);
std::tuple<at::Tensor, at::Tensor, at::Tensor> q4_k_tiles(const std::vector<at::Tensor>& weights, int64_t cols);
std::tuple<at::Tensor, at::Tensor, at::Tensor> q4_int4_rows(const std::vector<at::Tensor>& weights, int64_t cols,
                                                           bool with_min);
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> q6_k_int6_rows(const std::vector<at::Tensor>& weights,
                                                                         int64_t cols);
std::tuple<at::Tensor, at::Tensor> q6_k_tiles(const std::vector<at::Tensor>& weights, int64_t cols);
std::tuple<at::Tensor, at::Tensor> q6_k_int8_rows(const at::Tensor& blocks, int64_t rows, int64_t cols);
std::tuple<at::Tensor, at::Tensor> q8_0_int8_rows(const at::Tensor& blocks, int64_t rows, int64_t cols);
at::Tensor tile_bytes(const at::Tensor& q, int64_t bits);
std::optional<at::Tensor> compact_scales(const at::Tensor& scale, const at::Tensor& low);

// layer.cpp
// A linear layer as an eager step multiplies by it: one of the products above with the layer's
// weights and settings bound, then its bias, if it has one, added.
struct BoundLinear {
  std::function<at::Tensor(const at::Tensor&)> product;
  std::optional<at::Tensor> bias;
  at::Tensor operator()(const at::Tensor& x) const;
};
// What `decoder_layer` needs of a pre-norm decoder layer: its norms (q_norm and k_norm per head,
// and the post norms, where the layer has them), projections and attention settings.
struct DecoderLayerWeights {
  at::Tensor attn_norm, ffn_norm;
  std::optional<at::Tensor> q_norm, k_norm, attn_post_norm, ffn_post_norm;
  double eps;
  BoundLinear qkv, o, gate_up, down;
  int64_t heads;
  double scale;
  std::optional<double> softcap;
  std::optional<at::Tensor> sinks;
  std::string activation;
};
at::Tensor decoder_layer(const at::Tensor& h, const DecoderLayerWeights& layer, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& context_slots, const at::Tensor& mask);

}  // namespace tokenmill
