// Fused decode for small batches (bfloat16, AVX512-BF16): a whole decoder layer, and the final
// norm with the LM head, each in one OpenMP parallel region instead of ~15 torch ops with a
// fork/join each. Matmuls split the weight's output rows between the threads and read each
// once for all batch rows (float32 sums). Weights row-major [out, in]: a vdpbf16ps dot product
// per weight row and batch row (8 rows at a time). Weights packed as `amx_linear.pack` lays them
// out (where the CPU grants AMX-BF16 tiles): the batch rows (up to 16) read in place as the A
// tile, 1 KiB weight tiles as B, four 16-output blocks at a time: one tile product serves every
// row, so a row costs little beyond the weight's read. RMSNorm, RoPE with the K/V cache write,
// paged attention and SiLU·mul are fused between them, with a barrier between stages.
// Intermediates are rounded to bf16 where the torch path stores them. Each batch row is computed
// the same way whatever the other rows are; the summation order differs from oneDNN's, so
// results match the unfused path in tokens, not in bits.
#include <omp.h>

#include <optional>

#include "decode_attention.h"
#include "tiles.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    !defined(YB_DECODE_NO_AMX)
#define YB_DECODE_AMX 1
#endif

namespace yuebing {

bool fused_decode_available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// Whether the fused ops take packed weights and run their matmuls on AMX tiles here.
bool fused_decode_tiles() {
#ifdef YB_DECODE_AMX
  return amx_available();
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
namespace {

using bf16 = c10::BFloat16;
constexpr int64_t kMaxRows = 16;    // a tile's rows (dot products take them 8 at a time)
constexpr int64_t kMaxDotRows = 8;  // rows per vdpbf16ps pass

inline __mmask32 mask32(int64_t left) {
  return left >= 32 ? ~__mmask32(0) : static_cast<__mmask32>((1u << left) - 1);
}

#ifndef YB_PREFETCH_BYTES
#define YB_PREFETCH_BYTES 2048
#endif

// out[r] = sum_k w[k]·x[r·K + k] in float32 for R batch rows. The weight streams from memory
// once: its line YB_PREFETCH_BYTES ahead is prefetched (the rows follow each other).
template <int R>
inline void dot_rows(const bf16* w, const bf16* x, int64_t K, float* out) {
  __m512 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  const char* ahead = reinterpret_cast<const char*>(w) + YB_PREFETCH_BYTES;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    _mm_prefetch(ahead + 2 * k, _MM_HINT_T0);
    const __m512i wv = _mm512_loadu_si512(w + k);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)wv,
                                (__m512bh)_mm512_loadu_si512(x + r * K + k));
  }
  if (k < K) {
    const __mmask32 m = mask32(K - k);
    const __m512i wv = _mm512_maskz_loadu_epi16(m, w + k);
    for (int r = 0; r < R; ++r)
      acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)wv,
                                (__m512bh)_mm512_maskz_loadu_epi16(m, x + r * K + k));
  }
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}

inline void dot_any(int64_t R, const bf16* w, const bf16* x, int64_t K, float* out) {
  switch (R) {
    case 1: return dot_rows<1>(w, x, K, out);
    case 2: return dot_rows<2>(w, x, K, out);
    case 3: return dot_rows<3>(w, x, K, out);
    case 4: return dot_rows<4>(w, x, K, out);
    case 5: return dot_rows<5>(w, x, K, out);
    case 6: return dot_rows<6>(w, x, K, out);
    case 7: return dot_rows<7>(w, x, K, out);
    default: return dot_rows<8>(w, x, K, out);
  }
}

// y[r, o] = bf16(W[o]·x[r]) for o in [o0, o1); y has row stride ldy.
inline void gemv(const bf16* W, int64_t K, const bf16* x, int64_t R, int64_t o0, int64_t o1,
                 bf16* y, int64_t ldy) {
  float out[kMaxDotRows];
  for (int64_t o = o0; o < o1; ++o)
    for (int64_t r0 = 0; r0 < R; r0 += kMaxDotRows) {
      const int64_t n = std::min(kMaxDotRows, R - r0);
      dot_any(n, W + o * K, x + r0 * K, K, out);
      for (int64_t r = 0; r < n; ++r) y[(r0 + r) * ldy + o] = bf16(out[r]);
    }
}

