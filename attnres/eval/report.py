"""The paper-layout results table (markdown) and bar chart (PNG) built from lm-eval results."""

import dataclasses
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .paper import PAPER_SCORES, PaperScore
from .suite import Benchmark


TABLE_HEADER = ("Benchmark", "Baseline", "AttnRes", "Δ", "Paper baseline", "Paper AttnRes", "Paper Δ")
MISSING = "—"


@dataclasses.dataclass(frozen=True)
class TableRow:
    """One benchmark's scores in percent; `None` where a model was not run or lm-eval reported no number."""

    benchmark: str
    baseline: float | None
    attnres: float | None
    paper: PaperScore | None

    @property
    def delta(self) -> float | None:
        if self.baseline is None or self.attnres is None:
            return None
        return self.attnres - self.baseline


def score(results: dict[str, Any] | None, benchmark: Benchmark) -> float | None:
    """The benchmark's reported number, in percent, from `lm_eval.simple_evaluate` output (`None` if absent)."""
    if results is None:
        return None
    metrics = results["results"].get(benchmark.name, {})
    value = metrics.get(benchmark.result_key)
    if not isinstance(value, (int, float)):
        warnings.warn(
            f"lm-eval reported no '{benchmark.result_key}' for {benchmark.name}; it reported {sorted(metrics)}",
            stacklevel=2,
        )
        return None
    return 100.0 * float(value)


def build_rows(
    benchmarks: Sequence[Benchmark], attnres: dict[str, Any], baseline: dict[str, Any] | None = None
) -> list[TableRow]:
    """Pair each benchmark's scores with the paper's row of the same name (none for benchmarks outside the paper)."""
    return [
        TableRow(
            benchmark=benchmark.title,
            baseline=score(baseline, benchmark),
            attnres=score(attnres, benchmark),
            paper=PAPER_SCORES.get(benchmark.title),
        )
        for benchmark in benchmarks
    ]


def _number(value: float | None) -> str:
    return MISSING if value is None else f"{value:.1f}"


def _signed(value: float | None) -> str:
    # Round before signing so that -0.04 prints as +0.0, not -0.0.
    return MISSING if value is None else f"{round(value, 1) + 0.0:+.1f}"


def render_markdown_table(rows: Sequence[TableRow]) -> str:
    """The paper's layout: benchmark | baseline | AttnRes | Δ | paper baseline | paper AttnRes | paper Δ."""
    lines = [
        "| " + " | ".join(TABLE_HEADER) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(TABLE_HEADER) - 1)) + "|",
    ]
    for row in rows:
        paper = row.paper
        cells = (
            row.benchmark,
            _number(row.baseline),
            _number(row.attnres),
            _signed(row.delta),
            _number(paper.baseline if paper else None),
            _number(paper.attnres if paper else None),
            _signed(paper.delta if paper else None),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def render_settings(benchmarks: Sequence[Benchmark]) -> str:
    """One line per benchmark saying which lm-eval task, shots and metric produced its number."""
    return "".join(
        f"- **{b.title}**: `{b.name}` -> lm-eval `{', '.join(b.lm_eval_tasks)}`, {b.num_fewshot}-shot, "
        f"`{b.result_key}`. {b.notes}\n"
        for b in benchmarks
    )


def plot_bar_chart(rows: Sequence[TableRow], path: str | Path, *, title: str) -> Path:
    """Grouped bars per benchmark: our baseline and AttnRes scores, next to the paper's where it has them."""
    import matplotlib

    matplotlib.use("Agg")  # headless: CI and servers have no display
    import matplotlib.pyplot as plt
    import numpy as np

    series = [
        ("Baseline", [row.baseline for row in rows], "#9e9e9e", None),
        ("AttnRes", [row.attnres for row in rows], "#1f77b4", None),
        ("Paper baseline", [row.paper.baseline if row.paper else None for row in rows], "#e0e0e0", "//"),
        ("Paper AttnRes", [row.paper.attnres if row.paper else None for row in rows], "#aec7e8", "//"),
    ]
    series = [entry for entry in series if any(value is not None for value in entry[1])]
    positions = np.arange(len(rows))
    width = 0.8 / max(len(series), 1)
    figure, axes = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2.0), 4.5))
    for offset, (label, values, color, hatch) in enumerate(series):
        heights = [np.nan if value is None else value for value in values]
        axes.bar(positions + (offset - (len(series) - 1) / 2) * width, heights, width, label=label, color=color,
                 hatch=hatch, edgecolor="#424242", linewidth=0.5)
    axes.set_xticks(positions, [row.benchmark for row in rows], rotation=35, ha="right")
    axes.set_ylabel("score (%)")
    axes.set_title(title)
    axes.legend(fontsize="small", ncols=2)
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
