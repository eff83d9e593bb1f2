"""Prefill instance selection (paper §4.1, Algorithm 1), registered by name.

Called by `Policy.decide` once per request; a selector returns a `PrefillPlan`: the leading
blocks the chosen instance reuses, whether it first fetches a longer prefix from a holder, and
the TTFT estimate ``transfer + queue + prefill(new, reused)`` (the last prompt token is always
recomputed; the queue is what the instance's queue order serves first, `Policy.queue_wait`).
Long prompts (over ``cpp_threshold_tokens`` new) are estimated as chunked pipeline parallel
(`Policy.prefill_estimate`); with declared groups in the view (`ClusterView.groups`),
`Policy.decide` weighs each group against the selector's single instance. Ties go to the
instance listed first.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

from yuebing.conductor.policy.registries import PREFILL_SELECTORS
from yuebing.conductor.policy.types import ClusterView, PrefillPlan, RequestInfo

if TYPE_CHECKING:
    from yuebing.conductor.policy.policy import Policy




def stable_index(seed: int, salt: str, request_id: str, n: int) -> int:
    """Deterministic pseudo-random index in ``range(n)`` from (seed, salt, request id)."""
    digest = hashlib.blake2b(f"{seed}:{salt}:{request_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % n


def _local_plan(pol: Policy, req: RequestInfo, view: ClusterView, index: int) -> PrefillPlan:
    p = view.prefills[index]
    cached = pol.local_tokens(p, req.input_tokens)
    queue_s, prefill_s = pol.prefill_estimate(view, index, req.input_tokens - cached, cached)
    return PrefillPlan(index, p.local_prefix_blocks, 0, 0.0, queue_s, prefill_s)


@PREFILL_SELECTORS.register("random")
def select_random(pol: Policy, req: RequestInfo, view: ClusterView) -> PrefillPlan:
    """``random``: a stable hash of (seed, request id) picks the instance."""
    index = stable_index(pol.config.seed, "prefill", req.request_id, len(view.prefills))
    return _local_plan(pol, req, view, index)


@PREFILL_SELECTORS.register("load_balance")
def select_load_balance(pol: Policy, req: RequestInfo, view: ClusterView) -> PrefillPlan:
    """``load_balance``: least queued work (``queue_s``), then fewest queued requests."""
    best, best_key = 0, (float("inf"), 0)
    for i, p in enumerate(view.prefills):
        key = (p.queue_s, p.queued_requests)
        if key < best_key:
            best, best_key = i, key
    return _local_plan(pol, req, view, best)


@PREFILL_SELECTORS.register("local_cache_aware")
def select_local_cache_aware(pol: Policy, req: RequestInfo, view: ClusterView) -> PrefillPlan:
    """``local_cache_aware``: minimum estimated TTFT using each instance's own prefix."""
    n, cpp = req.input_tokens, pol.cpp_threshold
    best, best_ttft = 0, float("inf")
    for i, p in enumerate(view.prefills):
        cached = pol.local_tokens(p, n)
        if n - cached > cpp:
            ttft = sum(pol.prefill_estimate(view, i, n - cached, cached))
        else:
            t = pol.instance_prefill_time(view, i, n - cached, cached)
            ttft = pol.queue_wait(view, i, t) + t
        if ttft < best_ttft:
            best, best_ttft = i, ttft
    return _local_plan(pol, req, view, best)


@PREFILL_SELECTORS.register("global_cache_aware")
def select_global_cache_aware(pol: Policy, req: RequestInfo, view: ClusterView) -> PrefillPlan:
    """``global_cache_aware``, paper Algorithm 1 (prefill part): when ``best_len / local_len``
    exceeds the balancing threshold, plan to fetch the best prefix from its holder and charge the
    transfer; keep the local prefix when the fetch would not win; the minimum TTFT wins."""
    src = view.best_prefix
    best_blocks = src.blocks if src is not None else 0
    n = req.input_tokens
    threshold, cpp = pol.config.kvcache_balancing_threshold, pol.cpp_threshold
    best_tokens = pol.prefix_tokens(best_blocks, n)
    remote_prefill_s = pol.prefill_time(n - best_tokens, best_tokens)
    best: tuple[float, int, int] = (float("inf"), 0, 0)  # (ttft, index, fetch_blocks)
    for i, p in enumerate(view.prefills):
        local = p.local_prefix_blocks
        cached = pol.local_tokens(p, n)
        if n - cached > cpp:
            ttft = sum(pol.prefill_estimate(view, i, n - cached, cached))
        else:
            t = pol.instance_prefill_time(view, i, n - cached, cached)
            ttft = pol.queue_wait(view, i, t) + t
        fetch = 0
        if best_blocks > local and best_tokens > cached \
                and (local == 0 or best_blocks / local > threshold) \
                and src is not None and src.holder != p.instance_id:
            transfer_s = pol.transfer_time((best_tokens - cached) * pol.config.kv_bytes_per_token,
                                           view)
            if n - best_tokens > cpp:
                ttft_fetch = transfer_s + sum(pol.prefill_estimate(view, i, n - best_tokens,
                                                                   best_tokens))
            else:
                fetched_s = remote_prefill_s * p.time_factor
                ttft_fetch = transfer_s + pol.queue_wait(view, i, fetched_s) + fetched_s
            if ttft_fetch + pol.config.min_transfer_gain_s < ttft:
                ttft, fetch = ttft_fetch, best_blocks - local
        if ttft < best[0]:
            best = (ttft, i, fetch)
    _, index, fetch = best
    if fetch == 0:
        return _local_plan(pol, req, view, index)
    p = view.prefills[index]
    transfer_s = pol.transfer_time(
        (best_tokens - pol.local_tokens(p, n)) * pol.config.kv_bytes_per_token, view)
    queue_s, prefill_s = pol.prefill_estimate(view, index, n - best_tokens, best_tokens)
    return PrefillPlan(index, best_blocks, fetch, transfer_s, queue_s, prefill_s)
