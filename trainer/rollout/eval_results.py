"""An evaluation's results: one record per episode, their summary, the table and the files.

An evaluation run writes two files to its folder:

* ``results.jsonl``: one line per episode (:class:`EpisodeResult`: the prompt, the completion, the
  reward and its sources, tool calls, tokens, the policy version it was sampled under);
* ``summary.json``: :meth:`EvalSummary.to_json`, the whole run's figures and one entry per task.

:func:`format_table` prints a summary; :func:`compare_runs` compares two run folders (``toolgym eval
--compare A B``). The statistics are :mod:`trainer.rollout.eval_stats`'.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.exceptions import ConfigError
from trainer.rollout.eval_stats import (
    Difference,
    Estimate,
    compare_means,
    compare_proportions,
    mean_estimate,
    pass_at_k_curve,
    proportion_estimate,
)

__all__ = [
    "RESULTS_FILE",
    "SUMMARY_FILE",
    "EpisodeResult",
    "EvalSummary",
    "RunComparison",
    "compare_runs",
    "format_comparison",
    "format_table",
    "read_episodes",
    "summarize",
    "write_run",
]

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
TABLE_PASS_AT_K = (1, 2, 4, 8, 16, 32, 64, 128)
"""The ``k`` the table shows (those up to ``n``, and ``n`` itself); ``summary.json`` has every one."""


@dataclass
class EpisodeResult:
    """One evaluation episode, as written to ``results.jsonl``.

    Attributes:
        row_index: The dataset row (prompt) it ran.
        sample_index: Which of the row's episodes (0 to n-1).
        task: The per-task row it counts in (the ``group_by`` column's value, or the environment's
            name when several are routed); ``None``: only the whole run's.
        prompt: The prompt messages, the environment's ``reset`` text included.
        completion: The messages generated after the prompt (assistant turns and tool results).
        reward: The sum of the reward sources (``None``: the episode failed, or no source scored it).
        rewards: Each source's reward (reward functions by name, the environment by class name).
        success: ``reward >= success_threshold``.
        tool_calls: Tool calls made.
        failed_tool_calls: Those that failed (an unknown tool, bad arguments, the tool raised).
        malformed_tool_calls: Turns whose call markup parsed into no call.
        turns: Sampling requests.
        prompt_tokens: Tokens of the first turn's prompt.
        completion_tokens: Tokens sampled, over every turn.
        truncated: The last turn was cut at ``max_completion_length``.
        policy_version: The policy version the episode was sampled under (0 outside training).
        error: Why the episode failed (it then counts as unsuccessful), else ``None``.
        duration_s: Wall time of the episode.
    """

    row_index: int
    sample_index: int
    task: str | None = None
    prompt: list[dict[str, Any]] = field(default_factory=list)
    completion: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    rewards: dict[str, float | None] = field(default_factory=dict)
    success: bool = False
    tool_calls: int = 0
    failed_tool_calls: int = 0
    malformed_tool_calls: int = 0
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    truncated: bool = False
    policy_version: int = 0
    error: str | None = None
    duration_s: float = 0.0

    def to_json(self) -> str:
        """One line of ``results.jsonl`` (values JSON cannot hold, such as a tool's bytes, as strings)."""
        return json.dumps(dataclasses.asdict(self), default=str, ensure_ascii=False)

    @classmethod
    def from_json(cls, line: str) -> EpisodeResult:
        """Read back one line of ``results.jsonl`` (fields it does not know are ignored)."""
        data = json.loads(line)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass
class EvalSummary:
    """The figures of a set of episodes (the whole run, or one task's).

    Attributes:
        episodes: Episodes run (failed ones included).
        failed_episodes: Episodes that could not run to the end (an environment error...).
        success_rate: Successful episodes / episodes, with its Wilson 95 % interval.
        mean_reward: Mean reward over the scored episodes, with its 95 % interval.
        pass_at_k: ``{k: pass@k}`` for ``k`` in ``1..n`` (unbiased estimator, over the prompts).
        tool_calls_per_episode: Mean tool calls.
        failed_tool_call_frac: Failed tool calls / tool calls (0 with none).
        malformed_per_episode: Mean turns whose call markup parsed into no call.
        mean_turns: Mean sampling requests per episode.
        mean_completion_tokens: Mean tokens sampled per episode.
        truncated_frac: Episodes whose last turn was cut at ``max_completion_length``.
        tasks: One summary per task (empty when the episodes have no task).
    """

    episodes: int
    failed_episodes: int
    success_rate: Estimate
    mean_reward: Estimate
    pass_at_k: dict[int, float]
    tool_calls_per_episode: float
    failed_tool_call_frac: float
    malformed_per_episode: float
    mean_turns: float
    mean_completion_tokens: float
    truncated_frac: float
    tasks: dict[str, EvalSummary] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The summary as JSON-ready data (``summary.json``'s ``results``)."""
        data = dataclasses.asdict(self)
        data["pass_at_k"] = {str(k): v for k, v in self.pass_at_k.items()}
        data["tasks"] = {name: task.to_json() for name, task in self.tasks.items()}
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> EvalSummary:
        """Read back :meth:`to_json`'s data."""
        values = dict(data)
        values["success_rate"] = Estimate(**values["success_rate"])
        values["mean_reward"] = Estimate(**values["mean_reward"])
        values["pass_at_k"] = {int(k): float(v) for k, v in values["pass_at_k"].items()}
        values["tasks"] = {name: cls.from_json(task) for name, task in values.get("tasks", {}).items()}
        return cls(**values)

    def metrics(self, prefix: str = "eval") -> dict[str, float]:
        """Flat values to log, named as ``transformers`` names evaluation metrics: ``eval_success_rate``,
        ``eval_pass@4``, ``eval_task/<task>/success_rate`` (``report_to`` shows them as ``eval/...``;
        ``metric_for_best_model="success_rate"`` picks one)."""
        values = {
            "episodes": float(self.episodes),
            "failed_episodes": float(self.failed_episodes),
            "success_rate": self.success_rate.value,
            "success_rate_low": self.success_rate.low,
            "success_rate_high": self.success_rate.high,
            "mean_reward": self.mean_reward.value,
            "mean_reward_low": self.mean_reward.low,
            "mean_reward_high": self.mean_reward.high,
            "tool_calls_per_episode": self.tool_calls_per_episode,
            "failed_tool_call_frac": self.failed_tool_call_frac,
            "malformed_per_episode": self.malformed_per_episode,
            "mean_turns": self.mean_turns,
            "mean_completion_tokens": self.mean_completion_tokens,
            "truncated_frac": self.truncated_frac,
        }
        values.update({f"pass@{k}": v for k, v in self.pass_at_k.items()})
        for name, task in self.tasks.items():
            values[f"task/{name}/success_rate"] = task.success_rate.value
            values[f"task/{name}/mean_reward"] = task.mean_reward.value
        return {f"{prefix}_{name}": value for name, value in values.items()}


def _mean(values: Iterable[float]) -> float:
    collected = list(values)
    return math.fsum(collected) / len(collected) if collected else math.nan


def _summarize_one(episodes: Sequence[EpisodeResult]) -> EvalSummary:
    per_prompt: dict[int, list[bool]] = {}
    for e in episodes:
        per_prompt.setdefault(e.row_index, []).append(e.success)
    calls = sum(e.tool_calls for e in episodes)
    return EvalSummary(
        episodes=len(episodes),
        failed_episodes=sum(e.error is not None for e in episodes),
        success_rate=proportion_estimate(sum(e.success for e in episodes), len(episodes)),
        mean_reward=mean_estimate([e.reward for e in episodes if e.reward is not None]),
        pass_at_k=pass_at_k_curve([(len(s), sum(s)) for s in per_prompt.values()]),
        tool_calls_per_episode=_mean(e.tool_calls for e in episodes),
        failed_tool_call_frac=sum(e.failed_tool_calls for e in episodes) / calls if calls else 0.0,
        malformed_per_episode=_mean(e.malformed_tool_calls for e in episodes),
        mean_turns=_mean(e.turns for e in episodes),
        mean_completion_tokens=_mean(e.completion_tokens for e in episodes),
        truncated_frac=_mean(float(e.truncated) for e in episodes),
    )


def summarize(episodes: Sequence[EpisodeResult]) -> EvalSummary:
    """The whole run's summary, with one per task when the episodes name tasks."""
    summary = _summarize_one(episodes)
    by_task: dict[str, list[EpisodeResult]] = {}
    for e in episodes:
        if e.task is not None:
            by_task.setdefault(e.task, []).append(e)
    summary.tasks = {name: _summarize_one(by_task[name]) for name in sorted(by_task, key=_natural_key)}
    return summary


def _natural_key(name: str) -> tuple[int, float, str]:
    """Numbers in numeric order before other names (``target=2`` before ``target=10``)."""
    value = name.rpartition("=")[2]
    try:
        return 0, float(value), name
    except ValueError:
        return 1, 0.0, name


# ----------------------------------------------------------------------------------- files
def write_run(output_dir: str | Path, episodes: Sequence[EpisodeResult], summary: EvalSummary,
              about: Mapping[str, Any]) -> Path:
    """Write ``results.jsonl`` and ``summary.json`` into ``output_dir`` (created); returns the folder.

    Args:
        output_dir: The run's folder.
        episodes: Every episode, in the order they finished.
        summary: :func:`summarize` of them.
        about: What was evaluated (model, environment, settings): ``summary.json``'s ``run``.
    """
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    ordered = sorted(episodes, key=lambda e: (e.row_index, e.sample_index))
    (folder / RESULTS_FILE).write_text("".join(e.to_json() + "\n" for e in ordered), encoding="utf-8")
    document = {"run": dict(about), "results": summary.to_json()}
    (folder / SUMMARY_FILE).write_text(json.dumps(document, indent=2, default=str) + "\n", encoding="utf-8")
    return folder


def read_episodes(run: str | Path) -> list[EpisodeResult]:
    """The episodes of a run folder (or of its ``results.jsonl`` given directly).

    Raises:
        ConfigError: There is no ``results.jsonl`` there, or a line of it is not an episode.
    """
    path = Path(run)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: pass the folder of a toolgym eval run (its --output_dir), "
                          f"which holds {RESULTS_FILE} and {SUMMARY_FILE}")
    episodes = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            episodes.append(EpisodeResult.from_json(line))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{path}:{number} is not an episode record of toolgym eval ({exc})") from None
    return episodes


# ----------------------------------------------------------------------------------- table
def _percent(estimate: Estimate) -> str:
    if math.isnan(estimate.value):
        return "-"
    return f"{estimate.value:6.1%} [{estimate.low:.1%}, {estimate.high:.1%}]"


def _reward(estimate: Estimate) -> str:
    if math.isnan(estimate.value):
        return "-"
    return f"{estimate.value:6.3f} [{estimate.low:.3f}, {estimate.high:.3f}]"


_COLUMNS = ("episodes", "success (95% CI)", "mean reward (95% CI)", "calls/ep", "failed calls", "malformed/ep",
            "turns", "tokens")


def _row(name: str, s: EvalSummary) -> list[str]:
    episodes = f"{s.episodes}" + (f" ({s.failed_episodes} failed)" if s.failed_episodes else "")
    return [name, episodes, _percent(s.success_rate), _reward(s.mean_reward), f"{s.tool_calls_per_episode:.2f}",
            f"{s.failed_tool_call_frac:.1%}", f"{s.malformed_per_episode:.2f}", f"{s.mean_turns:.2f}",
            f"{s.mean_completion_tokens:.1f}"]


def _render(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths,
                                                                                                     strict=True)))
            for r in [header, *rows]]


