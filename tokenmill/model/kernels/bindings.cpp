// The kernels' entry points (ops.h) bound with pybind11, for eager calls from Python
// (`tokenmill.model.kernels.ops`), and registered with the dispatcher as torch.ops.tokenmill.*, which
// compiled graphs call (their schemas, `TORCH_LIBRARY` at the end).
// Each call releases the GIL while it runs, as a call through the dispatcher does: the server's
// event loop and the background graph builds run Python meanwhile.
//
// `bind_*` take a product's arguments after x, and the layer's bias, and give a BoundLinear: the
// layers of `decoder_layer` multiply through them.
#include <ATen/ops/linear.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "ops.h"

namespace {

using tokenmill::BoundLinear;
using Optional = std::optional<at::Tensor>;

BoundLinear bind_quant_tiles_linear(at::Tensor tiles, at::Tensor tile_scales, Optional fifth_masks, int64_t bits,
                                    Optional dense, int64_t max_tile_rows, int64_t x_block,
                                    int64_t max_coarse_rows, int64_t amx_min_rows, Optional bias) {
  return {[=](const at::Tensor& x) {
            return tokenmill::quant_tiles_linear(x, tiles, tile_scales, fifth_masks, bits, dense, max_tile_rows,
                                                 x_block, max_coarse_rows, amx_min_rows);
          },
          bias};
}

BoundLinear bind_int4_rows_linear(at::Tensor nibbles, at::Tensor steps_lows, at::Tensor units, Optional fifth_bits,
                                  Optional dense, int64_t max_gemv_rows, Optional bias) {
  return {[=](const at::Tensor& x) {
            return tokenmill::int4_rows_linear(x, nibbles, steps_lows, units, fifth_bits, dense, max_gemv_rows);
          },
          bias};
}

BoundLinear bind_int6_rows_linear(at::Tensor nibbles, at::Tensor highs, at::Tensor steps, at::Tensor units,
                                  Optional dense, int64_t max_gemv_rows, Optional bias) {
  return {[=](const at::Tensor& x) {
            return tokenmill::int6_rows_linear(x, nibbles, highs, steps, units, dense, max_gemv_rows);
          },
          bias};
}

BoundLinear bind_int4_linear(at::Tensor packed, at::Tensor scales_zeros, int64_t group_size, Optional dense,
                             int64_t max_packed_rows, Optional bias) {
  return {[=](const at::Tensor& x) {
            return tokenmill::int4_linear(x, packed, scales_zeros, group_size, dense, max_packed_rows);
          },
          bias};
}

BoundLinear bind_int8_linear(at::Tensor weight, at::Tensor scale, Optional dense, int64_t max_gemv_rows,
                             int64_t chunk_rows, Optional bias) {
  return {[=](const at::Tensor& x) {
            return tokenmill::int8_linear(x, weight, scale, dense, max_gemv_rows, chunk_rows);
          },
          bias};
}

// dense_linear and at::linear (F.linear) add the bias themselves
BoundLinear bind_dense_linear(at::Tensor weight, Optional bias) {
  return {[=](const at::Tensor& x) { return tokenmill::dense_linear(x, weight, bias); }, std::nullopt};
}

BoundLinear bind_linear(at::Tensor weight, Optional bias) {
  return {[=](const at::Tensor& x) { return at::linear(x, weight, bias); }, std::nullopt};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto unlocked = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("int8_linear", &tokenmill::int8_linear, unlocked);
  m.def("int4_rows_linear", &tokenmill::int4_rows_linear, unlocked);
  m.def("int6_rows_linear", &tokenmill::int6_rows_linear, unlocked);
  m.def("int4_linear", &tokenmill::int4_linear, unlocked);
  m.def("quant_tiles_linear", &tokenmill::quant_tiles_linear, unlocked);
  m.def("quant_tiles_linear_into", &tokenmill::quant_tiles_linear_into, unlocked);
  m.def("dense_linear", &tokenmill::dense_linear, unlocked);
  m.def("rms_norm", &tokenmill::rms_norm, unlocked);
  m.def("rotary", &tokenmill::rotary, unlocked);
  m.def("rotary_write_kv", &tokenmill::rotary_write_kv, unlocked);
  m.def("gated_activation", &tokenmill::gated_activation, unlocked);
  m.def("decode_attention", &tokenmill::decode_attention, unlocked);
  m.def("greedy_ids", &tokenmill::greedy_ids, unlocked);
  m.def("sample_ids", &tokenmill::sample_ids, unlocked);
  m.def("ban_disallowed_", &tokenmill::ban_disallowed_, unlocked);
  m.def("q4_k_groups", &tokenmill::q4_k_groups, unlocked);
  m.def("q4_k_int4_rows", &tokenmill::q4_k_int4_rows, unlocked);
  m.def("q4_k_tiles", &tokenmill::q4_k_tiles, unlocked);
  m.def("q4_int4_rows", &tokenmill::q4_int4_rows, unlocked);
  m.def("q6_k_int6_rows", &tokenmill::q6_k_int6_rows, unlocked);
  m.def("q6_k_tiles", &tokenmill::q6_k_tiles, unlocked);
  m.def("q6_k_int8_rows", &tokenmill::q6_k_int8_rows, unlocked);
  m.def("q8_0_int8_rows", &tokenmill::q8_0_int8_rows, unlocked);
  m.def("tile_bytes", &tokenmill::tile_bytes, unlocked);
  m.def("compact_scales", &tokenmill::compact_scales, unlocked);

  pybind11::class_<BoundLinear>(m, "BoundLinear").def("__call__", &BoundLinear::operator(), unlocked);
  m.def("bind_quant_tiles_linear", &bind_quant_tiles_linear);
  m.def("bind_int4_rows_linear", &bind_int4_rows_linear);
  m.def("bind_int6_rows_linear", &bind_int6_rows_linear);
  m.def("bind_int4_linear", &bind_int4_linear);
  m.def("bind_int8_linear", &bind_int8_linear);
  m.def("bind_dense_linear", &bind_dense_linear);
  m.def("bind_linear", &bind_linear);
  namespace py = pybind11;
  py::class_<tokenmill::DecoderLayerWeights>(m, "DecoderLayerWeights")
      .def(py::init([](at::Tensor attn_norm, at::Tensor ffn_norm, Optional q_norm, Optional k_norm,
                       Optional attn_post_norm, Optional ffn_post_norm, double eps, BoundLinear qkv, BoundLinear o,
                       BoundLinear gate_up, BoundLinear down, int64_t heads, double scale,
                       std::optional<double> softcap, Optional sinks, std::string activation) {
             return tokenmill::DecoderLayerWeights{attn_norm, ffn_norm, q_norm,  k_norm,  attn_post_norm, ffn_post_norm,
                                                   eps,       qkv,      o,       gate_up, down,           heads,
                                                   scale,     softcap,  sinks,   activation};
           }),
           py::arg("attn_norm"), py::arg("ffn_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("attn_post_norm"),
           py::arg("ffn_post_norm"), py::arg("eps"), py::arg("qkv"), py::arg("o"), py::arg("gate_up"),
           py::arg("down"), py::arg("heads"), py::arg("scale"), py::arg("softcap"), py::arg("sinks"),
           py::arg("activation"));
  m.def("decoder_layer", &tokenmill::decoder_layer, unlocked);
}

TORCH_LIBRARY(tokenmill, m) {
  m.def("tiles_built() -> bool", &tokenmill::tiles_built);
  m.def("amx_usable() -> bool", &tokenmill::amx_usable);
  m.def("int4_linear(Tensor x, Tensor packed, Tensor scales_zeros, int group_size, Tensor? dense, "
        "int max_packed_rows) -> Tensor");
  m.def("int8_linear(Tensor x, Tensor weight, Tensor scale, Tensor? dense, int max_gemv_rows, int chunk_rows) "
        "-> Tensor");
  m.def("int4_rows_linear(Tensor x, Tensor nibbles, Tensor steps_lows, Tensor units, Tensor? fifth_bits, "
        "Tensor? dense, int max_gemv_rows) -> Tensor");
  m.def("int6_rows_linear(Tensor x, Tensor nibbles, Tensor highs, Tensor steps, Tensor units, Tensor? dense, "
        "int max_gemv_rows) -> Tensor");
  m.def("quant_tiles_linear(Tensor x, Tensor tiles, Tensor tile_scales, Tensor? fifth_masks, int bits, Tensor? dense, "
        "int max_tile_rows, int x_block=8, int max_coarse_rows=-1, int amx_min_rows=-1) -> Tensor");
  m.def("dense_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def(
      "rotary_write_kv(Tensor qkv, Tensor cos, Tensor sin, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slots, "
      "int heads) -> Tensor");
  m.def("gated_activation(Tensor gate_up, str kind) -> Tensor");
  m.def("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor slots, Tensor mask, float scale, "
        "float? softcap, Tensor? sinks=None) -> Tensor");
  m.def("greedy_ids(Tensor logits) -> Tensor");
  m.def("sample_ids(Tensor logits, Tensor inverse_temperature, Tensor uniforms) -> Tensor");
  m.def("ban_disallowed_(Tensor(a!) logits, Tensor rows, Tensor bits) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("int8_linear", &tokenmill::int8_linear);
  m.impl("int4_linear", &tokenmill::int4_linear);
  m.impl("int4_rows_linear", &tokenmill::int4_rows_linear);
  m.impl("int6_rows_linear", &tokenmill::int6_rows_linear);
  m.impl("quant_tiles_linear", &tokenmill::quant_tiles_linear);
  m.impl("dense_linear", &tokenmill::dense_linear);
  m.impl("rms_norm", &tokenmill::rms_norm);
  m.impl("rotary", &tokenmill::rotary);
  m.impl("rotary_write_kv", &tokenmill::rotary_write_kv);
  m.impl("gated_activation", &tokenmill::gated_activation);
  m.impl("decode_attention", &tokenmill::decode_attention);
  m.impl("greedy_ids", &tokenmill::greedy_ids);
  m.impl("sample_ids", &tokenmill::sample_ids);
  m.impl("ban_disallowed_", &tokenmill::ban_disallowed_);
}