#ifdef YB_DECODE_AMX
// Tiles: tmm0 A (the R batch rows × 32 inputs, read in place), tmm2-3 B (weight tiles as
// `amx_linear.pack` lays them out: [out/16][in/32] tiles of 16 pairs × 16 outputs, 1 KiB each),
// tmm4-7 C (R rows × 16 outputs, float32).
// Configures this thread's tiles for R batch rows and releases them at the end.
class DecodeTiles {
 public:
  explicit DecodeTiles(int64_t R) {
    TileConfig cfg;
    set_tiles(cfg, {0, 4, 5, 6, 7}, static_cast<int>(R));
    set_tiles(cfg, {2, 3}, 16);
    load_tile_config(cfg);
  }
  ~DecodeTiles() { _tile_release(); }
  DecodeTiles(const DecodeTiles&) = delete;
  DecodeTiles& operator=(const DecodeTiles&) = delete;
};

// c[r][16·i + j] (float32, row stride 64) = x row r · weight output 16·b[i] + j, for N packed
// blocks b[i] of a weight with K inputs (K / 32 tiles per block), x [R][K] at row stride K.
template <int N>
inline void tile_blocks(const bf16* x, int64_t K, const bf16* packed, const int64_t* b,
                        float* c) {
  _tile_zero(4);
  if (N > 1) _tile_zero(5);
  if (N > 2) _tile_zero(6);
  if (N > 3) _tile_zero(7);
  const int64_t kt = K / 32;
  const bf16* w[4] = {};
  for (int i = 0; i < N; ++i) w[i] = packed + b[i] * kt * 512;
  for (int64_t kb = 0; kb < kt; ++kb) {
    _tile_loadd(0, x + kb * 32, K * 2);
    _tile_loadd(2, w[0] + kb * 512, 64);
    _tile_dpbf16ps(4, 0, 2);
    if (N > 1) {
      _tile_loadd(3, w[1] + kb * 512, 64);
      _tile_dpbf16ps(5, 0, 3);
    }
    if (N > 2) {
      _tile_loadd(2, w[2] + kb * 512, 64);
      _tile_dpbf16ps(6, 0, 2);
    }
    if (N > 3) {
      _tile_loadd(3, w[3] + kb * 512, 64);
      _tile_dpbf16ps(7, 0, 3);
    }
  }
  _tile_stored(4, c, 256);
  if (N > 1) _tile_stored(5, c + 16, 256);
  if (N > 2) _tile_stored(6, c + 32, 256);
  if (N > 3) _tile_stored(7, c + 48, 256);
}

// Outputs [o0, o1) (multiples of 16) of x · Wᵀ for a packed weight, four blocks at a time
// into c (64·R floats, row stride 64); store(o, blocks) takes each pass's outputs o, o + 16·blocks.
template <typename Store>
inline void tile_walk(const bf16* packed, int64_t K, const bf16* x, int64_t o0, int64_t o1,
                      float* c, const Store& store) {
  for (int64_t o = o0; o < o1;) {
    const int blocks = o + 64 <= o1 ? 4 : 1;
    const int64_t b[4] = {o / 16, o / 16 + 1, o / 16 + 2, o / 16 + 3};
    if (blocks == 4)
      tile_blocks<4>(x, K, packed, b, c);
    else
      tile_blocks<1>(x, K, packed, b, c);
    store(o, blocks);
    o += 16 * blocks;
  }
}

// y[r, o] = bf16(W[o]·x[r]) for o in [o0, o1) of a packed weight.
inline void tile_matmul(const bf16* packed, int64_t K, const bf16* x, int64_t R, int64_t o0,
                        int64_t o1, bf16* y, int64_t ldy, float* c) {
  tile_walk(packed, K, x, o0, o1, c, [&](int64_t o, int blocks) {
    for (int64_t r = 0; r < R; ++r)
      for (int i = 0; i < blocks; ++i)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy + o + 16 * i),
                            bf16_pack(_mm512_loadu_ps(c + r * 64 + 16 * i)));
  });
}
#endif

// The layer's weights are either all row-major [out, in] (vdpbf16ps GEMVs) or all packed as
// `amx_linear.pack` does (the gate/up one by `pack_silu_pairs`), on tiles.
inline void matmul(bool tiles, const bf16* W, int64_t K, const bf16* x, int64_t R, int64_t o0,
                   int64_t o1, bf16* y, int64_t ldy, float* c) {
#ifdef YB_DECODE_AMX
  if (tiles) return tile_matmul(W, K, x, R, o0, o1, y, ldy, c);
#else
  (void)tiles;
  (void)c;
#endif
  gemv(W, K, x, R, o0, o1, y, ldy);
}

