"""`VllmLoad`: a vLLM server's load as the Conductor's `LoadReport` wants it, parsed from
vLLM's Prometheus ``/metrics`` text (`parse_metrics`: running and waiting requests, KV cache
usage, KV blocks). Pure; `instance.VllmInstance` polls ``/metrics`` and reports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


@dataclass(frozen=True)
class VllmLoad:
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """Share of the KV blocks in use, 0..1."""
    total_blocks: int = 0
    """KV blocks of the instance (0: vLLM did not say)."""

    @property
    def free_blocks(self) -> int:
        return max(0, round(self.total_blocks * (1.0 - self.kv_usage)))


def parse_metrics(text: str) -> VllmLoad:
    """The load in vLLM's ``/metrics`` text (summed over engines; missing samples are 0)."""
    values: dict[str, float] = {}
    blocks = 0
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        name, labels, raw = m.groups()
        try:
            value = float(raw)
        except ValueError:
            continue
        if name == "vllm:cache_config_info" and labels:
            found = dict(_LABEL.findall(labels))
            for key in ("num_gpu_blocks", "num_cpu_blocks"):
                if found.get(key, "").isdigit():
                    blocks = max(blocks, int(found[key]))
        values[name] = values.get(name, 0.0) + value
    return VllmLoad(running=int(values.get("vllm:num_requests_running", 0)),
                    waiting=int(values.get("vllm:num_requests_waiting", 0)),
                    kv_usage=min(1.0, max(0.0, values.get("vllm:kv_cache_usage_perc", 0.0))),
                    total_blocks=blocks)
