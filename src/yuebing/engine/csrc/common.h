// Shared helpers of yuebing's native CPU kernels: float conversion of the supported element
// types (float32, bfloat16, float16) and a dispatch over them.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace yuebing {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}

// Rounds a float32 value through T and back (mimics torch storing an intermediate in T).
template <typename T>
inline float round_through(float x) {
  return to_float(from_float<T>(x));
}

// Calls the lambda with `scalar_t` bound to the C++ type of a float32/bfloat16/float16 dtype.
#define YB_DISPATCH_FLOAT(TYPE, NAME, ...)                                                 \
  [&] {                                                                                  \
    switch (TYPE) {                                                                      \
      case at::kFloat: {                                                                 \
        using scalar_t = float;                                                          \
        return __VA_ARGS__();                                                            \
      }                                                                                  \
      case at::kBFloat16: {                                                              \
        using scalar_t = c10::BFloat16;                                                  \
        return __VA_ARGS__();                                                            \
      }                                                                                  \
      case at::kHalf: {                                                                  \
        using scalar_t = c10::Half;                                                      \
        return __VA_ARGS__();                                                            \
      }                                                                                  \
      default:                                                                           \
        TORCH_CHECK(false, NAME, ": dtype ", TYPE, " unsupported (float32, bfloat16, "   \
                    "float16)");                                                         \
    }                                                                                    \
  }()

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
void rope_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads);
at::Tensor silu_and_mul(const at::Tensor& x);
at::Tensor flash_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_table,
                                   int64_t context_len, double scale);
at::Tensor flash_prefill_attention_amx(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& block_table,
                                       int64_t context_len, double scale);
bool amx_available();
at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t epilogue);
bool amx_linear_available();
bool fused_decode_available();
bool fused_decode_tiles();
at::Tensor decode_layer(const at::Tensor& x, at::Tensor& residual, const at::Tensor& ln1,
                        const at::Tensor& wqkv, const at::Tensor& wo, const at::Tensor& ln2,
                        const at::Tensor& wgu, const at::Tensor& wdown, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& positions,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                        const at::Tensor& block_table, const at::Tensor& context_lens,
                        int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                        bool first);
at::Tensor decode_logits(const at::Tensor& residual, const at::Tensor& x,
                         const at::Tensor& norm, const at::Tensor& weight, double eps);

}  // namespace yuebing
