// bf16 linear layers on AMX tiles for prefill-sized inputs: y = x · Wᵀ (+ bias), optionally
// with SiLU(gate)·up fused into the store (the gate/up projection then writes only the product).
//
// The weight [N, K] is packed once at load (in Python, `amx_linear.pack`) into B tiles:
// packed[N/16][K/32][16 pairs][16 columns][2] = W[16·nb + c][32·kb + 2p + e], 1 KiB per tile,
// each 16-column block's tiles contiguous. x is read in place as A tiles (16 rows × 32 bf16, at
// the row stride); a block of fewer than 32 rows is first copied into a zero-padded buffer.
// A micro-kernel block is 32 rows × 2 column blocks: two A tiles, two B tiles, four float32
// C tiles summed over K (TDPBF16PS: exact bf16 products, float32 sums), stored to a small
// buffer and rounded to bf16 once, as oneDNN and torch round their float32 result. With
// SiLU·mul the packing interleaves gate and up blocks (gate block j, then up block j), so the
// two C tiles of a block are one gate and its up: the store rounds both to bf16, then computes
// silu(gate) rounded to bf16 times up, as `silu_and_mul` does on a stored gate/up output.
// Threads split the column blocks (each reads its share of the weight). For inputs up to
// kL1Inner wide a 32-row block of x stays in L1 while the weight tiles of a panel of column
// blocks (about 1 MiB, held in L2) stream past it (TILELOADDT1: loaded without displacing x);
// wider inputs (the down projection) take 256 rows at a time and walk the columns inside.
// Every output element's sum runs over K in the same order whatever the row count, so each
// row's bits do not depend on the batch. Built only where -march=native has AMX-BF16 and
// AVX512-BF16 (and refused where the process is denied the tiles: `amx_available`).
#include "common.h"
#include "tiles.h"
#include "vec.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define YB_AMX_LINEAR 1
#endif

namespace yuebing {
namespace {

constexpr int64_t kBlockRows = 32;   // rows per micro-kernel block (two A tiles)
constexpr int64_t kRowChunk = 256;   // rows whose x stays in L2 while a thread walks its columns
constexpr int64_t kL1Inner = 640;    // widest input whose 32-row block (40 KiB) stays in L1
constexpr int64_t kPanelBytes = 1 << 20;  // weight bytes a thread walks per 32-row block

enum Epilogue : int64_t { kNone = 0, kSiluMul = 1 };

#ifdef YB_AMX_LINEAR
// tmm0-1: A (16 rows × 32 bf16), tmm2-3: B (16 pairs × 16 columns), tmm4-7: C (16 × 16 float).
class TileScope {
 public:
  TileScope() {
    TileConfig cfg;
    set_tiles(cfg, {0, 1, 2, 3, 4, 5, 6, 7}, 16);
    load_tile_config(cfg);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// c[32][32] (float32) = a[32 rows at stride lda] · (B blocks b0, b1)ᵀ over k_tiles tiles of 32.
// With one block (b1 null) only c's first 16 columns are written. `between` runs after the tile
// products are issued and before their results are stored: vector work placed there (the
// previous block's store) overlaps the tile unit's.
template <bool kTwo, typename Between>
inline void block_32(const uint16_t* a, int64_t lda, const uint16_t* b0, const uint16_t* b1,
                     int64_t k_tiles, float* c, const Between& between) {
  _tile_zero(4);
  _tile_zero(6);
  if (kTwo) {
    _tile_zero(5);
    _tile_zero(7);
  }
  const int64_t stride = lda * 2;
  for (int64_t kb = 0; kb < k_tiles; ++kb) {
    _tile_loadd(0, a + kb * 32, stride);
    _tile_stream_loadd(2, b0 + kb * 512, 64);
    _tile_dpbf16ps(4, 0, 2);
    _tile_loadd(1, a + 16 * lda + kb * 32, stride);
    _tile_dpbf16ps(6, 1, 2);
    if (kTwo) {
      _tile_stream_loadd(3, b1 + kb * 512, 64);
      _tile_dpbf16ps(5, 0, 3);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  between();
  _tile_stored(4, c, 128);
  _tile_stored(6, c + 16 * 32, 128);
  if (kTwo) {
    _tile_stored(5, c + 16, 128);
    _tile_stored(7, c + 16 * 32 + 16, 128);
  }
}

// Rows [0, rows) of c (+ bias) rounded to bf16 into out (width 16·blocks columns at stride ldo).
inline void store_plain(const float* c, int64_t rows, int64_t blocks, const float* bias,
                        uint16_t* out, int64_t ldo) {
  const __m512 b0 = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
  const __m512 b1 = bias && blocks == 2 ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 lo = _mm512_add_ps(_mm512_loadu_ps(c + r * 32), b0);
    if (blocks == 2) {
      const __m512 hi = _mm512_add_ps(_mm512_loadu_ps(c + r * 32 + 16), b1);
      _mm512_storeu_si512(out + r * ldo, reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi, lo)));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lo)));
    }
  }
}

