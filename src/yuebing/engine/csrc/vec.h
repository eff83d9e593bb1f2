// Vector helpers for the kernels: row dot product, axpy, exp-and-sum, SiLU. With AVX-512 (the
// library is built with -march=native) rows whose length is a multiple of 16 use intrinsics
// (bfloat16 → float32 by a 16-bit shift, float16 by vcvtph2ps, exp by a Cephes polynomial and
// vscalefps); without it, on AVX2 + FMA (e.g. AMD Zen 3, whose engines run float32), the same in
// 8 lanes for multiples of 8 (`load8`, `exp8`); other lengths and CPUs use plain loops the
// compiler vectorizes where it can.
#pragma once

#include "common.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// -DYB_NO_VEC_AVX2 (through $YUEBING_KERNELS_CFLAGS) builds the plain loops instead, for A/Bs.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && \
    !defined(YB_NO_VEC_AVX2)
#define YB_VEC_AVX2 1
#endif

namespace yuebing {

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Masked loads of up to 16 elements as float32 lanes (masked-off lanes read 0).
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const c10::BFloat16* p, __mmask16 m) {
  const __m256i raw = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p, __mmask16 m) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

// float32 → bfloat16 bits, round to nearest even, NaN → 0x7fc0 (exactly c10::BFloat16's rule).
inline __m512i bf16_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                            _mm512_set1_epi32(0x7fc00000));
  return _mm512_srli_epi32(r, 16);
}

inline void store16(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
// With AVX512-BF16 one vcvtneps2bf16 rounds as bf16_bits does (nearest even), except that it
// reads float32 subnormals as zero and keeps a NaN's payload.
inline __m256i bf16_pack(__m512 v) {
#ifdef __AVX512BF16__
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#else
  return _mm512_cvtepi32_epi16(bf16_bits(v));
#endif
}
inline void store16(c10::BFloat16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, bf16_pack(v));
}
inline void store16(c10::Half* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The float32 value of v rounded through T (what storing in T and loading back gives).
inline __m512 round16(__m512 v, const float*) { return v; }
inline __m512 round16(__m512 v, const c10::BFloat16*) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_pack(v)), 16));
}
inline __m512 round16(__m512 v, const c10::Half*) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
template <typename T>
inline __m512 round16(__m512 v) {
  return round16(v, static_cast<const T*>(nullptr));
}

inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << left) - 1);
}

// exp(x) for float32 lanes, relative error ~2 ulp (Cephes expf polynomial), 0 below -88.
inline __m512 exp16(__m512 x) {
  // clamp with x second: max/min return the second operand when one is NaN, so NaN propagates
  x = _mm512_max_ps(_mm512_set1_ps(-88.0f), x);
  x = _mm512_min_ps(_mm512_set1_ps(88.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// 1/x for float32 lanes: the 14-bit estimate and one Newton step (within ~2 ulp of a division,
// at an eighth of its cost; finite non-zero x).
inline __m512 reciprocal16(__m512 x) {
  const __m512 r = _mm512_rcp14_ps(x);
  return _mm512_mul_ps(r, _mm512_fnmadd_ps(x, r, _mm512_set1_ps(2.0f)));
}

#ifdef __AVX512BF16__
// float32 lanes rounded through bf16 (nearest even) and back.
inline __m512 bf16_round(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v))), 16));
}

// silu(gate)·up of float32 matmul sums as `silu_and_mul` computes it on their bf16 outputs:
// gate and up rounded to bf16, the SiLU rounded to bf16 before the product; the product is
// returned in float32 (the caller rounds it as it stores).
inline __m512 silu_mul16(__m512 gate, __m512 up) {
  const __m512 g = bf16_round(gate), u = bf16_round(up);
  const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
  const __m512 act = bf16_round(_mm512_mul_ps(g, reciprocal16(_mm512_add_ps(_mm512_set1_ps(1.f), e))));
  return _mm512_mul_ps(act, u);
}
#endif
#endif

#ifdef YB_VEC_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// exp(x) for 8 float32 lanes: exp16's Cephes polynomial, 2^n built in the exponent bits
// (n in [-127, 127] after the clamp; 2^-127 reads as 0), 0 below -88, NaN propagated.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-88.0f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  // 2^n: n + 127 in [0, 254] is an exponent field (0: the value reads as 0)
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n),
                                                       _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif

