"""What an instance's engine holds below the store's block size, as this Conductor knows it.

The index (`conductor.view.KvIndex`) sees store blocks (256 tokens by default), while an
engine's prefix cache keeps pages of 16. A prompt that shares a prefix ending inside a block
(a 992-token system prompt then a user turn) reuses up to the last shared page, not the last
shared block: routed on blocks alone, its prefill was estimated 2.5× too long. `EnginePages`
records the page keys of the prompts this Conductor prefilled on one instance (its engine kept
their pages), so `extra` can say how many tokens past the held blocks a new prompt will reuse.
`conductor.dispatch` computes `page_keys` per prompt and notes them after a prefill's first
token; `conductor.cluster.LiveCluster.view` asks `extra` of each prefill instance.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


def page_keys(token_ids: Sequence[int], page_tokens: int, seed: int) -> list[int]:
    """Chained keys of the full ``page_tokens`` pages of ``token_ids``: key ``j`` names the
    first ``(j + 1) * page_tokens`` tokens (after ``seed``, e.g. the model's fingerprint).
    Python's tuple hash: stable within the process, which is all the Conductor needs (the keys
    never leave it), and 4× cheaper than the store's BLAKE2b."""
    if page_tokens <= 0:
        raise ValueError(f"page_tokens must be positive, got {page_tokens}")
    keys: list[int] = []
    h = seed
    for start in range(0, len(token_ids) - page_tokens + 1, page_tokens):
        h = hash((h, *token_ids[start:start + page_tokens]))
        keys.append(h)
    return keys


class EnginePages:
    """The page keys of one instance's engine prefix cache: the prompts this Conductor
    prefilled there, least recently prefilled dropped first beyond ``capacity`` pages (the
    engine's KV pool: it cannot keep more). Approximate: the engine may evict sooner under
    other work, which this never learns; so the Conductor asks only for the pages inside the
    block after the held ones (`LiveCluster.view`): a whole block would have been reported,
    and an evicted one costs at most a block's tokens of estimate."""

    __slots__ = ("capacity", "page_tokens", "_keys")

    def __init__(self, page_tokens: int, capacity: int) -> None:
        if page_tokens <= 0 or capacity <= 0:
            raise ValueError(f"page_tokens and capacity must be positive, got {page_tokens} "
                             f"and {capacity}")
        self.page_tokens = page_tokens
        self.capacity = capacity
        self._keys: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._keys)

    def note(self, keys: Sequence[int]) -> None:
        """The engine prefilled a prompt of these page keys: it holds them now."""
        held = self._keys
        for k in keys:
            held[k] = None
            held.move_to_end(k)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def extra(self, keys: Sequence[int], from_tokens: int, upto_tokens: int) -> int:
        """Tokens past ``from_tokens`` (the held blocks' tokens, a multiple of the page size)
        and before ``upto_tokens`` at the head of the prompt of ``keys`` that the engine holds:
        pages are chained, so the run stops at the first missing one."""
        held, j = self._keys, from_tokens // self.page_tokens
        start, end = j, min(len(keys), upto_tokens // self.page_tokens)
        while j < end and keys[j] in held:
            j += 1
        return (j - start) * self.page_tokens
