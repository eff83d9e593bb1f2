// Causal prefill attention on CPU, flash-attention style, reading K/V in place from the paged
// pool through the block table.
//
// q [n, heads, hd] holds one sequence's new chunk, whose tokens sit at positions
// [ctx - n, ctx) of a context of ctx tokens (cached prefix + the chunk); query token t sees keys
// 0 .. ctx - n + t. For each kv head the context's K and V are first packed into the pair-
// interleaved layout AVX512-BF16's dot-product instruction wants (zero-padded to whole chunks of
// kChunk keys). Tasks are (kv head, tile of kTile query tokens); a task's rows are the tile's
// tokens × the kv head's query group (GQA: K/V are read once for the whole group). For every
// chunk of keys a task computes the float32 scores of blocks of kRows rows (exact dot products of
// the bf16 inputs), masks the keys past each row's position, folds them into an online softmax
// (running max and sum per row), casts the probabilities to bf16 and accumulates P·V in float32.
// The output is normalised and cast to bf16 at the end. Tasks are scheduled dynamically (causal
// tiles differ in cost). Without AVX512-BF16 the same algorithm runs in portable C++.
// flash_prefill_attention_amx runs the score and P·V blocks on AMX tiles instead (built only
// where -march=native has AMX-BF16 and AVX512DQ, whose VREDUCEPS its exp2 uses; refused at run
// time where the kernel denies the tiles).
#include <atomic>
#include <memory>

#include "common.h"
#include "tiles.h"
#include "vec.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512DQ__)  // DQ: VREDUCEPS
#include <immintrin.h>
#define YB_FLASH_AVX512 1
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define YB_FLASH_AMX 1
#endif
#endif

