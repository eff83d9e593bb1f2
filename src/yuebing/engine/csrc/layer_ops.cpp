// The small per-layer ops of the decoder, fused: RMSNorm, residual add + RMSNorm, RoPE on q/k
// with the K/V cache write, and SiLU(gate)·up. Intermediate values are rounded through the
// element type exactly where the plain-torch path stores them in that type (bfloat16 / float16
// ops compute in float32 and round their result), so the fused ops reproduce the torch path's
// rounding steps; only reduction order (RMSNorm) and exp and 1/x (SiLU) differ.
#include <ATen/MemoryOverlap.h>

#include <type_traits>

#include "vec.h"

namespace yuebing {
namespace {

// Rows per parallel task: enough elements that a task outweighs the fork/join cost.
int64_t row_grain(int64_t row_elems) { return std::max<int64_t>(1, 16384 / row_elems); }

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, name,
              ": x must be a contiguous [rows, n] with n > 0, got ", x.sizes());
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(), name,
              ": weight must be a dense [", x.size(1), "], got ", w.sizes());
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), name, ": weight dtype ", w.scalar_type(),
              " != x dtype ", x.scalar_type());
}

template <typename T>
void rms_norm_impl(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> r(n);
    for (int64_t row = begin; row < end; ++row) {
      const T* src = x + row * n;
#ifdef __AVX512F__
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        _mm512_mask_storeu_ps(r.data() + i, m, load16(src + i, m));
      }
#else
      for (int64_t i = 0; i < n; ++i) r[i] = to_float(src[i]);
#endif
      normalize_row<T>(r.data(), w, out + row * n, n, eps);
    }
  });
}

template <typename T>
void fused_add_rms_norm_impl(T* x, T* res, const T* w, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    std::vector<float> r(n);
    for (int64_t row = begin; row < end; ++row) {
      T* xr = x + row * n;
      T* rr = res + row * n;
#ifdef __AVX512F__
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 sum = round16<T>(_mm512_add_ps(load16(xr + i, m), load16(rr + i, m)));
        store16(rr + i, sum, m);
        _mm512_mask_storeu_ps(r.data() + i, m, sum);
      }
#else
      for (int64_t i = 0; i < n; ++i) {
        const T sum = from_float<T>(to_float(xr[i]) + to_float(rr[i]));
        rr[i] = sum;
        r[i] = to_float(sum);
      }
#endif
      normalize_row<T>(r.data(), w, xr, n, eps);
    }
  });
}

struct RopeShape {
  int64_t tokens, heads, kv_heads, head_dim, row, positions, blocks, block_size;
};

template <typename T>
void rope_write_kv_impl(const RopeShape& s, T* qkv, const int64_t* pos, const T* cos,
                        const T* sin, T* kc, T* vc, const int64_t* slots) {
  const int64_t hd = s.head_dim, half = hd / 2;
  at::parallel_for(0, s.tokens, row_grain(s.row), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * s.row;
      const T* c = cos + pos[t] * half;
      const T* sn = sin + pos[t] * half;
      for (int64_t h = 0; h < s.heads; ++h) rotate<T>(row + h * hd, c, sn, row + h * hd, half);
      const int64_t blk = slots[t] / s.block_size, off = slots[t] % s.block_size;
      for (int64_t j = 0; j < s.kv_heads; ++j) {
        const int64_t dst = ((blk * s.kv_heads + j) * s.block_size + off) * hd;
        rotate<T>(row + (s.heads + j) * hd, c, sn, kc + dst, half);
        const T* v = row + (s.heads + s.kv_heads + j) * hd;
        std::copy(v, v + hd, vc + dst);
      }
    }
  });
}

void check_rope(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                const at::Tensor& sin, const at::Tensor& kc, const at::Tensor& vc,
                const at::Tensor& slots, int64_t heads, int64_t kv_heads) {
  TORCH_CHECK(heads > 0 && kv_heads > 0, "rope_write_kv: num_heads and num_kv_heads must be > 0");
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes() && kc.is_contiguous() &&
              vc.is_contiguous() && kc.numel() > 0, "rope_write_kv: caches must be non-empty "
              "contiguous [blocks, kv_heads, block_size, head_dim], got ", kc.sizes(), " and ",
              vc.sizes());
  const int64_t hd = kc.size(3);
  TORCH_CHECK(kc.size(1) == kv_heads, "rope_write_kv: cache has ", kc.size(1),
              " kv heads, expected ", kv_heads);
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (heads + 2 * kv_heads) * hd,
              "rope_write_kv: qkv must be a contiguous [tokens, ", (heads + 2 * kv_heads) * hd,
              "], got ", qkv.sizes());
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) * 2 == hd &&
              cos.is_contiguous() && sin.is_contiguous(),
              "rope_write_kv: cos/sin must be contiguous [positions, ", hd / 2, "]");
  for (const at::Tensor* t : {&cos, &sin, &kc, &vc})
    TORCH_CHECK(t->scalar_type() == qkv.scalar_type(),
                "rope_write_kv: cos, sin and the caches must have qkv's dtype");
  for (const at::Tensor* t : {&positions, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == qkv.size(0) &&
                t->is_contiguous(), "rope_write_kv: positions and slots must be dense int64 [",
                qkv.size(0), "]");
  const int64_t* p = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int64_t capacity = kc.size(0) * kc.size(2);
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    TORCH_CHECK(p[t] >= 0 && p[t] < cos.size(0), "rope_write_kv: position ", p[t],
                " outside the table of ", cos.size(0));
    TORCH_CHECK(sl[t] >= 0 && sl[t] < capacity, "rope_write_kv: slot ", sl[t],
                " outside the pool of ", capacity, " slots");
  }
}