// This thread's share [first, second) of n items, in multiples of 16 (cache lines of rows).
inline std::pair<int64_t, int64_t> share(int64_t n, int tid, int nt) {
  const int64_t units = (n + 15) / 16;
  const int64_t a = units * tid / nt, b = units * (tid + 1) / nt;
  return {std::min(n, a * 16), std::min(n, b * 16)};
}

// residual (+= x unless first) → RMSNorm → hidden, for every row.
void add_norm(const bf16* x, bf16* res, const bf16* w, bf16* hidden, int64_t R, int64_t H,
              float eps, bool add, float* buf) {
  for (int64_t r = 0; r < R; ++r) {
    bf16* rr = res + r * H;
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 m = tail_mask(H - i);
      __m512 v = load16(rr + i, m);
      if (add) {
        v = round16<bf16>(_mm512_add_ps(load16(x + r * H + i, m), v));
        store16(rr + i, v, m);
      }
      _mm512_mask_storeu_ps(buf + i, m, v);
    }
    normalize_row<bf16>(buf, w, hidden + r * H, H, eps);
  }
}

struct LayerArgs {
  int64_t R, H, heads, kv_heads, hd, F, block_size, table_stride;
  float eps, scale;
  bool first, tiles;
  const bf16 *x, *ln1, *wqkv, *wo, *ln2, *wgu, *wdown, *cos, *sin;
  bf16 *res, *kc, *vc, *hidden, *qkv, *attn, *act, *out;
  const int64_t *pos, *slots;
  const int32_t *table, *lens;
  // the attention's tasks (decode_attention.h): (row, partition) pairs, largest first, each
  // for every kv head, and the partials of rows with several partitions
  const decode::DecodeShape* shape;
  const std::vector<std::pair<int32_t, int32_t>>* items;
  decode::Partials* partials;
};

void layer(const LayerArgs& a, int nt) {
  const int64_t R = a.R, H = a.H, hd = a.hd, nq = (a.heads + 2 * a.kv_heads) * hd;
  const int64_t half = hd / 2, F = a.F;
  const bool tiles = a.tiles;
#pragma omp parallel num_threads(nt)
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
    std::vector<float> buf(std::max(H, hd)), acc(hd), c(tiles ? 64 * R : 0);
#ifdef YB_DECODE_AMX
    std::optional<DecodeTiles> tile_cfg;
    if (tiles) tile_cfg.emplace(R);
#endif
#pragma omp single
    add_norm(a.x, a.res, a.ln1, a.hidden, R, H, a.eps, !a.first, buf.data());
    auto [q0, q1] = share(nq, tid, n);
    matmul(tiles, a.wqkv, H, a.hidden, R, q0, q1, a.qkv, nq, c.data());
#pragma omp barrier
#pragma omp for schedule(static)
    for (int64_t i = 0; i < R * (a.heads + a.kv_heads); ++i) {
      const int64_t r = i / (a.heads + a.kv_heads), h = i % (a.heads + a.kv_heads);
      bf16* row = a.qkv + r * nq;
      const bf16* cs = a.cos + a.pos[r] * half;
      const bf16* sn = a.sin + a.pos[r] * half;
      if (h < a.heads) {
        rotate<bf16>(row + h * hd, cs, sn, row + h * hd, half);
        continue;
      }
      const int64_t j = h - a.heads;
      const int64_t blk = a.slots[r] / a.block_size, off = a.slots[r] % a.block_size;
      const int64_t dst = ((blk * a.kv_heads + j) * a.block_size + off) * hd;
      rotate<bf16>(row + h * hd, cs, sn, a.kc + dst, half);
      const bf16* v = row + (a.heads + a.kv_heads + j) * hd;
      std::copy(v, v + hd, a.vc + dst);
    }
    {  // attention: a task per (row, partition, kv head) with all its query heads, then merges
      const decode::DecodeIo<bf16> io{a.qkv, a.kc, a.vc, a.table, a.lens, a.scale, a.attn};
      decode::Scratch w(*a.shape);
      const int64_t tasks = static_cast<int64_t>(a.items->size()) * a.kv_heads;
#pragma omp for schedule(dynamic, 1)
      for (int64_t i = 0; i < tasks; ++i) {
        const auto [seq, part] = (*a.items)[i / a.kv_heads];
        decode::decode_task<bf16>(*a.shape, io, *a.partials, w, seq, i % a.kv_heads, part);
      }
#pragma omp for schedule(static)
      for (int64_t i = 0; i < static_cast<int64_t>(a.partials->multi.size()) * a.heads; ++i)
        decode::merge_one<bf16>(*a.shape, a.lens, *a.partials, i, acc.data(), a.attn);
    }
    auto [h0, h1] = share(H, tid, n);
    matmul(tiles, a.wo, a.heads * hd, a.attn, R, h0, h1, a.out, H, c.data());
#pragma omp barrier
#pragma omp single
    add_norm(a.out, a.res, a.ln2, a.hidden, R, H, a.eps, true, buf.data());
    auto [f0, f1] = share(F, tid, n);
    if (tiles) {
#ifdef YB_DECODE_AMX
      // gate block j / 16 is packed block 2j / 16, its up block the next (pack_silu_pairs)
      for (int64_t j = f0; j < f1;) {
        const int pairs = j + 32 <= f1 ? 2 : 1;
        const int64_t g = 2 * (j / 16), b[4] = {g, g + 1, g + 2, g + 3};
        if (pairs == 2)
          tile_blocks<4>(a.hidden, H, a.wgu, b, c.data());
        else
          tile_blocks<2>(a.hidden, H, a.wgu, b, c.data());
        for (int64_t r = 0; r < R; ++r)
          for (int i = 0; i < pairs; ++i)
            _mm256_storeu_si256(
                reinterpret_cast<__m256i*>(a.act + r * F + j + 16 * i),
                bf16_pack(silu_mul16(_mm512_loadu_ps(c.data() + r * 64 + 32 * i),
                                     _mm512_loadu_ps(c.data() + r * 64 + 32 * i + 16))));
        j += 16 * pairs;
      }
#endif
    } else {
      float g[kMaxDotRows], u[kMaxDotRows];
      for (int64_t j = f0; j < f1; ++j)
        for (int64_t r0 = 0; r0 < R; r0 += kMaxDotRows) {
          const int64_t rows = std::min(kMaxDotRows, R - r0);
          dot_any(rows, a.wgu + j * H, a.hidden + r0 * H, H, g);
          dot_any(rows, a.wgu + (F + j) * H, a.hidden + r0 * H, H, u);
          for (int64_t r = 0; r < rows; ++r) {  // as silu_and_mul on the bf16 matmul outputs
            const float gr = round_through<bf16>(g[r]), ur = round_through<bf16>(u[r]);
            const float act = round_through<bf16>(gr / (1.f + std::exp(-gr)));
            a.act[(r0 + r) * F + j] = bf16(act * ur);
          }
        }
    }
#pragma omp barrier
    matmul(tiles, a.wdown, F, a.act, R, h0, h1, a.out, H, c.data());
  }
}