namespace yuebing {
namespace {

constexpr int64_t kChunk = 64;  // keys per chunk (4 × 16 float lanes)
constexpr int64_t kTile = 32;   // query tokens per task
constexpr int64_t kRows = 4;    // rows per micro-kernel block

struct FlashShape {
  int64_t n, heads, hd, kv_heads, group, block_size, ctx, chunks, q_tok, q_head;
};

// Packs K and V of kv head `h` for context [0, ctx) into
//   kp[c][i][k][e] = K[c*kChunk + k][2i + e]   (pairs along head_dim, keys in lanes)
//   vp[c][m][d][e] = V[c*kChunk + 2m + e][d]   (pairs along keys, head_dim in lanes)
// with the padding keys past ctx (up to a whole chunk) zero. The buffers are not initialised.
// Only chunks [c0, c1) are written (the caller splits the work).
void pack_head(const FlashShape& s, const uint16_t* kc, const uint16_t* vc,
               const int64_t* table, int64_t h, int64_t c0, int64_t c1, uint16_t* kp,
               uint16_t* vp) {
  const int64_t hd = s.hd, head_stride = s.block_size * hd, block_stride = s.kv_heads * head_stride;
  const int64_t chunk_elems = kChunk * hd;
  const std::vector<uint16_t> zeros(hd, 0);
  for (int64_t t = c0 * kChunk; t < c1 * kChunk; ++t) {
    const uint16_t* k = zeros.data();
    const uint16_t* v = zeros.data();
    if (t < s.ctx) {
      const int64_t off = table[t / s.block_size] * block_stride + h * head_stride +
                          (t % s.block_size) * hd;
      k = kc + off;
      v = vc + off;
    }
    const int64_t c = t / kChunk, key = t % kChunk;
    uint16_t* kdst = kp + c * chunk_elems + key * 2;
    for (int64_t i = 0; i < hd / 2; ++i) {
      kdst[i * kChunk * 2] = k[2 * i];
      kdst[i * kChunk * 2 + 1] = k[2 * i + 1];
    }
    uint16_t* vdst = vp + c * chunk_elems + (key / 2) * hd * 2 + (key % 2);
    for (int64_t d = 0; d < hd; ++d) vdst[d * 2] = v[d];
  }
}

inline float bf16_to_float(uint16_t x) {
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even (as torch does)
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

#ifdef YB_FLASH_AVX512
// e^x for x <= 0 (the softmax argument); exactly 0 below -87 and for -inf; NaN stays NaN
// (VMAXPS returns its second operand when one is NaN, and an unordered compare keeps the lane).
inline __m512 exp_nonpositive(__m512 x) {
  const __mmask16 live = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
  x = _mm512_max_ps(_mm512_set1_ps(-87.0f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_mov_ps(live, _mm512_scalef_ps(p, n));
}

constexpr float kLazyMax = 8.f;
constexpr float kLog2e = 1.44269504088896341f;

// 2^y for the softmax argument y ≤ kLazyMax: y below -126 counts as -126 (p = 2^-126, nothing
// next to a row's sum ≥ 1; masked keys are zeroed by the caller); NaN stays NaN (VMAXPS returns
// its second operand when one is NaN). 2^f for f = y - floor(y) in [0, 1) (one VREDUCEPS) by a
// degree-4 polynomial fitted for relative error (< 3e-6, as the degree-5 Taylor series about 0
// it replaced, far below the bf16 rounding of the probabilities); VSCALEFPS multiplies by
// 2^floor(y) itself, so no separate rounding of y.
inline __m512 exp2_softmax(__m512 y) {
  y = _mm512_max_ps(_mm512_set1_ps(-126.f), y);
  const __m512 f = _mm512_reduce_ps(y, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.3534159400e-02f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.2011474967e-02f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4144275486e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9300383329e-01f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0000026226e+00f));
  return _mm512_scalef_ps(p, y);
}
#endif

struct RowState {
  float* o;    // [rows, hd] unnormalised output
  float* m;    // [rows] running max
  float* l;    // [rows] running sum
};

// Portable scores of rows [r0, r0 + kRows) against chunk c into sc[kRows][kChunk] (scaled,
// masked), and each row's max.
void block_scores_portable(const FlashShape& s, const uint16_t* const* qrow, const uint16_t* kpc,
                           const int64_t* limit, int64_t c, float scale, float* sc,
                           float* rowmax) {
  const int64_t pairs = s.hd / 2;
  for (int r = 0; r < kRows; ++r) {
    for (int64_t k = 0; k < kChunk; ++k) {
      float dot = 0.f;
      for (int64_t i = 0; i < pairs; ++i) {
        const uint16_t* kb = kpc + i * kChunk * 2 + k * 2;
        dot += bf16_to_float(qrow[r][2 * i]) * bf16_to_float(kb[0]);
        dot += bf16_to_float(qrow[r][2 * i + 1]) * bf16_to_float(kb[1]);
      }
      const bool visible = c * kChunk + k <= limit[r];
      sc[r * kChunk + k] = visible ? dot * scale : -std::numeric_limits<float>::infinity();
    }
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t k = 0; k < kChunk; ++k) {
      const float x = sc[r * kChunk + k];
      mx = std::isnan(x) || std::isnan(mx) ? std::numeric_limits<float>::quiet_NaN()
                                           : std::max(mx, x);
    }
    rowmax[r] = mx;
  }
}

#ifdef YB_FLASH_AVX512
// Scores of one row against the 64 keys of a chunk, kept in four registers by the caller.
struct Row4 {
  __m512 a0, a1, a2, a3;
};

inline void row_dot(Row4& acc, const uint16_t* q, int64_t i, __m512bh b0, __m512bh b1,
                    __m512bh b2, __m512bh b3) {
  const __m512bh a = (__m512bh)_mm512_set1_epi32(*reinterpret_cast<const int32_t*>(q + 2 * i));
  acc.a0 = _mm512_dpbf16_ps(acc.a0, a, b0);
  acc.a1 = _mm512_dpbf16_ps(acc.a1, a, b1);
  acc.a2 = _mm512_dpbf16_ps(acc.a2, a, b2);
  acc.a3 = _mm512_dpbf16_ps(acc.a3, a, b3);
}

inline float finish_row(const Row4& acc, int64_t first, int64_t limit, float scale, float* out) {
  const __m512 vscale = _mm512_set1_ps(scale);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 parts[4] = {acc.a0, acc.a1, acc.a2, acc.a3};
  __m512 vmax = neg_inf;
  __mmask16 nan = 0;
  for (int j = 0; j < 4; ++j) {
    __m512 v = _mm512_mul_ps(parts[j], vscale);
    const int64_t visible = limit - (first + j * 16) + 1;  // lanes [0, visible) are visible
    if (visible < 16) {
      const __mmask16 keep = _mm512_cmp_epi32_mask(
          lane, _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(visible, 0))),
          _MM_CMPINT_LT);
      v = _mm512_mask_mov_ps(neg_inf, keep, v);
    }
    vmax = _mm512_max_ps(vmax, v);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    _mm512_storeu_ps(out + j * 16, v);
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : _mm512_reduce_max_ps(vmax);
}

// Scores of 4 rows against chunk c (AVX512-BF16): 16 accumulators stay in registers.
void block_scores(const FlashShape& s, const uint16_t* const* qrow, const uint16_t* kpc,
                  const int64_t* limit, int64_t c, float scale, float* sc, float* rowmax) {
  Row4 r0{}, r1{}, r2{}, r3{};
  r0 = r1 = r2 = r3 = Row4{_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                           _mm512_setzero_ps()};
  const uint16_t *q0 = qrow[0], *q1 = qrow[1], *q2 = qrow[2], *q3 = qrow[3];
  for (int64_t i = 0; i < s.hd / 2; ++i) {
    const uint16_t* kb = kpc + i * kChunk * 2;
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(kb);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(kb + 32);
    const __m512bh b2 = (__m512bh)_mm512_loadu_si512(kb + 64);
    const __m512bh b3 = (__m512bh)_mm512_loadu_si512(kb + 96);
    row_dot(r0, q0, i, b0, b1, b2, b3);
    row_dot(r1, q1, i, b0, b1, b2, b3);
    row_dot(r2, q2, i, b0, b1, b2, b3);
    row_dot(r3, q3, i, b0, b1, b2, b3);
  }
  const int64_t first = c * kChunk;
  rowmax[0] = finish_row(r0, first, limit[0], scale, sc);
  rowmax[1] = finish_row(r1, first, limit[1], scale, sc + kChunk);
  rowmax[2] = finish_row(r2, first, limit[2], scale, sc + 2 * kChunk);
  rowmax[3] = finish_row(r3, first, limit[3], scale, sc + 3 * kChunk);
}
#endif

// Online-softmax update of rows [r0, r0 + kRows) with the scores `sc`; writes bf16
// probabilities to `pb[kRows][kChunk]` and rescales the rows' partial outputs.
// With `alphas`, the rows' rescale factors are written there instead of applied to the outputs.
void block_softmax(const FlashShape& s, float* sc, const float* rowmax, uint16_t* pb, RowState st,
                   int64_t r0, int nrows = kRows, float* alphas = nullptr) {
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < nrows; ++r) {
    float* row = sc + r * kChunk;
    const float mx = rowmax[r];
    const float m_old = st.m[r0 + r];
    const float m_new = std::isnan(mx) ? mx : std::max(m_old, mx);  // NaN (either) wins
    float* o = st.o + (r0 + r) * s.hd;
    if (m_new == neg_inf) {  // nothing visible yet in this row
      std::fill(pb + r * kChunk, pb + (r + 1) * kChunk, 0);
      if (alphas) alphas[r] = 1.f;
      continue;
    }
    const float alpha = m_old == neg_inf ? 0.f : std::exp(m_old - m_new);
    if (alphas) alphas[r] = alpha;
    float sum = 0.f;
#ifdef YB_FLASH_AVX512
    const __m512 vm = _mm512_set1_ps(m_new);
    __m512 vsum = _mm512_setzero_ps();
    for (int64_t k = 0; k < kChunk; k += 32) {
      __m512 p0 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + k), vm));
      __m512 p1 = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(row + k + 16), vm));
      vsum = _mm512_add_ps(vsum, _mm512_add_ps(p0, p1));
      __m512bh packed = _mm512_cvtne2ps_pbh(p1, p0);
      _mm512_storeu_si512(pb + r * kChunk + k, (__m512i)packed);
    }
    sum = _mm512_reduce_add_ps(vsum);
    if (alpha != 1.f && !alphas) {
      const __m512 va = _mm512_set1_ps(alpha);
      for (int64_t d = 0; d < s.hd; d += 16)
        _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), va));
    }
