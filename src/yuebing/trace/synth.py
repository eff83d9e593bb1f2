"""Synthetic workloads with controlled prefix sharing (`yuebing trace synth ...`, the simulator's
long-context figure, the bench): two shapes from the Mooncake arXiv evaluation, each an ordinary
`Trace` with chained-consistent ``hash_ids`` (equal ids ⇔ equal prefix).

``fixed`` (`FixedConfig`): every prompt ``input_tokens`` long, its first ``shared_fraction`` one
of ``prefix_groups`` shared prefixes. ``docqa`` (`DocQAConfig`): documents each asked many
questions, a prompt being the document then a unique question. Poisson arrivals, all drawn from
``numpy.random.default_rng(seed)``; generators register in `WORKLOADS`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from yuebing.core.config import require
from yuebing.core.errors import ConfigError
from yuebing.core.registry import Registry
from yuebing.trace.model import BLOCK_SIZE, MAX_TOKENS, Request, Trace, blocks_needed

WORKLOADS: Registry[tuple[type, Callable[..., Trace]]] = Registry("synthetic workload")


class _Ids:
    """Allocates fresh block ids 0, 1, 2, ..."""

    def __init__(self) -> None:
        self.next = 0

    def take(self, n: int) -> tuple[int, ...]:
        ids = tuple(range(self.next, self.next + n))
        self.next += n
        return ids


@dataclass(frozen=True)
class FixedConfig:
    """Fixed-length prompts with a shared prefix of a given fraction."""

    requests: int = field(default=1000, metadata={"help": "number of requests"})
    input_tokens: int = field(default=16384, metadata={"help": "prompt tokens of every request"})
    output_tokens: int = field(default=512, metadata={"help": "output tokens of every request"})
    shared_fraction: float = field(
        default=0.5, metadata={"help": "share of the prompt's full blocks that is a shared prefix"})
    prefix_groups: int = field(
        default=1, metadata={"help": "number of distinct shared prefixes (chosen uniformly)"})
    rate_per_s: float = field(default=1.0, metadata={"help": "Poisson arrival rate, requests/s"})
    seed: int = field(default=0, metadata={"help": "random seed"})

    def __post_init__(self) -> None:
        require(self.requests >= 1, f"requests must be >= 1, got {self.requests}")
        require(1 <= self.input_tokens <= MAX_TOKENS,
                f"input_tokens must be in 1..{MAX_TOKENS}, got {self.input_tokens}")
        require(0 <= self.output_tokens <= MAX_TOKENS,
                f"output_tokens must be in 0..{MAX_TOKENS}, got {self.output_tokens}")
        require(0.0 <= self.shared_fraction <= 1.0,
                f"shared_fraction must be in [0, 1], got {self.shared_fraction}")
        require(self.prefix_groups >= 1, f"prefix_groups must be >= 1, got {self.prefix_groups}")
        require(math.isfinite(self.rate_per_s) and self.rate_per_s > 0,
                f"rate_per_s must be > 0, got {self.rate_per_s}")
        require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")

    @property
    def shared_blocks(self) -> int:
        """Full blocks of the shared prefix: floor(shared_fraction · full blocks)."""
        return math.floor(self.shared_fraction * (self.input_tokens // BLOCK_SIZE) + 1e-9)


@dataclass(frozen=True)
class DocQAConfig:
    """Long documents, each followed by many questions.

    The full blocks of a document are shared by all its questions; the block where the document
    ends and the question starts, and everything after it, are unique. Questions of all documents
    arrive interleaved at random."""

    documents: int = field(default=20, metadata={"help": "number of documents"})
    questions_per_document: int = field(default=20, metadata={"help": "questions per document"})
    min_document_tokens: int = field(default=16384, metadata={"help": "shortest document"})
    max_document_tokens: int = field(default=65536, metadata={"help": "longest document"})
    question_tokens: int = field(default=128, metadata={"help": "tokens of each question"})
    output_tokens: int = field(default=256, metadata={"help": "output tokens of every request"})
    rate_per_s: float = field(default=1.0, metadata={"help": "Poisson arrival rate, requests/s"})
    seed: int = field(default=0, metadata={"help": "random seed"})

    def __post_init__(self) -> None:
        require(self.documents >= 1, f"documents must be >= 1, got {self.documents}")
        require(self.questions_per_document >= 1,
                f"questions_per_document must be >= 1, got {self.questions_per_document}")
        require(1 <= self.min_document_tokens <= self.max_document_tokens,
                "need 1 <= min_document_tokens <= max_document_tokens, got "
                f"{self.min_document_tokens} and {self.max_document_tokens}")
        require(self.question_tokens >= 1,
                f"question_tokens must be >= 1, got {self.question_tokens}")
        require(0 <= self.output_tokens <= MAX_TOKENS,
                f"output_tokens must be in 0..{MAX_TOKENS}, got {self.output_tokens}")
        require(self.max_document_tokens + self.question_tokens <= MAX_TOKENS,
                f"max_document_tokens + question_tokens must be <= {MAX_TOKENS}, got "
                f"{self.max_document_tokens + self.question_tokens}")
        require(math.isfinite(self.rate_per_s) and self.rate_per_s > 0,
                f"rate_per_s must be > 0, got {self.rate_per_s}")
        require(self.seed >= 0, f"seed must be >= 0, got {self.seed}")


def generate_fixed(cfg: FixedConfig) -> Trace:
    """A `FixedConfig` workload."""
    import numpy as np

    from yuebing.trace.transform import poisson_arrivals

    rng = np.random.default_rng(cfg.seed)
    ids = _Ids()
    groups = [ids.take(cfg.shared_blocks) for _ in range(cfg.prefix_groups)]
    n_blocks = blocks_needed(cfg.input_tokens)
    choice = rng.integers(cfg.prefix_groups, size=cfg.requests)
    times = poisson_arrivals(cfg.requests, cfg.rate_per_s, cfg.seed + 1)
    requests = [
        Request(t, cfg.input_tokens, cfg.output_tokens,
                groups[int(g)] + ids.take(n_blocks - cfg.shared_blocks))
        for t, g in zip(times, choice, strict=True)]
    return Trace(tuple(requests), BLOCK_SIZE, f"synth:fixed({cfg})")


def generate_docqa(cfg: DocQAConfig) -> Trace:
    """A `DocQAConfig` workload."""
    import numpy as np

    from yuebing.trace.transform import poisson_arrivals

    rng = np.random.default_rng(cfg.seed)
    ids = _Ids()
    doc_lens = rng.integers(cfg.min_document_tokens, cfg.max_document_tokens + 1,
                            size=cfg.documents)
    doc_blocks = [ids.take(int(n) // BLOCK_SIZE) for n in doc_lens]
    order = np.repeat(np.arange(cfg.documents), cfg.questions_per_document)
    rng.shuffle(order)
    times = poisson_arrivals(len(order), cfg.rate_per_s, cfg.seed + 1)
    requests = []
    for t, d in zip(times, order, strict=True):
        length = int(doc_lens[d]) + cfg.question_tokens
        own = blocks_needed(length) - len(doc_blocks[d])
        requests.append(Request(t, length, cfg.output_tokens, doc_blocks[d] + ids.take(own)))
    return Trace(tuple(requests), BLOCK_SIZE, f"synth:docqa({cfg})")


WORKLOADS.add("fixed", (FixedConfig, generate_fixed))
WORKLOADS.add("docqa", (DocQAConfig, generate_docqa))


def synthesize(kind: str, **params: object) -> Trace:
    """Build workload ``kind`` ("fixed" or "docqa") from its config fields."""
    cls, gen = WORKLOADS.get(kind)
    try:
        cfg = cls(**params)
    except TypeError as e:
        raise ConfigError(f"{kind} workload: {e}") from None
    return gen(cfg)
