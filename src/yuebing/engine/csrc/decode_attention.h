// The partition machinery of paged decode attention, shared by the paged decode op
// (decode_attention.cpp, on torch's thread pool) and the fused decode layer (decode_fused.cpp,
// inside its OpenMP region): a task attends one (sequence, kv head, partition of kPartition
// tokens) for all query heads of that kv head, so K and V are read once per kv head; sequences
// with several partitions are merged afterwards in partition order (vLLM's paged_attention_v2).
// A sequence's result depends only on its own context, whatever else is in the batch.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec.h"

namespace yuebing {
namespace decode {

constexpr int64_t kPartition = 512;

struct DecodeShape {
  int64_t seqs, heads, head_dim, kv_heads, group, block_size, table_stride, parts;
  int64_t q_seq_stride, q_head_stride;
};

template <typename T>
inline void prefetch_rows(const T* p, int64_t elems) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t byte = 0; byte < elems * static_cast<int64_t>(sizeof(T)); byte += 64)
    __builtin_prefetch(c + byte);
}

// Calls f(t, k_row_offset) for each token t in [start, stop) of one kv head, walking the
// sequence's blocks (offset of the token's head_dim row within the layer's pool). Blocks are
// scattered over the pool, so the hardware prefetcher cannot follow: the next block of `base`
// is prefetched while one runs, and the current block of `later` (V during the K pass).
template <typename T, typename F>
inline void for_tokens(const DecodeShape& s, const T* base, const T* later, const int32_t* row,
                       int64_t kvh, int64_t start, int64_t stop, F&& f) {
  const int64_t hd = s.head_dim, head_stride = s.block_size * hd;
  const int64_t block_stride = s.kv_heads * head_stride;
  const int64_t last_block = (stop - 1) / s.block_size;
  for (int64_t t = start; t < stop;) {
    const int64_t b = t / s.block_size, end = std::min(stop, (b + 1) * s.block_size);
    if (b < last_block) prefetch_rows(base + row[b + 1] * block_stride + kvh * head_stride,
                                      head_stride);
    if (later != nullptr)
      prefetch_rows(later + row[b] * block_stride + kvh * head_stride, head_stride);
    int64_t off = row[b] * block_stride + kvh * head_stride + (t - b * s.block_size) * hd;
    for (; t < end; ++t, off += hd) f(t, off);
  }
}

// Scores q_g·k_t·scale of the partition into scores[g * kPartition + t - start].
template <typename T>
void score_generic(const DecodeShape& s, const T* q, const T* kc, const T* vc, const int32_t* row,
                   int64_t kvh, int64_t start, int64_t stop, float scale, float* qf,
                   float* scores) {
  const int64_t hd = s.head_dim, g_n = s.group;
  for (int64_t g = 0; g < g_n; ++g)
    for (int64_t i = 0; i < hd; ++i) qf[g * hd + i] = to_float(q[g * s.q_head_stride + i]) * scale;
  for_tokens(s, kc, vc, row, kvh, start, stop, [&](int64_t t, int64_t off) {
    for (int64_t g = 0; g < g_n; ++g)
      scores[g * kPartition + (t - start)] = dot_row<T>(qf + g * hd, kc + off, hd);
  });
}

template <typename T>
void accumulate_generic(const DecodeShape& s, const T* vc, const int32_t* row, int64_t kvh,
                        int64_t start, int64_t stop, const float* scores, float* acc) {
  const int64_t hd = s.head_dim, g_n = s.group;
  std::fill(acc, acc + g_n * hd, 0.f);
  const T* none = nullptr;
  for_tokens(s, vc, none, row, kvh, start, stop, [&](int64_t t, int64_t off) {
    for (int64_t g = 0; g < g_n; ++g)
      axpy_row<T>(scores[g * kPartition + (t - start)], vc + off, acc + g * hd, hd);
  });
}

#ifdef __AVX512F__
// head_dim = 16·C: each K/V row is converted to float32 once and used for every query head.
template <typename T, int C>
void score_avx512(const DecodeShape& s, const T* q, const T* kc, const T* vc, const int32_t* row,
                  int64_t kvh, int64_t start, int64_t stop, float scale, float* qf,
                  float* scores) {
  const int64_t g_n = s.group;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16> && C % 2 == 0) {
    // bf16 pairs straight into vdpbf16ps: exact products, float32 sums, scale applied after
    for_tokens(s, kc, vc, row, kvh, start, stop, [&](int64_t t, int64_t off) {
      __m512i kk[C / 2];
      for (int c = 0; c < C / 2; ++c) kk[c] = _mm512_loadu_si512(kc + off + 32 * c);
      for (int64_t g = 0; g < g_n; ++g) {
        const T* qg = q + g * s.q_head_stride;
        __m512 acc = _mm512_setzero_ps();
        for (int c = 0; c < C / 2; ++c)
          acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(qg + 32 * c), (__m512bh)kk[c]);
        scores[g * kPartition + (t - start)] = _mm512_reduce_add_ps(acc) * scale;
      }
    });
    return;
  }