template <typename T>
void silu_and_mul_impl(const T* x, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, row_grain(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * n;
      const T* up = gate + n;
      T* dst = out + r * n;
#ifdef __AVX512F__
      const __m512 one = _mm512_set1_ps(1.f);
      for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 g = load16(gate + i, m);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 act = round16<T>(_mm512_mul_ps(g, reciprocal16(_mm512_add_ps(one, e))));
        store16(dst + i, _mm512_mul_ps(act, load16(up + i, m)), m);
      }
#else
      int64_t i = 0;
#ifdef YB_VEC_AVX2
      if constexpr (std::is_same_v<T, float>) {  // float32 only: no rounding through T
        const __m256 one = _mm256_set1_ps(1.f);
        for (; i + 8 <= n; i += 8) {
          const __m256 g = _mm256_loadu_ps(gate + i);
          const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
          const __m256 act = _mm256_div_ps(g, _mm256_add_ps(one, e));
          _mm256_storeu_ps(dst + i, _mm256_mul_ps(act, _mm256_loadu_ps(up + i)));
        }
      }
#endif
      for (; i < n; ++i) {
        const float g = to_float(gate[i]);
        const float act = round_through<T>(g / (1.f + std::exp(-g)));
        dst[i] = from_float<T>(act * to_float(up[i]));
      }
#endif
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight, "rms_norm");
  at::Tensor out = at::empty_like(x);
  YB_DISPATCH_FLOAT(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(),
                            out.data_ptr<scalar_t>(), x.size(0), x.size(1),
                            static_cast<float>(eps));
  });
  return out;
}

void fused_add_rms_norm(at::Tensor& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps) {
  check_rows(x, weight, "fused_add_rms_norm");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.is_contiguous() &&
              residual.scalar_type() == x.scalar_type(),
              "fused_add_rms_norm: residual must be a contiguous tensor like x ", x.sizes());
  at::assert_no_overlap(x, residual);  // both are written: aliasing rows would feed each other
  YB_DISPATCH_FLOAT(x.scalar_type(), "fused_add_rms_norm", [&] {
    fused_add_rms_norm_impl<scalar_t>(x.data_ptr<scalar_t>(), residual.data_ptr<scalar_t>(),
                                      weight.data_ptr<scalar_t>(), x.size(0), x.size(1),
                                      static_cast<float>(eps));
  });
}

void rope_write_kv(at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                   const at::Tensor& sin, at::Tensor& k_cache, at::Tensor& v_cache,
                   const at::Tensor& slots, int64_t num_heads, int64_t num_kv_heads) {
  check_rope(qkv, positions, cos, sin, k_cache, v_cache, slots, num_heads, num_kv_heads);
  RopeShape s{qkv.size(0), num_heads, num_kv_heads, k_cache.size(3), qkv.size(1), cos.size(0),
              k_cache.size(0), k_cache.size(2)};
  YB_DISPATCH_FLOAT(qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write_kv_impl<scalar_t>(s, qkv.data_ptr<scalar_t>(), positions.data_ptr<int64_t>(),
                                 cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(),
                                 k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                                 slots.data_ptr<int64_t>());
  });
}

at::Tensor silu_and_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 2 == 0 && x.size(1) > 0,
              "silu_and_mul: x must be a contiguous [rows, 2·n] with n > 0, got ", x.sizes());
  const int64_t n = x.size(1) / 2;
  at::Tensor out = at::empty({x.size(0), n}, x.options());
  YB_DISPATCH_FLOAT(x.scalar_type(), "silu_and_mul", [&] {
    silu_and_mul_impl<scalar_t>(x.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), x.size(0), n);
  });
  return out;
}

}  // namespace yuebing