#else
    for (int64_t k = 0; k < kChunk; ++k) {
      const float p = row[k] == neg_inf ? 0.f : std::exp(row[k] - m_new);
      sum += p;
      pb[r * kChunk + k] = float_to_bf16(p);
    }
    if (!alphas)
      for (int64_t d = 0; d < s.hd; ++d) o[d] *= alpha;
#endif
    st.m[r0 + r] = m_new;
    st.l[r0 + r] = st.l[r0 + r] * alpha + sum;
  }
}

#ifdef YB_FLASH_AVX512
// Online softmax of rows [r0, r0 + kRows) for the AVX512-BF16 kernels, lazily as the AMX
// kernel's: scores and `rowmax` are in base-2 units (score · scale · log2 e), and a row keeps
// its reference max m while no score exceeds it by more than kLazyMax, so p = 2^(s - m) stays
// ≤ 2^8 and most chunks need no rescale of the row's output, no exponential of the reference's
// change and no horizontal sum: `lsum` holds 16 partial sums per row, added up at the end.
// Masked keys (score -inf) get p exactly 0; a NaN score makes the row NaN.
void block_softmax_lazy(const FlashShape& s, const float* sc, const float* rowmax,
                        const int64_t* limit, int64_t c, uint16_t* pb, RowState st, float* lsum,
                        int64_t r0) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int r = 0; r < kRows; ++r) {
    const float mx = rowmax[r];
    float m = st.m[r0 + r];
    float* ls = lsum + (r0 + r) * 16;
    if (mx == -std::numeric_limits<float>::infinity() && mx == m) {  // nothing visible yet
      std::fill(pb + r * kChunk, pb + (r + 1) * kChunk, 0);
      continue;
    }
    if (!(mx <= m + kLazyMax)) {  // a new reference (also for NaN, either side)
      if (m != -std::numeric_limits<float>::infinity()) {  // else the row's sums are still 0
        const __m512 va = _mm512_set1_ps(std::exp2(m - mx));
        float* o = st.o + (r0 + r) * s.hd;
        for (int64_t d = 0; d < s.hd; d += 16)
          _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), va));
        _mm512_storeu_ps(ls, _mm512_mul_ps(_mm512_loadu_ps(ls), va));
      }
      st.m[r0 + r] = m = mx;
    }
    const __m512 vm = _mm512_set1_ps(m);
    const bool masked = limit[r] - c * kChunk + 1 < kChunk;
    const float* row = sc + r * kChunk;
    __m512 sum = _mm512_loadu_ps(ls);
    for (int64_t k = 0; k < kChunk; k += 32) {
      const __m512 s0 = _mm512_loadu_ps(row + k), s1 = _mm512_loadu_ps(row + k + 16);
      __m512 p0 = exp2_softmax(_mm512_sub_ps(s0, vm)), p1 = exp2_softmax(_mm512_sub_ps(s1, vm));
      if (masked) {
        p0 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s0, neg_inf, _CMP_NEQ_UQ), p0);
        p1 = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s1, neg_inf, _CMP_NEQ_UQ), p1);
      }
      sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
      _mm512_storeu_si512(pb + r * kChunk + k, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
    }
    _mm512_storeu_ps(ls, sum);
  }
}
#endif

// Portable o[r0 + r] += P[r] · V_chunk for the kRows rows.
void block_pv_portable(const FlashShape& s, const uint16_t* pb, const uint16_t* vpc, RowState st,
                       int64_t r0) {
  const int64_t hd = s.hd;
  for (int r = 0; r < kRows; ++r) {
    float* o = st.o + (r0 + r) * hd;
    for (int64_t k = 0; k < kChunk; ++k) {
      const float p = bf16_to_float(pb[r * kChunk + k]);  // 0·NaN = NaN, as in a matmul
      const uint16_t* vrow = vpc + (k / 2) * hd * 2 + (k % 2);
      for (int64_t d = 0; d < hd; ++d) o[d] += p * bf16_to_float(vrow[d * 2]);
    }
  }
}

#ifdef YB_FLASH_AVX512
// o[r0 + r] += P[r] · V_chunk for 4 rows, 64 output columns at a time (AVX512-BF16).
void block_pv(const FlashShape& s, const uint16_t* pb, const uint16_t* vpc, RowState st,
              int64_t r0) {
  const int64_t hd = s.hd;
  const int32_t* p32 = reinterpret_cast<const int32_t*>(pb);  // bf16 pairs of keys
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    Row4 o[4];
    for (int r = 0; r < 4; ++r) {
      const float* src = st.o + (r0 + r) * hd + d0;
      o[r] = Row4{_mm512_loadu_ps(src), _mm512_loadu_ps(src + 16), _mm512_loadu_ps(src + 32),
                  _mm512_loadu_ps(src + 48)};
    }
    Row4 x0 = o[0], x1 = o[1], x2 = o[2], x3 = o[3];
    for (int64_t m = 0; m < kChunk / 2; ++m) {
      const uint16_t* vb = vpc + m * hd * 2 + d0 * 2;
      const __m512bh b0 = (__m512bh)_mm512_loadu_si512(vb);
      const __m512bh b1 = (__m512bh)_mm512_loadu_si512(vb + 32);
      const __m512bh b2 = (__m512bh)_mm512_loadu_si512(vb + 64);
      const __m512bh b3 = (__m512bh)_mm512_loadu_si512(vb + 96);
      row_dot(x0, reinterpret_cast<const uint16_t*>(p32 + 0 * kChunk / 2), m, b0, b1, b2, b3);
      row_dot(x1, reinterpret_cast<const uint16_t*>(p32 + 1 * kChunk / 2), m, b0, b1, b2, b3);
      row_dot(x2, reinterpret_cast<const uint16_t*>(p32 + 2 * kChunk / 2), m, b0, b1, b2, b3);
      row_dot(x3, reinterpret_cast<const uint16_t*>(p32 + 3 * kChunk / 2), m, b0, b1, b2, b3);
    }
    const Row4 res[4] = {x0, x1, x2, x3};
    for (int r = 0; r < 4; ++r) {
      float* dst = st.o + (r0 + r) * hd + d0;
      _mm512_storeu_ps(dst, res[r].a0);
      _mm512_storeu_ps(dst + 16, res[r].a1);
      _mm512_storeu_ps(dst + 32, res[r].a2);
      _mm512_storeu_ps(dst + 48, res[r].a3);
    }
  }
}
#endif

