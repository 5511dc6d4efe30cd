"""What a person watching a run sees: a live progress table and, at the end, plots (PNG).

:class:`ProgressCallback` prints one row per log (step, reward, groups dropped, completion length,
generation throughput, queue, staleness, step time, and the seconds the step waited for compilation,
"-" when it compiled nothing) with ``rich``, and one line per evaluation (:func:`eval_row`: success
with its 95 % interval, mean reward, pass@1 and pass@n); :class:`PlotCallback` writes
``plots/<metric>.png`` under the output directory when training ends (reward,
``frac_zero_std_groups``, completion length, throughput) and :func:`write_plots` does the same for
any log history; :func:`display_callbacks` adds both to a trainer as its config's ``progress`` and
``plots`` say. :func:`report_completions` shows sample completions at a log (``log_completions``): a
table on the console, a markdown table in TensorBoard, a ``wandb.Table``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

PLOTTED = {
    "reward": "reward (mean over scored rollouts)",
    "frac_zero_std_groups": "fraction of groups dropped (equal rewards)",
    "completions/mean_length": "completion length (tokens)",
    "rollout/generated_tokens_per_s": "generation throughput (tokens/s)",
}

_COLUMNS = (
    ("step", "step", "{:.0f}"),
    ("reward", "reward", "{:.3f}"),
    ("frac_zero_std_groups", "dropped", "{:.0%}"),
    ("completions/mean_length", "len", "{:.1f}"),
    ("rollout/generated_tokens_per_s", "gen tok/s", "{:,.0f}"),
    ("rollout/queue_size", "queue", "{:.0f}"),
    ("sample/staleness_mean", "stale", "{:.2f}"),
    ("perf/step_s", "step s", "{:.1f}"),
    ("perf/compile_s", "compile s", "{:.1f}"),
)


class ProgressCallback(TrainerCallback):
    """Prints a progress row at every log, with ``rich`` (one header, aligned columns)."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(highlight=False, soft_wrap=True)  # a row stays one line in a log file or pipe
        self._header_done = False

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if logs and "pipeline/stalled_s" in logs and state.is_world_process_zero:
            dropped = ", ".join(f"{int(v)} {k.removeprefix('pipeline/dropped_').removesuffix('_count')}"
                                for k, v in logs.items() if k.startswith("pipeline/dropped_") and v)
            self.console.print(f"[yellow]{'stalled':>8} {logs['pipeline/stalled_s']:.0f} s without a trainable "
                               f"sample; dropped since: {dropped or 'nothing yet'}; stale: "
                               f"{int(logs.get('pipeline/stale_dropped_count', 0))}[/yellow]")
            return
        if logs and "eval_success_rate" in logs and state.is_world_process_zero:
            self.console.print(eval_row(logs, state.global_step))
            return
        if not logs or "loss" not in logs or not state.is_world_process_zero:
            return
        row = {**logs, "step": state.global_step}
        if not row.get("perf/compile_count"):  # no compilation: a dash, not "0.0" seconds
            row.pop("perf/compile_s", None)
        if not self._header_done:
            self.console.print(" ".join(f"[bold]{title:>8}[/bold]" for _, title, _ in _COLUMNS))
            self._header_done = True
        cells = []
        for key, title, fmt in _COLUMNS:
            value = row.get(key)
            width = max(8, len(title))
            cells.append(f"{fmt.format(value):>{width}}" if isinstance(value, (int, float)) and not math.isnan(value)
                         else f"{'-':>{width}}")
        self.console.print(" ".join(cells))


def eval_row(logs: dict[str, float], step: int) -> str:
    """The progress table's line for an evaluation's log (``AsyncGRPOTrainer.evaluate``'s metrics)."""
    def percent(key: str) -> str:
        value = logs.get(key, math.nan)
        return "-" if math.isnan(value) else f"{value:.1%}"

    ks = sorted(int(k.removeprefix("eval_pass@")) for k in logs if k.startswith("eval_pass@"))
    shown = [k for k in ks if k == 1 or k == ks[-1]]
    pass_at = "  ".join(f"pass@{k} {percent(f'eval_pass@{k}')}" for k in shown)
    from rich.markup import escape

    text = (f"{'eval':>8} step {step}: success {percent('eval_success_rate')} "
            f"[{percent('eval_success_rate_low')}, {percent('eval_success_rate_high')}] of "
            f"{logs.get('eval_episodes', 0):.0f} episodes, mean reward {logs.get('eval_mean_reward', math.nan):.3f}, "
            f"{pass_at}, {logs.get('eval_runtime', math.nan):.0f} s")
    return f"[cyan]{escape(text)}[/cyan]"