def format_table(summary: EvalSummary) -> str:
    """The summary as a text table: the whole run, one row per task, then pass@k."""
    rows = [_row("all", summary)] + [_row(name, task) for name, task in summary.tasks.items()]
    lines = _render(["", *_COLUMNS], rows)
    if summary.pass_at_k:
        n = max(summary.pass_at_k)
        shown = [k for k in TABLE_PASS_AT_K if k < n] + [n]
        lines.append("pass@k  " + "  ".join(f"k={k}: {summary.pass_at_k[k]:.1%}" for k in shown))
    return "\n".join(lines)


# ------------------------------------------------------------------------------ comparison
@dataclass
class RunComparison:
    """Run B against run A: success rates and mean rewards, overall and per task.

    Attributes:
        success: ``B - A`` of the success rates (Newcombe interval, two-proportion z-test).
        reward: ``B - A`` of the mean rewards (Welch interval); ``None`` with fewer than two scored episodes.
        a: Run A's summary.
        b: Run B's summary.
        tasks: The same per task both runs have: ``{task: (success, reward)}``.
    """

    success: Difference
    reward: Difference | None
    a: EvalSummary
    b: EvalSummary
    tasks: dict[str, tuple[Difference, Difference | None]] = field(default_factory=dict)


def _differences(a: Sequence[EpisodeResult], b: Sequence[EpisodeResult]) -> tuple[Difference, Difference | None]:
    success = compare_proportions(sum(e.success for e in a), len(a), sum(e.success for e in b), len(b))
    rewards_a = [e.reward for e in a if e.reward is not None]
    rewards_b = [e.reward for e in b if e.reward is not None]
    reward = compare_means(rewards_a, rewards_b) if len(rewards_a) > 1 and len(rewards_b) > 1 else None
    return success, reward