// One task: kv head h, query tokens [t0, t1).
void flash_task(const FlashShape& s, const uint16_t* q, const uint16_t* kp, const uint16_t* vp,
                int64_t h, int64_t t0, int64_t t1, float scale, uint16_t* out) {
  const int64_t g = s.group, rows = (t1 - t0) * g, hd = s.hd, offset = s.ctx - s.n;
  const int64_t padded = (rows + kRows - 1) / kRows * kRows;
  std::vector<float> o(padded * hd, 0.f), m(padded, -std::numeric_limits<float>::infinity()),
      l(padded, 0.f), sc(kRows * kChunk), rowmax(kRows);
  std::vector<uint16_t> pb(kRows * kChunk);
  RowState st{o.data(), m.data(), l.data()};
  const int64_t last_chunk = (offset + t1 - 1) / kChunk;
  const int64_t chunk_elems = kChunk * hd;
#ifdef YB_FLASH_AVX512
  const bool fast = hd % 64 == 0;  // the AVX512-BF16 kernels take 64 columns at a time
  std::vector<float> lsum(fast ? padded * 16 : 0, 0.f);
#else
  [[maybe_unused]] const bool fast = false;
#endif
  for (int64_t c = 0; c <= last_chunk; ++c) {
    for (int64_t r0 = 0; r0 < padded; r0 += kRows) {
      const uint16_t* qrow[kRows];
      int64_t limit[kRows];
      for (int r = 0; r < kRows; ++r) {
        const int64_t row = std::min(r0 + r, rows - 1);  // padding rows repeat the last row
        const int64_t t = t0 + row / g;
        qrow[r] = q + t * s.q_tok + (h * g + row % g) * s.q_head;
        limit[r] = offset + t;  // last visible key
      }
      if (c * kChunk > limit[0] && c * kChunk > limit[kRows - 1]) continue;  // all hidden
#ifdef YB_FLASH_AVX512
      if (fast) {
        block_scores(s, qrow, kp + c * chunk_elems, limit, c, scale * kLog2e, sc.data(),
                     rowmax.data());
        block_softmax_lazy(s, sc.data(), rowmax.data(), limit, c, pb.data(), st, lsum.data(),
                           r0);
      } else
#endif
      {
        block_scores_portable(s, qrow, kp + c * chunk_elems, limit, c, scale, sc.data(),
                              rowmax.data());
        block_softmax(s, sc.data(), rowmax.data(), pb.data(), st, r0);
      }
#ifdef YB_FLASH_AVX512
      if (fast)
        block_pv(s, pb.data(), vp + c * chunk_elems, st, r0);
      else
#endif
        block_pv_portable(s, pb.data(), vp + c * chunk_elems, st, r0);
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = t0 + row / g;
    uint16_t* dst = out + t * s.heads * hd + (h * g + row % g) * hd;
#ifdef YB_FLASH_AVX512
    if (fast) l[row] = _mm512_reduce_add_ps(_mm512_loadu_ps(lsum.data() + row * 16));
#endif
    const float inv = 1.f / l[row];
    for (int64_t d = 0; d < hd; ++d) dst[d] = float_to_bf16(o[row * hd + d] * inv);
  }
}

#ifdef YB_FLASH_AMX
// AMX tiles: blocks of 16 rows. tmm0 holds A (16 rows × 32 bf16: Q or P), tmm1 B (16 bf16 pairs ×
// 16 columns: K or V as packed by pack_head), tmm2..5 the four 16 × 16 float32 C tiles of a block
// (64 keys of scores, or 64 output columns). TDPBF16PS sums exact bf16 products in float32.
constexpr int64_t kAmxRows = 16;

void amx_configure() {
  TileConfig cfg;
  set_tiles(cfg, {0, 1, 2, 3, 4, 5, 6, 7}, 16);
  load_tile_config(cfg);
}

// The calling thread's tiles, configured for its scope and released on every way out of it
// (a return or an exception), so no thread of torch's pool keeps the tile state.
class AmxScope {
 public:
  explicit AmxScope(bool on) : on_(on) {
    if (on_) amx_configure();
  }
  ~AmxScope() {
    if (on_) _tile_release();
  }
  AmxScope(const AmxScope&) = delete;
  AmxScope& operator=(const AmxScope&) = delete;

 private:
  bool on_;
};

// sc[16][kChunk] = qb[16][hd] · K chunkᵀ (raw float32 dot products).
inline void amx_scores(const uint16_t* qb, const uint16_t* kpc, int64_t hd, float* sc) {
  _tile_zero(2);
  _tile_zero(3);
  _tile_zero(4);
  _tile_zero(5);
  for (int64_t k0 = 0; k0 < hd; k0 += 32) {
    _tile_loadd(0, qb + k0, hd * 2);
    const uint16_t* kb = kpc + (k0 / 2) * kChunk * 2;  // pairs k0/2 .. k0/2 + 15
    _tile_loadd(1, kb, kChunk * 4);
    _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(1, kb + 32, kChunk * 4);
    _tile_dpbf16ps(3, 0, 1);
    _tile_loadd(1, kb + 64, kChunk * 4);
    _tile_dpbf16ps(4, 0, 1);
    _tile_loadd(1, kb + 96, kChunk * 4);
    _tile_dpbf16ps(5, 0, 1);
  }
  _tile_stored(2, sc, kChunk * 4);
  _tile_stored(3, sc + 16, kChunk * 4);
  _tile_stored(4, sc + 32, kChunk * 4);
  _tile_stored(5, sc + 48, kChunk * 4);
}

// pv[16][hd] = pb[16][kChunk] · V chunk (fresh C tiles: loading them from outputs the vector
// code has just rescaled would stall on store forwarding).
inline void amx_pv(const uint16_t* pb, const uint16_t* vpc, int64_t hd, float* pv) {
  for (int64_t d0 = 0; d0 < hd; d0 += 64) {
    _tile_zero(2);
    _tile_zero(3);
    _tile_zero(4);
    _tile_zero(5);
    for (int64_t k0 = 0; k0 < kChunk; k0 += 32) {
      _tile_loadd(0, pb + k0, kChunk * 2);
      const uint16_t* vb = vpc + (k0 / 2) * hd * 2 + d0 * 2;  // key pairs k0/2 .. k0/2 + 15
      _tile_loadd(1, vb, hd * 4);
      _tile_dpbf16ps(2, 0, 1);
      _tile_loadd(1, vb + 32, hd * 4);
      _tile_dpbf16ps(3, 0, 1);
      _tile_loadd(1, vb + 64, hd * 4);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(1, vb + 96, hd * 4);
      _tile_dpbf16ps(5, 0, 1);
    }
    _tile_stored(2, pv + d0, hd * 4);
    _tile_stored(3, pv + d0 + 16, hd * 4);
    _tile_stored(4, pv + d0 + 32, hd * 4);
    _tile_stored(5, pv + d0 + 48, hd * 4);
  }
}

// o = o·alpha + pv for 16 rows of hd (a multiple of 16) columns.
inline void rescale_add(float* o, const float* pv, const float* alphas, int64_t hd) {
  for (int64_t r = 0; r < kAmxRows; ++r) {
    const __m512 va = _mm512_set1_ps(alphas[r]);
    float* dst = o + r * hd;
    const float* src = pv + r * hd;
    for (int64_t d = 0; d < hd; d += 16)
      _mm512_storeu_ps(dst + d, _mm512_fmadd_ps(_mm512_loadu_ps(dst + d), va,
                                                _mm512_loadu_ps(src + d)));
  }
}

// flash_task with AMX tiles (head_dim a multiple of 64): the task's query rows are first copied
// into one contiguous buffer (tiles load rows at a fixed stride), then each block of 16 rows
// walks the chunks it can see; scale, mask and online softmax as in the AVX512-BF16 kernel.
void flash_task_amx(const FlashShape& s, const uint16_t* q, const uint16_t* kp, const uint16_t* vp,
                    int64_t h, int64_t t0, int64_t t1, float scale, uint16_t* out) {
  const int64_t g = s.group, rows = (t1 - t0) * g, hd = s.hd, offset = s.ctx - s.n;
  const int64_t padded = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
  std::vector<uint16_t> qb(padded * hd), pb(2 * kAmxRows * kChunk);
  std::vector<float> o(padded * hd, 0.f), m(padded, -std::numeric_limits<float>::infinity()),
      l(padded, 0.f), sc(2 * kAmxRows * kChunk), rowmax(kAmxRows), alphas(2 * kAmxRows),
      pv(2 * kAmxRows * hd);
  std::vector<int64_t> limit(padded);
  for (int64_t row = 0; row < padded; ++row) {
    const int64_t src = std::min(row, rows - 1);  // padding rows repeat the last row
    const int64_t t = t0 + src / g;
    std::memcpy(qb.data() + row * hd, q + t * s.q_tok + (h * g + src % g) * s.q_head, hd * 2);
    limit[row] = offset + t;  // last visible key
  }
  RowState st{o.data(), m.data(), l.data()};
  const int64_t chunk_elems = kChunk * hd;
  // two blocks of 16 rows at a time, each phase run for both before the next: a tile load of
  // what the vector code has just stored (scores → probabilities → P·V) waits for the stores
  // to reach the cache, and the other block's work fills that wait
  for (int64_t r0 = 0; r0 < padded; r0 += 2 * kAmxRows) {
    const int nb = padded - r0 > kAmxRows ? 2 : 1;
    int64_t last[2] = {0, 0};
    for (int b = 0; b < nb; ++b)  // rows ascend in position: a block's last row sees most
      last[b] = limit[r0 + b * kAmxRows + kAmxRows - 1] / kChunk;
    for (int64_t c = 0; c <= last[nb - 1]; ++c) {
      const int b0 = c <= last[0] ? 0 : 1;  // blocks still seeing chunk c: [b0, nb)
      for (int b = b0; b < nb; ++b)
        amx_scores(qb.data() + (r0 + b * kAmxRows) * hd, kp + c * chunk_elems, hd,
                   sc.data() + b * kAmxRows * kChunk);
      for (int b = b0; b < nb; ++b) {
        float* scb = sc.data() + b * kAmxRows * kChunk;
        const int64_t rb = r0 + b * kAmxRows;
        for (int64_t r = 0; r < kAmxRows; ++r) {
          float* row = scb + r * kChunk;
          const Row4 acc{_mm512_loadu_ps(row), _mm512_loadu_ps(row + 16),
                         _mm512_loadu_ps(row + 32), _mm512_loadu_ps(row + 48)};
          rowmax[r] = finish_row(acc, c * kChunk, limit[rb + r], scale, row);
        }
        block_softmax(s, scb, rowmax.data(), pb.data() + b * kAmxRows * kChunk, st, rb,
                      kAmxRows, alphas.data() + b * kAmxRows);
      }
      for (int b = b0; b < nb; ++b)
        amx_pv(pb.data() + b * kAmxRows * kChunk, vp + c * chunk_elems, hd,
               pv.data() + b * kAmxRows * hd);
      for (int b = b0; b < nb; ++b)
        rescale_add(o.data() + (r0 + b * kAmxRows) * hd, pv.data() + b * kAmxRows * hd,
                    alphas.data() + b * kAmxRows, hd);
    }
  }
  for (int64_t row = 0; row < rows; ++row) {
    const int64_t t = t0 + row / g;
    uint16_t* dst = out + t * s.heads * hd + (h * g + row % g) * hd;
    const float inv = 1.f / l[row];
    for (int64_t d = 0; d < hd; ++d) dst[d] = float_to_bf16(o[row * hd + d] * inv);
  }
}

// head_dim 64 (SmolLM2, Llama 3.2 1B...): the 16 × 64 float32 output of a block of 16 rows
// stays in tmm4..7 across the whole context; keys go 32 at a time (scores in tmm2..3). The
// tiles run two steps ahead of the vectors: while the softmax of step j+1 runs, the tiles
// compute the scores of step j+2 and P·V of step j (a tile load of just-stored data, or a
// vector load of just-stored tiles, waits for the stores; each side reads what the other
// stored one step earlier, so neither waits). That tile work goes in four pieces, one before
// every fourth softmax row (TileStep): issued as one sequence, the tile loads and products sat
// ahead of ~500 vector instructions and the out-of-order window could not overlap the two
// (20 % more time per call at 512-2,048 tokens). The softmax keeps a per-row reference
// max m and rescales (tiles out, rows scaled, tiles in) only when a score exceeds m + 8: the
// probabilities stay ≤ 2^8 (bf16 keeps its relative precision at any magnitude), and the sum
// uses the same reference, so the normalised result is the same function. Scores and m are in
// base-2 units (raw score · scale · log2 e, one FMA with the subtraction): p = 2^(s - m).
inline const uint16_t* k_step(const uint16_t* kp, int64_t step) {  // keys step·32 .. + 31
  return kp + (step / 2) * kChunk * 64 + (step % 2) * 64;
}
inline const uint16_t* v_step(const uint16_t* vp, int64_t step) {
  return vp + (step / 2) * kChunk * 64 + (step % 2) * 16 * 64 * 2;
}

// sc[16][32] = qb[16][64] · K of step `step`ᵀ.
inline void amx_scores32(const uint16_t* qb, const uint16_t* kp, int64_t step, float* sc) {
  const uint16_t* kpc = k_step(kp, step);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t k0 = 0; k0 < 64; k0 += 32) {
    _tile_loadd(0, qb + k0, 128);
    const uint16_t* kb = kpc + (k0 / 2) * kChunk * 2;
    _tile_loadd(1, kb, kChunk * 4);
    _tile_dpbf16ps(2, 0, 1);
    _tile_loadd(1, kb + 32, kChunk * 4);
    _tile_dpbf16ps(3, 0, 1);
  }
  _tile_stored(2, sc, 128);
  _tile_stored(3, sc + 16, 128);
}