// Rows [0, rows) of silu(gate)·up, gate = c[:, 0:16] (+ bias), up = c[:, 16:32] (+ bias), each
// rounded to bf16 first, the SiLU rounded to bf16 before the product (as `silu_and_mul`).
inline void store_silu_mul(const float* c, int64_t rows, const float* gbias, const float* ubias,
                           uint16_t* out, int64_t ldo) {
  const __m512 gb = gbias ? _mm512_loadu_ps(gbias) : _mm512_setzero_ps();
  const __m512 ub = ubias ? _mm512_loadu_ps(ubias) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 v = silu_mul16(_mm512_add_ps(_mm512_loadu_ps(c + r * 32), gb),
                                _mm512_add_ps(_mm512_loadu_ps(c + r * 32 + 16), ub));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldo),
                        reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
  }
}

struct LinearShape {
  int64_t m, k, blocks, out_cols;  // blocks: 16-column blocks of the packed weight
};

// The blocks of one thread in turn, each block's store (rounding, SiLU·mul) done while the tile
// unit computes the next block (two result buffers).
class BlockPipeline {
 public:
  BlockPipeline(const LinearShape& s, const uint16_t* x, const uint16_t* w, const float* bias,
                Epilogue ep, uint16_t* out)
      : s_(s), x_(x), w_(w), bias_(bias), ep_(ep), out_(out), k_tiles_(s.k / 32),
        tile_elems_(k_tiles_ * 512) {}

  // Rows [r0, r0 + rows) (rows <= kBlockRows) times column group g.
  void run(int64_t g, int64_t r0, int64_t rows) {
    const int64_t nb = 2 * g;
    const bool two = nb + 1 < s_.blocks;
    const uint16_t* b0 = w_ + nb * tile_elems_;
    const uint16_t* a = x_ + r0 * s_.k;
    if (rows < kBlockRows) {
      pad_.resize(kBlockRows * s_.k);
      std::memcpy(pad_.data(), a, rows * s_.k * sizeof(uint16_t));
      std::memset(pad_.data() + rows * s_.k, 0, (kBlockRows - rows) * s_.k * sizeof(uint16_t));
      a = pad_.data();
    }
    float* c = c_[cur_];
    const auto flush = [this] { finish(); };
    if (two)
      block_32<true>(a, s_.k, b0, b0 + tile_elems_, k_tiles_, c, flush);
    else
      block_32<false>(a, s_.k, b0, nullptr, k_tiles_, c, flush);
    pending_ = {g, r0, rows, cur_};
    cur_ ^= 1;
  }

  // Stores the pending block (if any).
  void finish() {
    if (pending_.rows == 0) return;
    const Pending p = pending_;
    pending_.rows = 0;
    const int64_t nb = 2 * p.g;
    const float* c = c_[p.buf];
    const float* b = bias_ ? bias_ + nb * 16 : nullptr;
    if (ep_ == kSiluMul) {
      store_silu_mul(c, p.rows, b, b ? b + 16 : nullptr, out_ + p.r0 * s_.out_cols + p.g * 16,
                     s_.out_cols);
    } else {
      store_plain(c, p.rows, nb + 1 < s_.blocks ? 2 : 1, b, out_ + p.r0 * s_.out_cols + nb * 16,
                  s_.out_cols);
    }
  }

 private:
  struct Pending {
    int64_t g = 0, r0 = 0, rows = 0, buf = 0;
  };
  const LinearShape& s_;
  const uint16_t* x_;
  const uint16_t* w_;
  const float* bias_;
  Epilogue ep_;
  uint16_t* out_;
  int64_t k_tiles_, tile_elems_;
  alignas(64) float c_[2][kBlockRows * 32];
  int64_t cur_ = 0;
  Pending pending_;
  std::vector<uint16_t> pad_;  // a short last block of rows, zero-padded to kBlockRows
};

