"""`BenchConfig`: what ``yuebing bench serve`` sends, where, how fast, and how it is judged.

The CLI flags are generated from the fields (`yuebing.core.config.add_config_args`); every
invalid value raises `ConfigError` naming the flag, before a trace is read or a request is sent.
Who uses it: `yuebing.bench.workload` (prompts, caps, arrival times), `yuebing.bench.client`
(endpoint, API, timeouts, 429 handling) and `yuebing.bench.metrics` (SLO thresholds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from yuebing.core.config import require
from yuebing.trace.latency import TBT_THRESHOLDS_S, TTFT_SLO_S

APIS = ("completions", "chat")
"""``/v1/completions`` or ``/v1/chat/completions``."""
PROMPT_FORMATS = ("tokens", "text")
"""Prompts as lists of token ids (``/v1/completions`` only) or as text."""


def _positive(value: float) -> bool:
    return math.isfinite(value) and value > 0


@dataclass(frozen=True)
class BenchConfig:
    """One load-generator run against an OpenAI-compatible endpoint."""

    endpoint: str = field(default="http://127.0.0.1:8000",
                          metadata={"help": "base URL of the OpenAI-compatible server"})
    model: str = field(default="", metadata={
        "help": "model name to request (empty: the first model the endpoint's /v1/models lists)"})
    api: str = field(default="completions", metadata={"help": "API: completions or chat"})
    api_key_env: str = field(default="", metadata={
        "help": "environment variable holding a bearer token for the endpoint (empty: none)"})
    prompt_format: str = field(default="tokens", metadata={
        "help": "send prompts as token ids (completions only) or as text (needs --tokenizer)"})
    tokenizer: str = field(default="", metadata={
        "help": "tokenizer.json (Hugging Face tokenizers) that turns token ids into text"})
    block_tokens: int = field(default=512, metadata={
        "help": "prompt tokens per trace hash block (prompt lengths scale by this / 512)"})
    max_input: int = field(default=0, metadata={"help": "cap on prompt tokens (0: none)"})
    max_output: int = field(default=0, metadata={"help": "cap on output tokens (0: none)"})
    limit: int = field(default=0, metadata={
        "help": "send only the first N requests in arrival order (0: all)"})
    speed: float = field(default=1.0, metadata={
        "help": "replay the trace's own timestamps this many times faster"})
    rate: float = field(default=0.0, metadata={
        "help": "Poisson arrivals at this rate (requests/s) instead of the trace's timestamps"})
    concurrency: int = field(default=0, metadata={
        "help": "closed loop: keep N requests in flight, ignoring arrival times (0: open loop)"})
    seed: int = field(default=0, metadata={"help": "seed of the Poisson arrivals"})
    timeout_s: float = field(default=600.0, metadata={
        "help": "give up on a request after this many seconds (counted as error 'timeout')"})
    retry_429: bool = field(default=False, metadata={
        "help": "resend a request refused with 429 after its Retry-After (default: count it "
                "as a rejection)"})
    ignore_eos: bool = field(default=True, metadata={
        "help": "ask the server to generate exactly max_tokens (vLLM's ignore_eos)"})
    return_token_ids: bool = field(default=False, metadata={
        "help": "ask for each chunk's generated token ids (vLLM's return_token_ids): counts and "
                "times tokens of a model that streams no text (one without a tokenizer)"})
    slo_ttft: tuple[float, ...] = field(default=(TTFT_SLO_S,), metadata={
        "help": "TTFT SLO thresholds in seconds"})
    slo_tbt: tuple[float, ...] = field(default=TBT_THRESHOLDS_S, metadata={
        "help": "TBT SLO thresholds in seconds (TBT: mean of the longest 10%% token intervals)"})
    target_attainment: float = field(default=0.9, metadata={
        "help": "SLO attainment a swept rate must reach to count as sustained"})
    stop_on_miss: bool = field(default=False, metadata={
        "help": "sweep: skip the rates above the first whose attainment misses the target"})
    stop_when_decided: bool = field(default=False, metadata={
        "help": "end an open-loop run as soon as it misses --target-attainment for certain "
                "(more requests missed the first SLOs than the target allows, whatever the rest "
                "do); its attainments are then reported as the bounds they can no longer exceed"})
    sweep_down: bool = field(default=False, metadata={
        "help": "sweep from the highest rate down and stop at the first that reaches "
                "--target-attainment (the maximum rate, attainment falling with rate)"})

    def __post_init__(self) -> None:
        url = urlsplit(self.endpoint)
        require(url.scheme in ("http", "https") and bool(url.netloc),
                f"--endpoint must be an http(s) URL such as http://127.0.0.1:8000, "
                f"got {self.endpoint!r}")
        require(self.api in APIS, f"--api must be one of {', '.join(APIS)}, got {self.api!r}")
        require(self.prompt_format in PROMPT_FORMATS,
                f"--prompt-format must be one of {', '.join(PROMPT_FORMATS)}, "
                f"got {self.prompt_format!r}")
        require(not (self.api == "chat" and self.prompt_format == "tokens"),
                "chat messages are text: use --prompt-format text (with --tokenizer) for --api "
                "chat")
        require(self.prompt_format == "tokens" or bool(self.tokenizer),
                "--prompt-format text needs --tokenizer FILE (a tokenizer.json) to turn the "
                "synthesized token ids into text")
        require(self.block_tokens >= 1, f"--block-tokens must be >= 1, got {self.block_tokens}")
        for name in ("max_input", "max_output", "limit", "concurrency", "seed"):
            value = getattr(self, name)
            require(value >= 0, f"--{name.replace('_', '-')} must be >= 0, got {value}")
        require(_positive(self.speed), f"--speed must be > 0, got {self.speed}")
        require(math.isfinite(self.rate) and self.rate >= 0,
                f"--rate must be >= 0 (0: the trace's timestamps), got {self.rate}")
        require(not (self.rate > 0 and self.concurrency > 0),
                "--rate (open loop) and --concurrency (closed loop) exclude each other")
        require(self.speed == 1.0 or not (self.rate > 0 or self.concurrency > 0),
                "--speed scales the trace's own timestamps; --rate and --concurrency do not use "
                "them")
        require(_positive(self.timeout_s), f"--timeout-s must be > 0, got {self.timeout_s}")
        for name in ("slo_ttft", "slo_tbt"):
            values = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            require(bool(values), f"{flag} needs at least one threshold (seconds)")
            require(all(_positive(v) for v in values),
                    f"{flag} thresholds must be > 0 seconds, got {values}")
        require(not (self.stop_when_decided and self.concurrency > 0),
                "--stop-when-decided needs an open-loop run (--rate, --sweep-rates or the "
                "trace's timing), not --concurrency")
        require(not (self.sweep_down and self.stop_on_miss),
                "--sweep-down stops at the first rate that passes, --stop-on-miss at the first "
                "that misses: choose one")
        require(0 < self.target_attainment <= 1,
                f"--target-attainment must be in (0, 1], got {self.target_attainment}")

    @property
    def base_url(self) -> str:
        """The endpoint without a trailing ``/`` or ``/v1``: paths are appended to it."""
        url = self.endpoint.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url
