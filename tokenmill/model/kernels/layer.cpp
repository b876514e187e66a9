// One pre-norm decoder layer of an eager step in one call: norm, q/k/v projection, rope and cache
// write, attention, output projection and residual, then norm, gate/up projection, activation, down
// projection and residual; with norms of each q and k head before the rope (Gemma 3, Qwen3) and
// norms after the attention and the MLP (Gemma's sandwich norms) where the layer has them. These
// are the ops the layer's Python forward calls, with the same arguments and in the same order, so
// each token's result is the same bits either way. From Python, each op's call adds the forward's
// checks, attribute lookups and a binding's argument conversion: over the ten or so ops of each
// layer of a small model's decode step, a large share of the step (tuning log: `decoder_layer`).
// Compiled graphs trace the Python forward instead.
#include <ATen/core/Tensor.h>

#include "ops.h"

namespace tokenmill {

at::Tensor BoundLinear::operator()(const at::Tensor& x) const {
  const at::Tensor y = product(x);
  return bias ? y.add(*bias) : y;
}

at::Tensor decoder_layer(const at::Tensor& h, const DecoderLayerWeights& layer, const at::Tensor& cos,
                         const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                         const at::Tensor& slot_mapping, const at::Tensor& context_slots, const at::Tensor& mask) {
  const at::Tensor qkv = layer.qkv(rms_norm(h, layer.attn_norm, layer.eps));
  at::Tensor q;
  if (layer.q_norm) {  // q and k normed per head, then turned; the K/V written in the cache's dtype
    const int64_t tokens = h.size(0), kv_heads = k_cache.size(1), dim = k_cache.size(2);
    const auto parts = qkv.split_with_sizes({layer.heads * dim, kv_heads * dim, kv_heads * dim}, -1);
    q = rotary(rms_norm(parts[0].reshape({tokens, layer.heads, dim}), *layer.q_norm, layer.eps), cos, sin);
    const at::Tensor k = rotary(rms_norm(parts[1].reshape({tokens, kv_heads, dim}), *layer.k_norm, layer.eps), cos, sin);
    const at::Tensor v = parts[2].reshape({tokens, kv_heads, dim});
    k_cache.index_copy_(0, slot_mapping, k.to(k_cache.scalar_type()));
    v_cache.index_copy_(0, slot_mapping, v.to(v_cache.scalar_type()));
  } else {
    q = rotary_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, layer.heads);
  }
  const at::Tensor attended =
      decode_attention(q, k_cache, v_cache, context_slots, mask, layer.scale, layer.softcap, layer.sinks);
  at::Tensor a = layer.o(attended.reshape({h.size(0), -1}));
  if (layer.attn_post_norm) a = rms_norm(a, *layer.attn_post_norm, layer.eps);
  const at::Tensor mid = h.add(a);
  const at::Tensor gate_up = layer.gate_up(rms_norm(mid, layer.ffn_norm, layer.eps));
  at::Tensor m = layer.down(gated_activation(gate_up, layer.activation));
  if (layer.ffn_post_norm) m = rms_norm(m, *layer.ffn_post_norm, layer.eps);
  return mid.add(m);
}

}  // namespace tokenmill