// The tile work of one pipelined step: scores of step `ss` into sc (when kb is set) and P·V of
// step `ps` (when vb is set), cut into four pieces that the softmax issues between its rows, so
// tile and vector instructions sit close together in the out-of-order window and overlap. Each
// score tile sums two products (head_dim 0..31, then 32..63), the second waiting for the first:
// P·V products run between them, so the tile unit does not idle on that wait.
struct TileStep {
  const uint16_t* qb;
  const uint16_t* kb;  // K of the score step, or null
  float* sc;
  const uint16_t* pb;
  const uint16_t* vb;  // V of the P·V step, or null

  inline void piece(int64_t i) const {
    switch (i) {
      case 0:
        if (!kb) return;
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(0, qb, 128);
        _tile_loadd(1, kb, kChunk * 4);
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(1, kb + 32, kChunk * 4);
        _tile_dpbf16ps(3, 0, 1);
        return;
      case 1:
        if (!vb) return;
        _tile_loadd(0, pb, 64);
        _tile_loadd(1, vb, 256);
        _tile_dpbf16ps(4, 0, 1);
        _tile_loadd(1, vb + 32, 256);
        _tile_dpbf16ps(5, 0, 1);
        return;
      case 2:
        if (!kb) return;
        _tile_loadd(0, qb + 32, 128);
        _tile_loadd(1, kb + 16 * kChunk * 2, kChunk * 4);  // pairs 16 .. 31 of head_dim
        _tile_dpbf16ps(2, 0, 1);
        _tile_loadd(1, kb + 16 * kChunk * 2 + 32, kChunk * 4);
        _tile_dpbf16ps(3, 0, 1);
        _tile_stored(2, sc, 128);
        _tile_stored(3, sc + 16, 128);
        return;
      default:
        if (!vb) return;
        _tile_loadd(0, pb, 64);
        _tile_loadd(1, vb + 64, 256);
        _tile_dpbf16ps(6, 0, 1);
        _tile_loadd(1, vb + 96, 256);
        _tile_dpbf16ps(7, 0, 1);
        return;
    }
  }
};

