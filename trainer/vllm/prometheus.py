"""vLLM's ``/metrics`` (Prometheus text exposition): the load the rollout worker watches and the
KV-cache capacity read once at start (:mod:`trainer.vllm.server_info`)."""

from __future__ import annotations

import re
from dataclasses import dataclass

_PROM_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eE]+|NaN|[+-]Inf)$")
_PROM_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')

Sample = tuple[str, dict[str, str], float]
"""One sample: ``(name, labels, value)``."""


@dataclass
class ServerLoad:
    """The server's load as read from ``/metrics`` (summed/maxed over engines)."""

    kv_cache_usage: float
    running: float
    waiting: float
    preemptions: float


def parse_prometheus(text: str) -> list[Sample]:
    """Parse Prometheus text exposition into ``(name, labels, value)`` samples."""
    samples = []
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _PROM_LINE.match(line.strip())
        if m:
            labels = dict(_PROM_LABEL.findall(m.group(2) or ""))
            samples.append((m.group(1), labels, float(m.group(3))))
    return samples


def server_load(samples: list[Sample]) -> ServerLoad:
    """Reduce parsed ``/metrics`` samples to a :class:`ServerLoad` (max KV use, summed counts)."""
    def values(name: str) -> list[float]:
        return [v for n, _, v in samples if n == name]

    kv = values("vllm:kv_cache_usage_perc")
    return ServerLoad(
        kv_cache_usage=max(kv) if kv else 0.0,
        running=sum(values("vllm:num_requests_running")),
        waiting=sum(values("vllm:num_requests_waiting")),
        preemptions=sum(values("vllm:num_preemptions_total")),
    )


def kv_cache_tokens(samples: list[Sample]) -> int | None:
    """KV-cache capacity in tokens from ``vllm:cache_config_info`` (blocks x block size)."""
    for name, labels, _ in samples:
        if name == "vllm:cache_config_info":
            blocks = labels.get("num_gpu_blocks") or labels.get("num_cpu_blocks")
            if blocks and blocks != "None" and labels.get("block_size"):
                return int(blocks) * int(labels["block_size"])
    return None