// A weight's [out, in]: row-major [out, in], or packed as `amx_linear.pack` lays it out
// ([out/16, in/32, 16, 16, 2]); both contiguous bfloat16.
std::pair<int64_t, int64_t> weight_shape(const at::Tensor& w) {
  if (w.dim() == 5) return {w.size(0) * 16, w.size(1) * 32};
  return {w.size(0), w.size(1)};
}

bool is_packed(const at::Tensor& w) { return w.dim() == 5; }

void check_weight(const at::Tensor& w, int64_t rows, int64_t cols, bool packed,
                  const char* name) {
  const bool layout = packed ? w.dim() == 5 && w.size(2) == 16 && w.size(3) == 16 &&
                                   w.size(4) == 2
                             : w.dim() == 2;
  TORCH_CHECK(w.scalar_type() == at::kBFloat16 && layout && w.is_contiguous() &&
              weight_shape(w) == std::make_pair(rows, cols), "decode_layer: ", name,
              " must be a contiguous bfloat16 ", packed ? "packed " : "", "[", rows, ", ",
              cols, "], got ", w.sizes(), " ", w.scalar_type(),
              " (all weights row-major [out, in], or all packed as amx_linear.pack)");
}

// Packed weights need the tiles (checked once per call).
void check_tiles(bool packed) {
#ifdef YB_DECODE_AMX
  TORCH_CHECK(!packed || amx_available(), "decode_layer: packed weights need AMX-BF16 tiles, "
              "which this process was denied");
#else
  TORCH_CHECK(!packed, "decode_layer: packed weights need a build with AMX-BF16 tiles");
#endif
}

}  // namespace