#endif
  for (int64_t g = 0; g < g_n; ++g)
    for (int c = 0; c < C; ++c)
      _mm512_storeu_ps(qf + (g * C + c) * 16,
                       _mm512_mul_ps(load16(q + g * s.q_head_stride + 16 * c), _mm512_set1_ps(scale)));
  for_tokens(s, kc, vc, row, kvh, start, stop, [&](int64_t t, int64_t off) {
    __m512 kk[C];
    for (int c = 0; c < C; ++c) kk[c] = load16(kc + off + 16 * c);
    for (int64_t g = 0; g < g_n; ++g) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qf + g * C * 16), kk[0]);
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + (g * C + c) * 16), kk[c], acc);
      scores[g * kPartition + (t - start)] = _mm512_reduce_add_ps(acc);
    }
  });
}

template <typename T, int C>
void accumulate_avx512(const DecodeShape& s, const T* vc, const int32_t* row, int64_t kvh,
                       int64_t start, int64_t stop, const float* scores, float* acc) {
  const int64_t g_n = s.group;
  std::fill(acc, acc + g_n * C * 16, 0.f);
  const T* none = nullptr;
  for_tokens(s, vc, none, row, kvh, start, stop, [&](int64_t t, int64_t off) {
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vc + off + 16 * c);
    for (int64_t g = 0; g < g_n; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * kPartition + (t - start)]);
      float* a = acc + g * C * 16;
      for (int c = 0; c < C; ++c)
        _mm512_storeu_ps(a + 16 * c, _mm512_fmadd_ps(w, vv[c], _mm512_loadu_ps(a + 16 * c)));
    }
  });
}

// Same with the G×C accumulators in registers (G query heads per kv head known at compile time).
template <typename T, int C, int G>
void accumulate_blocked(const DecodeShape& s, const T* vc, const int32_t* row, int64_t kvh,
                        int64_t start, int64_t stop, const float* scores, float* acc) {
  __m512 a[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_setzero_ps();
  const T* none = nullptr;
  for_tokens(s, vc, none, row, kvh, start, stop, [&](int64_t t, int64_t off) {
    __m512 vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load16(vc + off + 16 * c);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(scores[g * kPartition + (t - start)]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(w, vv[c], a[g][c]);
    }
  });
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + (g * C + c) * 16, a[g][c]);
}

// The register-blocked accumulation where G·C accumulators fit the 32 zmm registers with room
// for the V row, else the one keeping accumulators in memory.
template <typename T, int C, int G>
constexpr auto blocked_or_plain() {
  if constexpr (G * C <= 24) return &accumulate_blocked<T, C, G>;
  else return &accumulate_avx512<T, C>;
}

template <typename T, int C>
auto pick_accumulate(int64_t group) -> decltype(&accumulate_avx512<T, C>) {
  switch (group) {
    case 1: return blocked_or_plain<T, C, 1>();
    case 2: return blocked_or_plain<T, C, 2>();
    case 3: return blocked_or_plain<T, C, 3>();
    case 4: return blocked_or_plain<T, C, 4>();
    case 5: return blocked_or_plain<T, C, 5>();
    case 6: return blocked_or_plain<T, C, 6>();
    case 7: return blocked_or_plain<T, C, 7>();
    case 8: return blocked_or_plain<T, C, 8>();
    default: return &accumulate_avx512<T, C>;
  }
}
#endif

// One task's partition [start, stop) for (seq, kv head): float32 scores, max-subtracted
// softmax numerators, their sum and max per query head, and the unnormalised output.
template <typename T>
void attend_partition(const DecodeShape& s, const T* q, const T* kc, const T* vc,
                      const int32_t* table, int64_t seq, int64_t kvh, int64_t start,
                      int64_t stop, float scale, float* qf, float* scores, float* acc,
                      float* out_max, float* out_sum) {
  const T* qs = q + seq * s.q_seq_stride + kvh * s.group * s.q_head_stride;
  const int32_t* row = table + seq * s.table_stride;
  const int64_t n = stop - start;
  auto score = &score_generic<T>;
  auto accumulate = &accumulate_generic<T>;
#ifdef __AVX512F__
  switch (s.head_dim) {
    case 32: score = &score_avx512<T, 2>; accumulate = pick_accumulate<T, 2>(s.group); break;
    case 64: score = &score_avx512<T, 4>; accumulate = pick_accumulate<T, 4>(s.group); break;
    case 128: score = &score_avx512<T, 8>; accumulate = pick_accumulate<T, 8>(s.group); break;
    default: break;
  }
#endif
  score(s, qs, kc, vc, row, kvh, start, stop, scale, qf, scores);
  for (int64_t g = 0; g < s.group; ++g) {
    float* sc = scores + g * kPartition;
    out_max[g] = max_row(sc, n);
    out_sum[g] = exp_sub_sum(sc, n, out_max[g]);
  }
  accumulate(s, vc, row, kvh, start, stop, scores, acc);
}

inline int64_t parts_of(int32_t len) { return (len + kPartition - 1) / kPartition; }