// sum_i a[i]·b[i] in float32.
template <typename T>
inline float dot_row(const float* a, const T* b, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc);
    return _mm512_reduce_add_ps(acc);
  }
#elif defined(YB_VEC_AVX2)
  if (n % 8 == 0) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), load8(b + i), acc);
    return hsum8(acc);
  }
#endif
  float s = 0.f;
  for (int64_t i = 0; i < n; ++i) s = std::fma(a[i], to_float(b[i]), s);
  return s;
}

// acc[i] += w·x[i] in float32.
template <typename T>
inline void axpy_row(float w, const T* x, float* acc, int64_t n) {
#ifdef __AVX512F__
  if (n % 16 == 0) {
    const __m512 wv = _mm512_set1_ps(w);
    for (int64_t i = 0; i < n; i += 16)
      _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, load16(x + i), _mm512_loadu_ps(acc + i)));
    return;
  }
#elif defined(YB_VEC_AVX2)
  if (n % 8 == 0) {
    const __m256 wv = _mm256_set1_ps(w);
    for (int64_t i = 0; i < n; i += 8)
      _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, load8(x + i), _mm256_loadu_ps(acc + i)));
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) acc[i] = std::fma(w, to_float(x[i]), acc[i]);
}

// x[i] = exp(x[i] − sub); returns the sum of the new values.
inline float exp_sub_sum(float* x, int64_t n, float sub) {
  int64_t i = 0;
  float sum = 0.f;
#ifdef __AVX512F__
  const __m512 s = _mm512_set1_ps(sub);
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(x + i), s));
    _mm512_storeu_ps(x + i, e);
    acc = _mm512_add_ps(acc, e);
  }
  sum = _mm512_reduce_add_ps(acc);
#elif defined(YB_VEC_AVX2)
  const __m256 s = _mm256_set1_ps(sub);
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(x + i), s));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - sub);
    sum += x[i];
  }
  return sum;
}

inline float max_row(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// RMSNorm of one float32 row ``r`` into ``out``, scaled by ``w`` (used by layer_ops and
// decode_fused).
template <typename T>
inline void normalize_row(const float* r, const T* w, T* out, int64_t n, float eps) {
#ifdef __AVX512F__
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_maskz_loadu_ps(tail_mask(n - i), r + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  const __m512 inv = _mm512_set1_ps(
      1.f / std::sqrt(_mm512_reduce_add_ps(acc) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = tail_mask(n - i);
    const __m512 v = round16<T>(_mm512_mul_ps(_mm512_maskz_loadu_ps(m, r + i), inv));
    store16(out + i, _mm512_mul_ps(v, load16(w + i, m)), m);
  }
#else
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < n; ++i) ss += r[i] * r[i];
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) out[i] = from_float<T>(round_through<T>(r[i] * inv) * to_float(w[i]));
#endif
}

// Rotate-half RoPE of one head: y1 = x1·c − x2·s, y2 = x2·c + x1·s, each product and sum
// rounded through T as the torch path does.
template <typename T>
inline void rotate(const T* x, const T* c, const T* s, T* y, int64_t half) {
#ifdef __AVX512F__
  for (int64_t i = 0; i < half; i += 16) {
    const __mmask16 m = tail_mask(half - i);
    const __m512 x1 = load16(x + i, m), x2 = load16(x + i + half, m);
    const __m512 ci = load16(c + i, m), si = load16(s + i, m);
    const __m512 y1 = _mm512_sub_ps(round16<T>(_mm512_mul_ps(x1, ci)),
                                    round16<T>(_mm512_mul_ps(x2, si)));
    const __m512 y2 = _mm512_add_ps(round16<T>(_mm512_mul_ps(x2, ci)),
                                    round16<T>(_mm512_mul_ps(x1, si)));
    store16(y + i, y1, m);
    store16(y + i + half, y2, m);
  }
#else
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = to_float(x[i]), x2 = to_float(x[i + half]);
    const float ci = to_float(c[i]), si = to_float(s[i]);
    const T y1 = from_float<T>(round_through<T>(x1 * ci) - round_through<T>(x2 * si));
    const T y2 = from_float<T>(round_through<T>(x2 * ci) + round_through<T>(x1 * si));
    y[i] = y1;
    y[i + half] = y2;
  }
#endif
}

}  // namespace yuebing