struct LazyRows {
  float m[kAmxRows];             // reference max per row (-inf: nothing visible yet)
  float alpha[kAmxRows];         // rescale factor of the outputs this step (1: none)
  alignas(64) float lsum[kAmxRows * 16];  // per-row running sums, 16 lanes each
};

// Probabilities of step `step` (keys step·32 ..) for 16 rows from raw scores sc[16][32] into
// pb[16][32] bf16 (`scale2`: the softmax scale · log2 e); returns whether any row's outputs must
// be rescaled by rows.alpha.
inline bool lazy_softmax(const float* sc, const int64_t* limit, int64_t step, float scale2,
                         LazyRows& rows, uint16_t* pb, const TileStep& tiles) {
  const __m512 vscale = _mm512_set1_ps(scale2), neg_inf = _mm512_set1_ps(-INFINITY);
  const __m512 lazy = _mm512_set1_ps(kLazyMax);
  const int64_t first = step * 32;
  bool rescale = false;
  for (int64_t r = 0; r < kAmxRows; ++r) {
    if (r % 4 == 0) tiles.piece(r / 4);
    float m = rows.m[r];
    __m512 vm = _mm512_set1_ps(m);
    const __m512 s0 = _mm512_loadu_ps(sc + r * 32), s1 = _mm512_loadu_ps(sc + r * 32 + 16);
    __m512 y0 = _mm512_fmsub_ps(s0, vscale, vm), y1 = _mm512_fmsub_ps(s1, vscale, vm);
    const int64_t visible = limit[r] - first + 1;  // keys [0, visible) of the step are visible
    __mmask16 k0 = 0xFFFF, k1 = 0xFFFF;
    if (visible < 32) {
      k0 = visible >= 16 ? 0xFFFF : visible <= 0 ? 0 : static_cast<__mmask16>((1u << visible) - 1);
      k1 = visible <= 16 ? 0 : static_cast<__mmask16>((1u << (visible - 16)) - 1);
      y0 = _mm512_mask_mov_ps(neg_inf, k0, y0);
      y1 = _mm512_mask_mov_ps(neg_inf, k1, y1);
    }
    rows.alpha[r] = 1.f;
    // above the reference by more than kLazyMax, or NaN (either operand): a new reference
    if (_mm512_cmp_ps_mask(y0, lazy, _CMP_NLE_UQ) | _mm512_cmp_ps_mask(y1, lazy, _CMP_NLE_UQ)) {
      const __m512 x0 = _mm512_mask_mov_ps(neg_inf, k0, _mm512_mul_ps(s0, vscale));
      const __m512 x1 = _mm512_mask_mov_ps(neg_inf, k1, _mm512_mul_ps(s1, vscale));
      const __mmask16 nan = _mm512_cmp_ps_mask(x0, x0, _CMP_UNORD_Q) |
                            _mm512_cmp_ps_mask(x1, x1, _CMP_UNORD_Q);
      const float mx = nan || std::isnan(m) ? NAN
                                            : std::max(m, _mm512_reduce_max_ps(_mm512_max_ps(x0, x1)));
      const float alpha = m == -INFINITY ? 0.f : std::exp2(m - mx);  // NaN stays NaN
      if (m != -INFINITY) {  // outputs of a row that saw nothing yet are 0 already
        rows.alpha[r] = alpha;
        rescale = true;
      }
      float* ls = rows.lsum + r * 16;
      _mm512_storeu_ps(ls, _mm512_mul_ps(_mm512_loadu_ps(ls), _mm512_set1_ps(alpha)));
      rows.m[r] = m = mx;
      vm = _mm512_set1_ps(m);
      y0 = _mm512_sub_ps(x0, vm);
      y1 = _mm512_sub_ps(x1, vm);
    }
    __m512 p0 = exp2_softmax(y0), p1 = exp2_softmax(y1);  // ≤ 2^8: exact enough
    if (visible < 32) {  // masked keys: exactly 0
      p0 = _mm512_maskz_mov_ps(k0, p0);
      p1 = _mm512_maskz_mov_ps(k1, p1);
    }
    float* ls = rows.lsum + r * 16;
    _mm512_storeu_ps(ls, _mm512_add_ps(_mm512_loadu_ps(ls), _mm512_add_ps(p0, p1)));
    _mm512_storeu_si512(pb + r * 32, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
  }
  return rescale;
}

void flash_task_amx64(const FlashShape& s, const uint16_t* q, const uint16_t* kp,
                      const uint16_t* vp, int64_t h, int64_t t0, int64_t t1, float scale,
                      uint16_t* out) {
  const int64_t g = s.group, rows = (t1 - t0) * g, hd = 64, offset = s.ctx - s.n;
  const int64_t padded = (rows + kAmxRows - 1) / kAmxRows * kAmxRows;
  const float scale2 = scale * kLog2e;
  std::vector<uint16_t> qb(padded * hd);
  std::vector<int64_t> limit(padded);
  for (int64_t row = 0; row < padded; ++row) {
    const int64_t src = std::min(row, rows - 1);  // padding rows repeat the last row
    const int64_t t = t0 + src / g;
    std::memcpy(qb.data() + row * hd, q + t * s.q_tok + (h * g + src % g) * s.q_head, hd * 2);
    limit[row] = offset + t;  // last visible key
  }
  alignas(64) float sc[2][kAmxRows * 32], ob[kAmxRows * 64];
  alignas(64) uint16_t pb[2][kAmxRows * 32];
  LazyRows lr;
  for (int64_t r0 = 0; r0 < padded; r0 += kAmxRows) {
    const uint16_t* qr = qb.data() + r0 * hd;
    const int64_t* lim = limit.data() + r0;
    const int64_t steps = lim[kAmxRows - 1] / 32 + 1;  // rows ascend in position
    std::fill(lr.m, lr.m + kAmxRows, -INFINITY);
    std::fill(lr.lsum, lr.lsum + kAmxRows * 16, 0.f);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    amx_scores32(qr, kp, 0, sc[0]);
    if (steps > 1) amx_scores32(qr, kp, 1, sc[1]);
    const TileStep none{qr, nullptr, nullptr, nullptr, nullptr};
    lazy_softmax(sc[0], lim, 0, scale2, lr, pb[0], none);  // outputs are 0: nothing to rescale
    for (int64_t j = 0; j < steps; ++j) {
      // tiles of step j + 2 and j, vectors of step j + 1: independent, so they overlap (the
      // tile work is issued in pieces between the softmax's rows)
      const TileStep tiles{qr, j + 2 < steps ? k_step(kp, j + 2) : nullptr, sc[j % 2], pb[j % 2],
                           v_step(vp, j)};
      if (j + 1 == steps) {
        for (int64_t i = 0; i < 4; ++i) tiles.piece(i);
      } else if (lazy_softmax(sc[(j + 1) % 2], lim, j + 1, scale2, lr, pb[(j + 1) % 2], tiles)) {
        _tile_stored(4, ob, 256);
        _tile_stored(5, ob + 16, 256);
        _tile_stored(6, ob + 32, 256);
        _tile_stored(7, ob + 48, 256);
        for (int64_t r = 0; r < kAmxRows; ++r) {
          if (lr.alpha[r] == 1.f) continue;
          const __m512 va = _mm512_set1_ps(lr.alpha[r]);
          for (int64_t d = 0; d < 64; d += 16)
            _mm512_storeu_ps(ob + r * 64 + d, _mm512_mul_ps(_mm512_loadu_ps(ob + r * 64 + d), va));
        }
        _tile_loadd(4, ob, 256);
        _tile_loadd(5, ob + 16, 256);
        _tile_loadd(6, ob + 32, 256);
        _tile_loadd(7, ob + 48, 256);
      }
    }
    _tile_stored(4, ob, 256);
    _tile_stored(5, ob + 16, 256);
    _tile_stored(6, ob + 32, 256);
    _tile_stored(7, ob + 48, 256);
    for (int64_t r = 0; r < kAmxRows && r0 + r < rows; ++r) {
      const int64_t row = r0 + r, t = t0 + row / g;
      uint16_t* dst = out + t * s.heads * hd + (h * g + row % g) * hd;
      const __m512 inv = _mm512_set1_ps(1.f / _mm512_reduce_add_ps(_mm512_loadu_ps(lr.lsum + r * 16)));
      for (int64_t d = 0; d < 64; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + d),
                            _mm512_cvtepi32_epi16(bf16_bits(_mm512_mul_ps(_mm512_loadu_ps(ob + r * 64 + d), inv))));
    }
  }
}
#endif