at::Tensor decode_layer(const at::Tensor& x, at::Tensor& residual, const at::Tensor& ln1,
                        const at::Tensor& wqkv, const at::Tensor& wo, const at::Tensor& ln2,
                        const at::Tensor& wgu, const at::Tensor& wdown, const at::Tensor& cos,
                        const at::Tensor& sin, const at::Tensor& positions,
                        at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slots,
                        const at::Tensor& block_table, const at::Tensor& context_lens,
                        int64_t num_heads, int64_t num_kv_heads, double eps, double scale,
                        bool first) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() &&
              residual.scalar_type() == at::kBFloat16 && residual.size(0) >= 1 &&
              residual.size(0) <= kMaxRows, "decode_layer: residual must be a contiguous "
              "bfloat16 [rows <= ", kMaxRows, ", hidden], got ", residual.sizes());
  const int64_t R = residual.size(0), H = residual.size(1);
  TORCH_CHECK(x.sizes() == residual.sizes() && x.is_contiguous() &&
              x.scalar_type() == at::kBFloat16, "decode_layer: x must be like residual");
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "decode_layer: num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
              k_cache.is_contiguous() && v_cache.is_contiguous() &&
              k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16 &&
              k_cache.size(1) == num_kv_heads, "decode_layer: caches must be contiguous bfloat16 "
              "[blocks, ", num_kv_heads, ", block_size, head_dim]");
  const int64_t hd = k_cache.size(3), F = weight_shape(wdown).second;
  const bool packed = is_packed(wqkv);
  check_tiles(packed);
  check_weight(wqkv, (num_heads + 2 * num_kv_heads) * hd, H, packed, "wqkv");
  check_weight(wo, H, num_heads * hd, packed, "wo");
  check_weight(wgu, 2 * F, H, packed, "wgu");
  check_weight(wdown, H, F, packed, "wdown");
  for (const at::Tensor* w : {&ln1, &ln2})
    TORCH_CHECK(w->scalar_type() == at::kBFloat16 && w->dim() == 1 && w->size(0) == H &&
                w->is_contiguous(), "decode_layer: norm weights must be bfloat16 [", H, "]");
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(1) * 2 == hd &&
              cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == at::kBFloat16 &&
              sin.scalar_type() == at::kBFloat16, "decode_layer: cos/sin must be bfloat16 "
              "[positions, ", hd / 2, "]");
  for (const at::Tensor* t : {&positions, &slots})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == R &&
                t->is_contiguous(), "decode_layer: positions and slots must be int64 [", R, "]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && block_table.dim() == 2 &&
              block_table.size(0) == R && block_table.stride(1) == 1 &&
              context_lens.scalar_type() == at::kInt && context_lens.dim() == 1 &&
              context_lens.size(0) == R && context_lens.is_contiguous(),
              "decode_layer: block_table must be int32 [", R, ", blocks] and context_lens "
              "int32 [", R, "]");
  const int64_t bs = k_cache.size(2), capacity = k_cache.size(0) * bs;
  const int64_t* p = positions.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(p[r] >= 0 && p[r] < cos.size(0), "decode_layer: position ", p[r],
                " outside the table of ", cos.size(0));
    TORCH_CHECK(sl[r] >= 0 && sl[r] < capacity, "decode_layer: slot ", sl[r],
                " outside the pool of ", capacity, " slots");
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= block_table.size(1) * bs, "decode_layer: context ",
                lens[r], " outside 1..", block_table.size(1) * bs);
    for (int64_t b = 0; b < (lens[r] + bs - 1) / bs; ++b) {
      const int32_t blk = table[r * block_table.stride(0) + b];
      TORCH_CHECK(blk >= 0 && blk < k_cache.size(0), "decode_layer: block ", blk,
                  " outside the pool of ", k_cache.size(0));
    }
  }
  auto opts = residual.options();
  at::Tensor hidden = at::empty({R, H}, opts);
  at::Tensor qkv = at::empty({R, weight_shape(wqkv).first}, opts);
  at::Tensor attn = at::empty({R, num_heads * hd}, opts), act = at::empty({R, F}, opts);
  at::Tensor out = at::empty({R, H}, opts);
  int64_t max_len = 0;
  for (int64_t r = 0; r < R; ++r) max_len = std::max<int64_t>(max_len, lens[r]);
  const decode::DecodeShape shape{R, num_heads, hd, num_kv_heads, num_heads / num_kv_heads, bs,
                                  block_table.stride(0), decode::parts_of(static_cast<int32_t>(max_len)),
                                  weight_shape(wqkv).first, hd};
  const auto items = decode::work_items(shape, lens);
  decode::Partials partials = decode::make_partials(shape, lens);
  LayerArgs a{R, H, num_heads, num_kv_heads, hd, F, bs, block_table.stride(0),
              static_cast<float>(eps), static_cast<float>(scale), first, packed,
              x.data_ptr<bf16>(), ln1.data_ptr<bf16>(), wqkv.data_ptr<bf16>(),
              wo.data_ptr<bf16>(), ln2.data_ptr<bf16>(), wgu.data_ptr<bf16>(),
              wdown.data_ptr<bf16>(), cos.data_ptr<bf16>(), sin.data_ptr<bf16>(),
              residual.data_ptr<bf16>(), k_cache.data_ptr<bf16>(), v_cache.data_ptr<bf16>(),
              hidden.data_ptr<bf16>(), qkv.data_ptr<bf16>(), attn.data_ptr<bf16>(),
              act.data_ptr<bf16>(), out.data_ptr<bf16>(), p, sl, table, lens, &shape, &items,
              &partials};
  layer(a, at::get_num_threads());
  return out;
}

