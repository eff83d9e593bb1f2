// Registers yuebing's native CPU kernels as torch operators (torch.ops.yuebing.*).
#include <torch/library.h>

#include "common.h"

TORCH_LIBRARY(yuebing, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "Tensor context_lens, float scale) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("fused_add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps) -> ()");
  m.def("rope_write_kv(Tensor(a!) qkv, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, int num_heads, "
        "int num_kv_heads) -> ()");
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("flash_prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int context_len, float scale) -> Tensor");
  m.def("flash_prefill_attention_amx(Tensor q, Tensor k_cache, Tensor v_cache, "
        "Tensor block_table, int context_len, float scale) -> Tensor");
  m.def("amx_available() -> bool", &yuebing::amx_available);  // no tensors: a catch-all kernel
  m.def("fused_decode_available() -> bool", &yuebing::fused_decode_available);
  m.def("fused_decode_tiles() -> bool", &yuebing::fused_decode_tiles);
  m.def("amx_linear_available() -> bool", &yuebing::amx_linear_available);
  m.def("amx_linear(Tensor x, Tensor packed, Tensor? bias, int epilogue) -> Tensor");
  m.def("decode_layer(Tensor x, Tensor(a!) residual, Tensor ln1, Tensor wqkv, Tensor wo, "
        "Tensor ln2, Tensor wgu, Tensor wdown, Tensor cos, Tensor sin, Tensor positions, "
        "Tensor(b!) k_cache, Tensor(c!) v_cache, Tensor slots, Tensor block_table, "
        "Tensor context_lens, int num_heads, int num_kv_heads, float eps, float scale, "
        "bool first) -> Tensor");
  m.def("decode_logits(Tensor residual, Tensor x, Tensor norm, Tensor weight, float eps) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(yuebing, CPU, m) {
  m.impl("paged_decode_attention", &yuebing::paged_decode_attention);
  m.impl("rms_norm", &yuebing::rms_norm);
  m.impl("fused_add_rms_norm", &yuebing::fused_add_rms_norm);
  m.impl("rope_write_kv", &yuebing::rope_write_kv);
  m.impl("silu_and_mul", &yuebing::silu_and_mul);
  m.impl("flash_prefill_attention", &yuebing::flash_prefill_attention);
  m.impl("flash_prefill_attention_amx", &yuebing::flash_prefill_attention_amx);
  m.impl("decode_layer", &yuebing::decode_layer);
  m.impl("decode_logits", &yuebing::decode_logits);
  m.impl("amx_linear", &yuebing::amx_linear);
}