// Whether this process may use AMX tiles: built for a CPU with AMX-BF16 and granted the tile
// state by the kernel (arch_prctl ARCH_REQ_XCOMP_PERM; fails on CPUs without AMX). Asked once.
bool amx_usable() {
#ifdef YB_FLASH_AMX
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// Validates the operands (every block id the context uses must lie in the pool) and returns
// the shape; bad input raises with a message naming the operand.
FlashShape check_flash_inputs(const at::Tensor& q, const at::Tensor& k_cache,
                              const at::Tensor& v_cache, const at::Tensor& block_table,
                              int64_t context_len) {
  const char* op = "flash_prefill_attention: ";
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, op,
              "q must be [n, heads, head_dim] with contiguous rows");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k_cache.scalar_type() == at::kBFloat16 &&
                  v_cache.scalar_type() == at::kBFloat16,
              op, "bfloat16 q / k_cache / v_cache required");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.sizes() == v_cache.sizes(),
              op, "k_cache / v_cache must be contiguous [blocks, kv_heads, block_size, "
              "head_dim] of one shape");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.dim() == 1 &&
                  block_table.is_contiguous(),
              op, "block_table must be a contiguous int64 vector");
  FlashShape s{};
  s.n = q.size(0);
  s.heads = q.size(1);
  s.hd = q.size(2);
  s.kv_heads = k_cache.size(1);
  s.block_size = k_cache.size(2);
  s.ctx = context_len;
  TORCH_CHECK(s.kv_heads > 0 && s.block_size > 0 && s.hd > 0 && s.heads > 0, op,
              "empty heads, kv_heads, block_size or head_dim");
  TORCH_CHECK(k_cache.size(3) == s.hd && s.hd % 16 == 0, op,
              "head_dim must match the cache and be a multiple of 16");
  TORCH_CHECK(s.heads % s.kv_heads == 0, op, "heads must be a multiple of kv_heads");
  TORCH_CHECK(s.n >= 1 && s.ctx >= s.n && block_table.size(0) * s.block_size >= s.ctx, op,
              "need 1 <= n <= context_len <= blocks × block_size");
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t used = (s.ctx + s.block_size - 1) / s.block_size, pool = k_cache.size(0);
  for (int64_t b = 0; b < used; ++b)
    TORCH_CHECK(table[b] >= 0 && table[b] < pool, op, "block_table[", b, "] = ", table[b],
                " is outside the pool of ", pool, " blocks");
  s.group = s.heads / s.kv_heads;
  s.chunks = (s.ctx + kChunk - 1) / kChunk;
  s.q_tok = q.stride(0);
  s.q_head = q.stride(1);
  return s;
}

}  // namespace

