// One pre-norm decoder layer of an eager step in one call: norm, q/k/v projection, rope and cache
// write, attention, output projection and residual, then norm, gate/up projection, activation, down
// projection and residual. These are the ops the layer's Python forward calls, with the same
// arguments and in the same order, so each token's result is the same bits either way. From
// Python, each op's call adds the forward's checks, attribute lookups and a binding's argument
// conversion: over the ten or so ops of each layer of a small model's decode step, a large share of
// the step (tuning log: `decoder_layer`). Compiled graphs trace the Python forward instead.
#include <ATen/ATen.h>

#include "ops.h"

namespace tokenmill {

at::Tensor BoundLinear::operator()(const at::Tensor& x) const {
  const at::Tensor y = product(x);
  return bias ? y + *bias : y;
}

at::Tensor decoder_layer(const at::Tensor& h, const DecoderLayerWeights& layer, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& context_slots, const at::Tensor& mask) {
  const at::Tensor qkv = layer.qkv(rms_norm(h, layer.attn_norm, layer.eps));
  const at::Tensor q = rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, layer.heads);
  const at::Tensor attended =
      decode_attention(q, k_cache, v_cache, context_slots, mask, layer.scale, layer.softcap, layer.sinks);
  const at::Tensor mid = h + layer.o(attended.reshape({h.size(0), -1}));
  const at::Tensor gate_up = layer.gate_up(rms_norm(mid, layer.ffn_norm, layer.eps));
  return mid + layer.down(gated_activation(gate_up, layer.activation));
}

}  // namespace tokenmill
