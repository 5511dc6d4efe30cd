"""What a person watching a run sees: a live progress table and, at the end, plots (PNG).

:class:`ProgressCallback` prints one row per log (step, reward, groups dropped, completion length,
generation throughput, queue, staleness, step time) with ``rich``; :class:`PlotCallback` writes
``plots/<metric>.png`` under the output directory when training ends (reward,
``frac_zero_std_groups``, completion length, throughput) and :func:`write_plots` does the same for
any log history.
"""

from __future__ import annotations

import math
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
)


class ProgressCallback(TrainerCallback):
    """Prints a progress row at every log, with ``rich`` (one header, aligned columns)."""

    def __init__(self) -> None:
        from rich.console import Console

        self.console = Console(highlight=False)
        self._header_done = False

    def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, float] | None = None, **kw: Any) -> None:
        if not logs or "loss" not in logs or not state.is_world_process_zero:
            return
        row = {**logs, "step": state.global_step}
        if not self._header_done:
            self.console.print(" ".join(f"[bold]{title:>8}[/bold]" for _, title, _ in _COLUMNS))
            self._header_done = True
        cells = []
        for key, _, fmt in _COLUMNS:
            value = row.get(key)
            cells.append(f"{fmt.format(value):>8}" if isinstance(value, (int, float)) and not math.isnan(value)
                         else f"{'-':>8}")
        self.console.print(" ".join(cells))


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
    """Writes the plots under ``<output_dir>/plots`` when training ends."""

    def __init__(self) -> None:
        self.written: list[Path] = []

    def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        if state.is_world_process_zero:
            self.written = write_plots(state.log_history, Path(args.output_dir) / "plots")