def write_plots(history: list[dict[str, Any]], folder: str | Path) -> list[Path]:
    """One PNG per plotted metric (values against the optimizer step); returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for key, title in PLOTTED.items():
        points = [(h["step"], h[key]) for h in history if key in h and "step" in h]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3)
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = folder / f"{key.replace('/', '_')}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written


class PlotCallback(TrainerCallback):
    """Writes the plots under ``<output_dir>/plots`` when training ends (and prints their paths if ``announce``)."""

    def __init__(self, announce: bool = False) -> None:
        self.written: list[Path] = []
        self.announce = announce

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.is_world_process_zero:
            self.written = write_plots(state.log_history, Path(args.output_dir) / "plots")
            for path in self.written if self.announce else []:
                print(f"plot: {path}", flush=True)


def display_callbacks(args: Any, callbacks: Sequence[Any] | None) -> list[Any]:
    """``callbacks`` plus what ``args.progress`` and ``args.plots`` ask for (each once, even if given too).

    ``progress="table"`` adds :class:`ProgressCallback` and sets ``args.disable_tqdm`` (so pass the
    trainer's own copy of the config), which makes transformers add its ``PrinterCallback``: the
    trainer removes that one once built. ``plots`` adds :class:`PlotCallback`, announcing its files
    beside the table.
    """
    callbacks = list(callbacks or [])

    def given(kind: type) -> bool:
        return any(isinstance(c, kind) or (isinstance(c, type) and issubclass(c, kind)) for c in callbacks)
    if args.progress == "table":
        args.disable_tqdm = True
        if not given(ProgressCallback):
            callbacks.append(ProgressCallback())
    if args.plots and not given(PlotCallback):
        callbacks.append(PlotCallback(announce=args.progress == "table"))
    return callbacks


@dataclass
class CompletionRecord:
    """One trained sample as ``log_completions`` shows it."""

    step: int
    prompt: str
    completion: str
    reward: float
    advantage: float


def completions_markdown(records: Sequence[CompletionRecord]) -> str:
    """The records as a markdown table (cells on one line, ``|`` escaped)."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| step | prompt | completion | reward | advantage |", "|---|---|---|---|---|"]
    lines += [f"| {r.step} | {cell(r.prompt)} | {cell(r.completion)} | {r.reward:.4g} | {r.advantage:.4g} |"
              for r in records]
    return "\n".join(lines)


def report_completions(records: Sequence[CompletionRecord], step: int, callbacks: Sequence[Any],
                       console: Any = None) -> None:
    """Show ``records`` on the console (a ``rich`` table) and in the active ``report_to`` integrations.

    TensorBoard gets a markdown table under ``completions`` (text tab) at ``step``; Weights & Biases
    a ``wandb.Table`` named ``completions``, when a run is active.

    Args:
        records: The completions to show (already limited to ``num_completions_to_print``).
        step: The optimizer step of the log.
        callbacks: The trainer's callbacks (the integrations are found among them).
        console: A ``rich`` console; a new one on stdout when ``None``.
    """
    from rich.console import Console
    from rich.table import Table

    if not records:
        return
    table = Table(title=f"completions at step {step}", show_lines=True)
    for name in ("prompt", "completion", "reward", "advantage"):
        table.add_column(name, overflow="fold")
    for r in records:
        table.add_row(r.prompt, r.completion, f"{r.reward:.4g}", f"{r.advantage:.4g}")
    (console or Console()).print(table)
    names = {type(cb).__name__: cb for cb in callbacks}
    writer = getattr(names.get("TensorBoardCallback"), "tb_writer", None)
    if writer is not None:
        writer.add_text("completions", completions_markdown(records), step)
        writer.flush()
    if "WandbCallback" in names:
        import wandb

        if wandb.run is not None:
            columns = ["step", "prompt", "completion", "reward", "advantage"]
            rows = [[r.step, r.prompt, r.completion, r.reward, r.advantage] for r in records]
            wandb.log({"completions": wandb.Table(columns=columns, data=rows)})