namespace {

at::Tensor run_flash(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const at::Tensor& block_table, int64_t context_len, double scale,
                     bool amx) {
  const FlashShape s = check_flash_inputs(q, k_cache, v_cache, block_table, context_len);
  auto out = at::empty({s.n, s.heads, s.hd}, q.options().memory_format(at::MemoryFormat::Contiguous));
  const auto* kc = reinterpret_cast<const uint16_t*>(k_cache.data_ptr<c10::BFloat16>());
  const auto* vc = reinterpret_cast<const uint16_t*>(v_cache.data_ptr<c10::BFloat16>());
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr<c10::BFloat16>());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr<c10::BFloat16>());
  const int64_t* table = block_table.data_ptr<int64_t>();
  // packed K/V: 2 · kv_heads · chunks · 64 · head_dim bf16 per call (uninitialised; see pack_head)
  const int64_t head_elems = s.chunks * kChunk * s.hd;
  std::unique_ptr<uint16_t[]> kp(new uint16_t[s.kv_heads * head_elems]);
  std::unique_ptr<uint16_t[]> vp(new uint16_t[s.kv_heads * head_elems]);
  // (kv head, chunk) pieces: a few kv heads alone would leave threads idle
  at::parallel_for(0, s.kv_heads * s.chunks, 8, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e;) {
      const int64_t h = i / s.chunks, c0 = i % s.chunks, c1 = std::min(s.chunks, c0 + (e - i));
      pack_head(s, kc, vc, table, h, c0, c1, kp.get() + h * head_elems, vp.get() + h * head_elems);
      i += c1 - c0;
    }
  });
#ifdef YB_FLASH_AMX
  amx = amx && s.hd % 64 == 0;
#else
  amx = false;
#endif
  const int64_t tiles = (s.n + kTile - 1) / kTile, tasks = s.kv_heads * tiles;
  const float fscale = static_cast<float>(scale);
  // later tiles see more keys: every thread of torch's pool takes the costliest task left
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
#ifdef YB_FLASH_AMX
    const AmxScope amx_scope(amx);
#endif
    for (int64_t i = next++; i < tasks; i = next++) {
      const int64_t tile = tiles - 1 - i / s.kv_heads, h = i % s.kv_heads;
      const int64_t t0 = tile * kTile, t1 = std::min(s.n, t0 + kTile);
#ifdef YB_FLASH_AMX
      if (amx && s.hd == 64) {
        flash_task_amx64(s, qp, kp.get() + h * head_elems, vp.get() + h * head_elems, h, t0, t1,
                         fscale, op);
        continue;
      }
      if (amx) {
        flash_task_amx(s, qp, kp.get() + h * head_elems, vp.get() + h * head_elems, h, t0, t1,
                       fscale, op);
        continue;
      }
#endif
      flash_task(s, qp, kp.get() + h * head_elems, vp.get() + h * head_elems, h, t0, t1,
                 fscale, op);
    }
  });
  return out;
}

}  // namespace

at::Tensor flash_prefill_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                   const at::Tensor& v_cache, const at::Tensor& block_table,
                                   int64_t context_len, double scale) {
  return run_flash(q, k_cache, v_cache, block_table, context_len, scale, false);
}

at::Tensor flash_prefill_attention_amx(const at::Tensor& q, const at::Tensor& k_cache,
                                       const at::Tensor& v_cache, const at::Tensor& block_table,
                                       int64_t context_len, double scale) {
  TORCH_CHECK(amx_usable(), "flash_prefill_attention_amx: this CPU or build has no AMX-BF16 "
              "tiles (see amx_available)");
  return run_flash(q, k_cache, v_cache, block_table, context_len, scale, true);
}

bool amx_available() { return amx_usable(); }

}  // namespace yuebing