at::Tensor decode_logits(const at::Tensor& residual, const at::Tensor& x,
                         const at::Tensor& norm, const at::Tensor& weight, double eps) {
  TORCH_CHECK(residual.dim() == 2 && residual.is_contiguous() &&
              residual.scalar_type() == at::kBFloat16 && residual.size(0) >= 1 &&
              residual.size(0) <= kMaxRows && x.sizes() == residual.sizes() &&
              x.is_contiguous() && x.scalar_type() == at::kBFloat16,
              "decode_logits: residual and x must be contiguous bfloat16 [rows <= ", kMaxRows,
              ", hidden], got ", residual.sizes(), " and ", x.sizes());
  const int64_t R = residual.size(0), H = residual.size(1);
  const bool packed = is_packed(weight);
  check_tiles(packed);
  const int64_t V = weight_shape(weight).first;
  check_weight(weight, V, H, packed, "weight");
  TORCH_CHECK(norm.scalar_type() == at::kBFloat16 && norm.dim() == 1 && norm.size(0) == H &&
              norm.is_contiguous(), "decode_logits: norm must be bfloat16 [", H, "]");
  at::Tensor res = residual.clone(), hidden = at::empty({R, H}, residual.options());
  at::Tensor logits = at::empty({R, V}, residual.options().dtype(at::kFloat));
  const bf16* w = weight.data_ptr<bf16>();
  const bf16* hp = hidden.data_ptr<bf16>();
  float* lp = logits.data_ptr<float>();
#pragma omp parallel num_threads(at::get_num_threads())
  {
    const int tid = omp_get_thread_num(), n = omp_get_num_threads();
#pragma omp single
    {
      std::vector<float> buf(H);
      add_norm(x.data_ptr<bf16>(), res.data_ptr<bf16>(), norm.data_ptr<bf16>(),
               hidden.data_ptr<bf16>(), R, H, static_cast<float>(eps), true, buf.data());
    }
    auto [v0, v1] = share(V, tid, n);
    if (packed) {
#ifdef YB_DECODE_AMX
      DecodeTiles tile_cfg(R);
      std::vector<float> c(64 * R);
      // logits rounded through bf16 as the torch path stores them
      tile_walk(w, H, hp, v0, v1, c.data(), [&](int64_t o, int blocks) {
        for (int64_t r = 0; r < R; ++r)
          for (int i = 0; i < blocks; ++i)
            _mm512_storeu_ps(lp + r * V + o + 16 * i,
                             bf16_round(_mm512_loadu_ps(c.data() + r * 64 + 16 * i)));
      });
#endif
    } else {
      float out[kMaxDotRows];
      for (int64_t o = v0; o < v1; ++o)
        for (int64_t r0 = 0; r0 < R; r0 += kMaxDotRows) {
          const int64_t rows = std::min(kMaxDotRows, R - r0);
          dot_any(rows, w + o * H, hp + r0 * H, H, out);
          for (int64_t r = 0; r < rows; ++r)
            lp[(r0 + r) * V + o] = round_through<bf16>(out[r]);
        }
    }
  }
  return logits;
}

#else  // no AVX512-BF16: the ops exist but refuse (fused_decode_available() is false)

at::Tensor decode_layer(const at::Tensor&, at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, int64_t, int64_t, double, double,
                        bool) {
  TORCH_CHECK(false, "decode_layer: built without AVX512-BF16 (see fused_decode_available)");
}

at::Tensor decode_logits(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                         const at::Tensor&, double) {
  TORCH_CHECK(false, "decode_logits: built without AVX512-BF16 (see fused_decode_available)");
}

#endif

}  // namespace yuebing
