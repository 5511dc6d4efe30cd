"""``HarnessAsyncGRPOConfig``: the harness trainer's config, :class:`~trainer.AsyncGRPOConfig` plus the agent's
limits and the capture endpoint's address (shared by the trainer and the rollout worker's harness loop)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config import AsyncGRPOConfig
from trainer.exceptions import ConfigError

__all__ = ["HarnessAsyncGRPOConfig"]


@dataclass
class HarnessAsyncGRPOConfig(AsyncGRPOConfig):
    """:class:`~trainer.AsyncGRPOConfig` plus the agent's limits and the endpoint's address.

    The sampling fields (``temperature``, ``top_p``, ``top_k``, ``min_p``, ``max_completion_length``)
    apply to every request an agent makes: they define the policy being trained, so a request's own
    ``temperature`` / ``top_p`` are ignored and its ``max_tokens`` can only lower the limit.
    """

    agent_timeout: float = field(
        default=600.0, metadata={"help": "Seconds an agent has for one rollout; then it is cut (a subprocess is "
                                 "killed with its process group) and the rollout fails."})
    agent_max_requests: int = field(
        default=64, metadata={"help": "Chat requests one rollout may make; later ones get HTTP 429 "
                              "(tools/loop_exhausted_frac counts such rollouts)."})
    agent_parallel_requests: int = field(
        default=1, metadata={"help": "Requests of one rollout sampled at once; more wait. Every rollout holds "
                             "one slot of the concurrency cap, so this bounds what one slot can load the server with."})
    harness_host: str = field(
        default="127.0.0.1", metadata={"help": "Address the capture endpoint listens on. Loopback: agents run on "
                                       "this machine; another address exposes it to whoever can reach it "
                                       "(each rollout's secret still guards its session)."})
    harness_port: int = field(default=0, metadata={"help": "The endpoint's port; 0 takes a free one."})
    harness_max_request_bytes: int = field(
        default=8 * 2**20, metadata={"help": "Largest request body the endpoint reads (HTTP 413 above)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("agent_timeout", "agent_max_requests", "agent_parallel_requests", "harness_max_request_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)!r}")
        if not 0 <= self.harness_port < 65536:
            raise ConfigError(f"harness_port must be in [0, 65535] (0: any free port), got {self.harness_port}")
