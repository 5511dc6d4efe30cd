"""The trainer's exceptions, all in one place. Every error the trainer raises on purpose derives from
:class:`TrainerError`, itself under the project-wide :class:`sdk.exceptions.ToolgymError`::

    ToolgymError                       (sdk.exceptions: the root of every toolgym error)
    └── TrainerError
        ├── VLLMServerError            the sampler server failed to start, died, or answered an error
        │   ├── WeightSyncError        a weight update was refused or failed (fatal: the server's
        │   │                          weights are in an unknown state)
        │   └── ServerLostError        one of several servers was taken out mid-request (its rollout
        │                              starts over on another; never reaches the user)
        ├── EnvServerLaunchError       an env server started for the run (launch_envserver) did not
        │                              become ready
        ├── RolloutWorkerError         the rollout worker crashed, hung or stopped (carries its traceback)
        │   └── PipelineStalledError   nothing trainable reached the trainer for stall_timeout seconds
        ├── RankZeroLostError          rank 0 stopped feeding another rank (multi-process training)
        ├── NonFiniteTrainingError     step after step had non-finite gradients (none was applied)
        ├── UnsupportedModelError (TypeError)   the model has layers tree packing cannot run (yet)
        ├── OversizeSampleError (ValueError)    a sample is longer than ``token_budget``
        ├── RewardFunctionError (ValueError)   a reward function raised or returned a wrong-length list
        ├── RewardTimeoutError (TimeoutError)  a reward function hung past ``reward_timeout`` again and again
        ├── CheckpointSaveError (OSError)      a checkpoint could not be written (disk full...); older ones intact
        ├── OpenAIRequestError         the harness endpoint refuses an agent's request (sent as OpenAI's error)
        ├── AgentCommandError          a command agent exited non-zero (its rollout fails)
        ├── RolloutFailed              one rollout could not run; the group goes on without it
        └── ConfigError (ValueError)   a config field, or a combination of fields, is invalid
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdk.exceptions import ToolgymError

if TYPE_CHECKING:
    from trainer.records import TrainingSample


class TrainerError(ToolgymError):
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


class ServerLostError(VLLMServerError):
    """One of several vLLM servers was taken out while a request waited on it: the rollout starts over on
    another server (:mod:`trainer.rollout.servers`); losing the last server is a plain :class:`VLLMServerError`."""


class EnvServerLaunchError(TrainerError):
    """An env server started as a child process (``launch_envserver``, ``trainer.launch.envserver``) exited or
    did not answer ``/health`` in time; the message names what it hosts and why (its log is on the console)."""


class RolloutWorkerError(TrainerError):
    """The rollout worker process failed; the message carries the worker's traceback."""


class PipelineStalledError(RolloutWorkerError):
    """Nothing trainable reached the trainer for ``stall_timeout`` seconds of waiting, or cannot ever (every
    rollout failing, ``filter_prompt`` rejecting a whole epoch); the message says what was dropped and why."""


class RankZeroLostError(TrainerError):
    """Rank 0 stopped feeding this rank: its heartbeat froze or the store became unreachable."""


class NonFiniteTrainingError(TrainerError):
    """Several optimizer steps in a row had non-finite gradients; none was applied, and the run stops."""


class UnsupportedModelError(TrainerError, TypeError):
    """The model has layers that tree packing cannot run correctly (yet); the message says what to do."""


class RewardFunctionError(TrainerError, ValueError):
    """A reward function raised or returned the wrong number of rewards (the message names it)."""


class RewardTimeoutError(TrainerError, TimeoutError):
    """A reward function ran past ``reward_timeout`` in several groups in a row: it hangs on every input."""


class CheckpointSaveError(TrainerError, OSError):
    """Saving a checkpoint failed (disk full...); nothing of it was kept, the earlier ones are intact."""


class ConfigError(TrainerError, ValueError):
    """An invalid configuration value or combination (names the rule, the values and the fix)."""


class OversizeSampleError(TrainerError, ValueError):
    """A sample has more tokens than ``token_budget`` and fits in no row, even alone.

    The caller drops it with a warning and counts it (``batch/dropped_oversize_count``).
    """

    def __init__(self, sample: TrainingSample, token_budget: int) -> None:
        super().__init__(
            f"sample of {sample.num_tokens} tokens (group {sample.group_id}) exceeds "
            f"token_budget={token_budget}; it cannot be trained and is dropped"
        )
        self.sample = sample
        self.token_budget = token_budget


class OpenAIRequestError(TrainerError):
    """A request the harness endpoint refuses, answered as OpenAI's error object with ``status``.

    Args:
        message: What is wrong, for the agent's developer.
        status: The HTTP status.
        code: OpenAI's machine-readable ``code`` (``"rollout_finished"``, ``"context_length_exceeded"``...).
        param: The offending request field, when there is one.
    """

    def __init__(self, message: str, status: int = 400, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.code = code
        self.param = param


class AgentCommandError(TrainerError):
    """A command agent exited with a non-zero status (the message has its stderr's tail)."""


class RolloutFailed(TrainerError):
    """A rollout could not run (its environment's reset raised, its agent crashed...): the group goes on
    without it.

    Raise it from :meth:`trainer.rollout.loop.AsyncRolloutLoop.run_rollout` to fail only that rollout
    (it is logged and counted in ``rollout/failed_count``); any other exception stops the run.
    """