// Partials of the sequences that need more than one partition (vLLM's paged_attention_v2):
// (seq, head, part) lives at slot first[seq] + head * used + part. The buffers are uninitialised
// (merge reads only slots that a task wrote); single-partition sequences have first = -1 and
// are written straight to the output, so a sequence's bits never depend on the batch.
struct Partials {
  std::vector<int64_t> first;
  std::vector<int64_t> multi;  // the sequences with partials
  std::unique_ptr<float[]> max, sum, out;
};

inline Partials make_partials(const DecodeShape& s, const int32_t* lens) {
  Partials p;
  p.first.assign(s.seqs, -1);
  int64_t slots = 0;
  for (int64_t i = 0; i < s.seqs; ++i) {
    const int64_t used = parts_of(lens[i]);
    if (used < 2) continue;
    p.first[i] = slots;
    p.multi.push_back(i);
    slots += s.heads * used;
  }
  if (slots > 0) {
    p.max.reset(new float[slots]);
    p.sum.reset(new float[slots]);
    p.out.reset(new float[slots * s.head_dim]);
  }
  return p;
}

// Every (sequence, partition) to compute, largest first, for threads that take them dynamically
// (a long sequence's partitions spread over all threads and the small ones fill in at the end).
inline std::vector<std::pair<int32_t, int32_t>> work_items(const DecodeShape& s,
                                                           const int32_t* lens) {
  std::vector<std::pair<int32_t, int32_t>> items;
  for (int32_t i = 0; i < s.seqs; ++i)
    for (int32_t p = 0; p < parts_of(lens[i]); ++p) items.emplace_back(i, p);
  auto size = [&](const std::pair<int32_t, int32_t>& it) {
    return std::min<int64_t>(kPartition, lens[it.first] - int64_t{it.second} * kPartition);
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const auto& a, const auto& b) { return size(a) > size(b); });
  return items;
}

// Merge the partials of (seq, head) number ``i`` of the sequences that have them
// (``p.multi[i / heads]``, head ``i % heads``) into the output, in partition order; ``acc`` holds
// head_dim floats of scratch.
template <typename T>
inline void merge_one(const DecodeShape& s, const int32_t* lens, const Partials& p, int64_t i,
                      float* acc, T* out) {
  const int64_t hd = s.head_dim;
  const int64_t seq = p.multi[i / s.heads], h = i % s.heads, used = parts_of(lens[seq]);
  const int64_t base = p.first[seq] + h * used;
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t q = 0; q < used; ++q) m = std::max(m, p.max[base + q]);
  std::fill(acc, acc + hd, 0.f);
  float total = 0.f;
  for (int64_t q = 0; q < used; ++q) {
    const float w = std::exp(p.max[base + q] - m);
    total += p.sum[base + q] * w;
    const float* o = p.out.get() + (base + q) * hd;
    for (int64_t j = 0; j < hd; ++j) acc[j] += o[j] * w;
  }
  const float inv = 1.f / total;  // multiplied like the direct path's a * (1/sum)
  T* dst = out + (seq * s.heads + h) * hd;
  for (int64_t j = 0; j < hd; ++j) dst[j] = from_float<T>(acc[j] * inv);
}

template <typename T>
struct DecodeIo {
  const T *q, *kc, *vc;
  const int32_t *table, *lens;
  float scale;
  T* out;
};

// One thread's scratch for attend_partition.
struct Scratch {
  explicit Scratch(const DecodeShape& s)
      : qf(s.group * s.head_dim), scores(s.group * kPartition), acc(s.group * s.head_dim),
        mx(s.group), sm(s.group) {}
  std::vector<float> qf, scores, acc, mx, sm;
};

// Partition `part` of sequence `seq` for kv head `kvh`: straight to the output when it is the
// sequence's only one, else into its partial slots.
template <typename T>
void decode_task(const DecodeShape& s, const DecodeIo<T>& io, Partials& p, Scratch& w,
                 int64_t seq, int64_t kvh, int64_t part) {
  const int64_t start = part * kPartition;
  const int64_t stop = std::min<int64_t>(io.lens[seq], start + kPartition);
  attend_partition<T>(s, io.q, io.kc, io.vc, io.table, seq, kvh, start, stop, io.scale,
                      w.qf.data(), w.scores.data(), w.acc.data(), w.mx.data(), w.sm.data());
  const int64_t hd = s.head_dim, used = parts_of(io.lens[seq]);
  for (int64_t g = 0; g < s.group; ++g) {
    const int64_t h = kvh * s.group + g;
    const float* a = w.acc.data() + g * hd;
    if (p.first[seq] < 0) {
      T* dst = io.out + (seq * s.heads + h) * hd;
      const float inv = 1.f / w.sm[g];
      for (int64_t i = 0; i < hd; ++i) dst[i] = from_float<T>(a[i] * inv);
    } else {
      const int64_t slot = p.first[seq] + h * used + part;
      p.max[slot] = w.mx[g];
      p.sum[slot] = w.sm[g];
      std::copy(a, a + hd, p.out.get() + slot * hd);
    }
  }
}

}  // namespace decode
}  // namespace yuebing
