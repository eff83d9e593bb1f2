// Paged decode attention on CPU: one new query token per sequence attends to its whole context,
// read in place from the paged KV pool through the block table (no gather copy).
//
// Layout of one layer's pool: k_cache / v_cache [num_blocks, kv_heads, block_size, head_dim].
// Work is split into tasks (sequence, kv head, context partition of kPartition tokens) run on
// torch's thread pool (at::parallel_for). A task handles all query heads of its kv head (GQA), so
// K and V are read once per kv head: it computes the scores of its partition in float32, a
// max-subtracted softmax, and the weighted sum of V in float32. When every sequence fits one
// partition the tasks go to the threads in static chunks and write the output directly. When one
// needs more, the threads take tasks dynamically, largest first (so a long sequence's partitions
// spread over all threads), and that sequence's partials (max, sum, unnormalised output) are
// merged afterwards, as in vLLM's paged_attention_v2; shorter sequences still write directly.
// Each sequence is computed in the same order whatever else is in the batch, so results do not
// depend on the batch composition, bit for bit.
#include <atomic>

#include "decode_attention.h"

namespace yuebing {
namespace {

using namespace decode;  // NOLINT: this file is the op around decode_attention.h

// Merge the partials of every (seq, head) that has them into the output, in partition order.
template <typename T>
void merge_partitions(const DecodeShape& s, const int32_t* lens, const Partials& p, T* out) {
  at::parallel_for(0, static_cast<int64_t>(p.multi.size()) * s.heads, 1,
                   [&](int64_t begin, int64_t end) {
    std::vector<float> acc(s.head_dim);
    for (int64_t i = begin; i < end; ++i) merge_one<T>(s, lens, p, i, acc.data(), out);
  });
}

template <typename T>
void decode_attention_impl(const DecodeShape& s, const DecodeIo<T>& io) {
  Partials p = make_partials(s, io.lens);
  if (s.parts == 1) {  // one partition each: (seq, kv head) tasks in static chunks
    at::parallel_for(0, s.seqs * s.kv_heads, 1, [&](int64_t begin, int64_t end) {
      Scratch w(s);
      for (int64_t t = begin; t < end; ++t)
        decode_task<T>(s, io, p, w, t / s.kv_heads, t % s.kv_heads, 0);
    });
    return;
  }
  const auto items = work_items(s, io.lens);
  const int64_t tasks = static_cast<int64_t>(items.size()) * s.kv_heads;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch w(s);
    for (int64_t i = next++; i < tasks; i = next++) {
      const auto [seq, part] = items[i / s.kv_heads];
      decode_task<T>(s, io, p, w, seq, i % s.kv_heads, part);
    }
  });
  merge_partitions<T>(s, io.lens, p, io.out);
}

void check_decode_inputs(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                         const at::Tensor& table, const at::Tensor& lens) {
  TORCH_CHECK(q.dim() == 3, "paged_decode_attention: q must be [seqs, heads, head_dim], got ",
              q.sizes());
  TORCH_CHECK(kc.dim() == 4 && kc.sizes() == vc.sizes(),
              "paged_decode_attention: k_cache and v_cache must both be [blocks, kv_heads, "
              "block_size, head_dim], got ", kc.sizes(), " and ", vc.sizes());
  TORCH_CHECK(kc.is_contiguous() && vc.is_contiguous(),
              "paged_decode_attention: the caches must be contiguous");
  TORCH_CHECK(q.scalar_type() == kc.scalar_type() && kc.scalar_type() == vc.scalar_type(),
              "paged_decode_attention: q, k_cache and v_cache must share a dtype");
  TORCH_CHECK(kc.numel() > 0 && q.size(1) > 0 && q.size(2) > 0,
              "paged_decode_attention: empty cache or query shape ", kc.sizes(), " / ", q.sizes());
  TORCH_CHECK(q.size(2) == kc.size(3), "paged_decode_attention: q head_dim ", q.size(2),
              " != cache head_dim ", kc.size(3));
  TORCH_CHECK(q.stride(2) == 1, "paged_decode_attention: q's last dimension must be dense");
  TORCH_CHECK(q.size(1) % kc.size(1) == 0, "paged_decode_attention: heads ", q.size(1),
              " not a multiple of kv_heads ", kc.size(1));
  TORCH_CHECK(table.scalar_type() == at::kInt && lens.scalar_type() == at::kInt,
              "paged_decode_attention: block_table and context_lens must be int32");
  TORCH_CHECK(table.dim() == 2 && table.size(0) == q.size(0) && table.stride(1) == 1,
              "paged_decode_attention: block_table must be [seqs, max_blocks] with dense rows");
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == q.size(0) && lens.is_contiguous(),
              "paged_decode_attention: context_lens must be a dense [seqs] tensor");
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_cache,
                                  const at::Tensor& v_cache, const at::Tensor& block_table,
                                  const at::Tensor& context_lens, double scale) {
  check_decode_inputs(q, k_cache, v_cache, block_table, context_lens);
  const int32_t* lens = context_lens.data_ptr<int32_t>();
  const int32_t* table = block_table.data_ptr<int32_t>();
  const int64_t seqs = q.size(0), bs = k_cache.size(2), nb = k_cache.size(0);
  int64_t max_len = 0;
  for (int64_t i = 0; i < seqs; ++i) {
    TORCH_CHECK(lens[i] >= 1 && (lens[i] + bs - 1) / bs <= block_table.size(1),
                "paged_decode_attention: context length ", lens[i], " of sequence ", i,
                " is < 1 or needs more blocks than the table's ", block_table.size(1));
    for (int64_t b = 0; b < (lens[i] + bs - 1) / bs; ++b) {
      const int32_t blk = table[i * block_table.stride(0) + b];
      TORCH_CHECK(blk >= 0 && blk < nb, "paged_decode_attention: block ", blk,
                  " of sequence ", i, " outside the pool of ", nb, " blocks");
    }
    max_len = std::max<int64_t>(max_len, lens[i]);
  }
  DecodeShape s{seqs, q.size(1), q.size(2), k_cache.size(1), q.size(1) / k_cache.size(1), bs,
                block_table.stride(0), (max_len + kPartition - 1) / kPartition, q.stride(0),
                q.stride(1)};
  at::Tensor out = at::empty({seqs, s.heads, s.head_dim}, q.options());
  if (seqs == 0) return out;
  YB_DISPATCH_FLOAT(q.scalar_type(), "paged_decode_attention", [&] {
    const DecodeIo<scalar_t> io{q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(),
                                v_cache.data_ptr<scalar_t>(), table, lens,
                                static_cast<float>(scale), out.data_ptr<scalar_t>()};
    decode_attention_impl<scalar_t>(s, io);
  });
  return out;
}

}  // namespace yuebing
