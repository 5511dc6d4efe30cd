"""The trainer's exceptions. Every error the trainer raises on purpose derives from
:class:`TrainerError`::

    TrainerError
    ├── VLLMServerError          the sampler server failed to start, died, or answered an error
    │   └── WeightSyncError      a weight update was refused or failed (fatal: the server's
    │                            weights are in an unknown state)
    ├── RolloutWorkerError       the rollout worker crashed, hung or stopped (carries its traceback)
    └── ConfigError (ValueError) a config field, or a combination of fields, is invalid
"""

from __future__ import annotations


class TrainerError(Exception):
    """Base class of the trainer's errors."""


class VLLMServerError(TrainerError):
    """The vLLM server failed to start, died, or answered with an error.

    Args:
        message: What went wrong.
        detail: The server's own words (log tail or response body), shown after the message.
    """

    def __init__(self, message: str, detail: str = "") -> None:
        self.message = message
        self.detail = detail
        super().__init__(f"{message}\n--- server says ---\n{detail}" if detail else message)


class WeightSyncError(VLLMServerError):
    """A weight update failed; the server must be considered broken until restarted."""


class RolloutWorkerError(TrainerError):
    """The rollout worker process failed; the message carries the worker's traceback."""


class ConfigError(TrainerError, ValueError):
    """An invalid configuration value or combination (names the rule, the values and the fix)."""