// Column groups [g0, g1) (a group: two 16-column blocks, the last one alone when `blocks` is odd)
// for every row of x. Where a 32-row block of x fits L1 (in <= kL1Inner), rows go outer: the
// block stays in L1 while the weight tiles of a panel of groups (<= kPanelBytes, kept in L2)
// stream past it. Wider inputs take chunks of kRowChunk rows outer and the groups inside.
void run_groups(const LinearShape& s, const uint16_t* x, const uint16_t* w, const float* bias,
                Epilogue ep, uint16_t* out, int64_t g0, int64_t g1) {
  const TileScope tiles;
  BlockPipeline pipe(s, x, w, bias, ep, out);
  if (s.k <= kL1Inner) {
    const int64_t panel = std::max<int64_t>(1, kPanelBytes / (s.k * 64));
    for (int64_t p0 = g0; p0 < g1; p0 += panel) {
      const int64_t p1 = std::min(g1, p0 + panel);
      for (int64_t r0 = 0; r0 < s.m; r0 += kBlockRows) {
        for (int64_t g = p0; g < p1; ++g) pipe.run(g, r0, std::min(kBlockRows, s.m - r0));
      }
    }
  } else {
    for (int64_t m0 = 0; m0 < s.m; m0 += kRowChunk) {
      const int64_t m1 = std::min(s.m, m0 + kRowChunk);
      for (int64_t g = g0; g < g1; ++g) {
        for (int64_t r0 = m0; r0 < m1; r0 += kBlockRows)
          pipe.run(g, r0, std::min(kBlockRows, m1 - r0));
      }
    }
  }
  pipe.finish();
}
#endif

}  // namespace

at::Tensor amx_linear(const at::Tensor& x, const at::Tensor& packed,
                      const c10::optional<at::Tensor>& bias, int64_t epilogue) {
  const char* op = "amx_linear: ";
  TORCH_CHECK(amx_linear_available(), op, "this CPU or build has no AMX-BF16 tiles "
              "(see amx_linear_available)");
  TORCH_CHECK(epilogue == kNone || epilogue == kSiluMul, op, "epilogue ", epilogue,
              " unknown (0: none, 1: SiLU·mul)");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == at::kBFloat16, op,
              "x must be a contiguous bfloat16 [rows, in], got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(packed.dim() == 5 && packed.is_contiguous() &&
                  packed.scalar_type() == at::kBFloat16 && packed.size(2) == 16 &&
                  packed.size(3) == 16 && packed.size(4) == 2 && packed.size(0) > 0,
              op, "packed must be a contiguous bfloat16 [out/16, in/32, 16, 16, 2] from "
              "amx_linear.pack, got ", packed.sizes());
  const int64_t blocks = packed.size(0), k = packed.size(1) * 32;
  TORCH_CHECK(x.size(1) == k, op, "x has ", x.size(1), " columns, the weight ", k);
  TORCH_CHECK(epilogue != kSiluMul || blocks % 2 == 0, op,
              "SiLU·mul needs gate and up blocks in pairs, got ", blocks, " blocks");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == blocks * 16, op, "bias must be [",
                blocks * 16, "], got ", bias->sizes());
    b = bias->to(at::kFloat).contiguous();  // in packed column order
  }
  const int64_t out_cols = epilogue == kSiluMul ? blocks * 8 : blocks * 16;
  at::Tensor out = at::empty({x.size(0), out_cols}, x.options());
#ifdef YB_AMX_LINEAR
  if (x.size(0) == 0) return out;
  const LinearShape s{x.size(0), k, blocks, out_cols};
  const int64_t groups = (blocks + 1) / 2;
  const int64_t threads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), groups));
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr<at::BFloat16>());
  auto* op_ = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
  at::parallel_for(0, threads, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      run_groups(s, xp, wp, bp, static_cast<Epilogue>(epilogue), op_, groups * t / threads,
                 groups * (t + 1) / threads);
  });
#endif
  return out;
}

bool amx_linear_available() {
#ifdef YB_AMX_LINEAR
  return amx_available();
#else
  return false;
#endif
}

}  // namespace yuebing