def compare_runs(run_a: str | Path, run_b: str | Path) -> RunComparison:
    """Compare two run folders of ``toolgym eval`` (B minus A).

    Raises:
        ConfigError: A folder holds no episodes.
    """
    a, b = read_episodes(run_a), read_episodes(run_b)
    for run, episodes in ((run_a, a), (run_b, b)):
        if not episodes:
            raise ConfigError(f"{run} holds no episode: its evaluation stopped before the first one finished")
    success, reward = _differences(a, b)
    tasks_a = {e.task for e in a if e.task is not None}
    tasks_b = {e.task for e in b if e.task is not None}
    tasks = {task: _differences([e for e in a if e.task == task], [e for e in b if e.task == task])
             for task in sorted(tasks_a & tasks_b, key=_natural_key)}
    return RunComparison(success=success, reward=reward, a=summarize(a), b=summarize(b), tasks=tasks)


def _difference_cells(d: Difference | None, percent: bool) -> list[str]:
    if d is None:
        return ["-", "-", "-"]
    if percent:
        return [f"{d.value:+.1%}", f"[{d.low:+.1%}, {d.high:+.1%}]", f"z={d.z:+.2f} p={d.p_value:.3g}"]
    return [f"{d.value:+.3f}", f"[{d.low:+.3f}, {d.high:+.3f}]", f"z={d.z:+.2f} p={d.p_value:.3g}"]


def format_comparison(comparison: RunComparison, name_a: str = "A", name_b: str = "B") -> str:
    """The comparison as a text table: each run's figures, then B - A with its interval and test."""
    header = ["", "episodes", f"success {name_a}", f"success {name_b}", f"{name_b} - {name_a}", "95% CI",
              "two-proportion test"]
    rows = []
    summaries = {"all": (comparison.a, comparison.b)} | {
        t: (comparison.a.tasks[t], comparison.b.tasks[t]) for t in comparison.tasks}
    differences = {"all": (comparison.success, comparison.reward)} | comparison.tasks
    for name, (success, _) in differences.items():
        a, b = summaries[name]
        rows.append([name, f"{a.episodes}/{b.episodes}", f"{a.success_rate.value:.1%}", f"{b.success_rate.value:.1%}",
                     *_difference_cells(success, percent=True)])
    lines = _render(header, rows)
    reward = comparison.reward
    lines.append(f"mean reward: {comparison.a.mean_reward.value:.3f} -> {comparison.b.mean_reward.value:.3f}, "
                 + ("difference " + " ".join(_difference_cells(reward, percent=False)) if reward is not None
                    else "too few scored episodes to compare"))
    return "\n".join(lines)
