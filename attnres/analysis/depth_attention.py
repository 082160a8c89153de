"""The picture of depth attention that `attnres demo` and `attnres inspect` both draw: the same grid, the same source
names and the same caption, so that the two can be read side by side.

A step in front of sublayer l attends over b_0 (the embedding), the blocks completed before l and, inside a block,
the partial sum of that block so far (docs/design.md §4); the weights arrive in that order
(`AttnResModel.depth_attention_weights`). On the common grid the rows are the mixing steps in sublayer order, the
output step last, and the columns are b0 .. bN, then the partial sum.
"""

import math
import re
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch


SOURCES_CAPTION = (
    "Sources: b0 = the embedding; b1, b2, ... = the completed blocks, each the sum of its sublayers' outputs; "
    "partial = the running sum of the current block (the outputs of the sublayers before this one in its block)."
)

# `layers.3.mlp_residual`, `output_residual`, also below PEFT's wrapper (`….attn_residual.modules_to_save.default`).
_MIXING_STEP = re.compile(r"(?:layers\.(\d+)\.)?(attn|mlp|output)_residual")


@dataclass
class DepthAttentionTable:
    """Mean depth-attention weights on the common grid: `values[step, source]`, NaN where a step has no such source."""

    values: torch.Tensor
    steps: list[str]  # `attn 0`, `mlp 0`, ..., `output`
    sources: list[str]  # `b0 (embedding)`, `b1`, ..., `partial`


def tabulate_depth_attention(
    weights: Mapping[str, Sequence[float] | torch.Tensor], block_size: int, num_sublayers: int
) -> DepthAttentionTable:
    """Each mixing step's mean weights (module name -> one weight per source, in the model's order) on the grid, for
    every step of a model with `num_sublayers` sublayers (`AttnResModel.depth_attention_weights`). The steps' positions
    are their order: by layer, the mixer's (`attn_residual`) before the MLP's, so that a layer of one mixer and no
    MLP (Mamba's) holds one position.

    The partial-sum column is left out where no step reads one (Full AttnRes, where every block is one sublayer).
    """
    num_blocks = math.ceil(num_sublayers / block_size)
    values = torch.full((num_sublayers + 1, num_blocks + 2), math.nan)
    steps = [""] * (num_sublayers + 1)
    named = {name: _MIXING_STEP.search(name).groups() for name in weights}
    in_order = sorted(
        (name for name, (_, kind) in named.items() if kind != "output"),
        key=lambda name: (int(named[name][0]), named[name][1] == "mlp"),
    )
    positions = {name: position for position, name in enumerate(in_order, start=1)}
    for name, step_weights in weights.items():
        layer, kind = named[name]
        position = num_sublayers + 1 if kind == "output" else positions[name]
        completed = num_blocks + 1 if kind == "output" else (position - 1) // block_size + 1  # b0 and the blocks
        step_values = torch.as_tensor(step_weights, dtype=torch.float32)
        values[position - 1, :completed] = step_values[:completed]
        if step_values.numel() > completed:
            values[position - 1, -1] = step_values[completed]
        steps[position - 1] = "output" if kind == "output" else f"{kind} {layer}"
    sources = ["b0 (embedding)", *(f"b{i}" for i in range(1, num_blocks + 1)), "partial"]
    if values[:, -1].isnan().all():
        values, sources = values[:, :-1], sources[:-1]
    return DepthAttentionTable(values, steps, sources)


def draw_depth_attention(tables: Sequence[tuple[str, DepthAttentionTable]], path: str | Path, title: str = "") -> Path:
    """A PNG with one row per `(name, table)`: the mean weight each mixing step gives each source, and its change from
    uniform attention (1 / number of sources: a converted model's start), where training shows what it learned.

    Uses matplotlib's object API, leaving pyplot's global state alone.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = max(len(table.sources) for _, table in tables)
    height = sum(1.2 + 0.16 * len(table.steps) for _, table in tables)
    figure = Figure(figsize=(3.0 + 0.9 * width, 1.2 + height), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(len(tables), 2, squeeze=False)
    for (name, table), (left, right) in zip(tables, axes):
        uniform = 1.0 / (~table.values.isnan()).sum(dim=1, keepdim=True)
        change = table.values - uniform
        limit = max(change.nan_to_num().abs().max().item(), 1e-6)
        panels = [
            (left, table.values, "viridis", 0.0, 1.0, "weight", "depth attention"),
            (right, change, "RdBu_r", -limit, limit, "weight - uniform", "change from uniform (a conversion's start)"),
        ]
        for axis, values, cmap, vmin, vmax, label, heading in panels:
            image = axis.imshow(values.numpy(), cmap=cmap, vmin=vmin, vmax=vmax, aspect="auto", interpolation="nearest")
            axis.set_xticks(range(len(table.sources)), table.sources, rotation=90, fontsize=7)
            axis.set_xlabel("source")
            axis.set_yticks(range(len(table.steps)), table.steps, fontsize=6)
            axis.set_title(f"{name}: {heading}" if name else heading, fontsize=9)
            figure.colorbar(image, ax=axis, label=label, shrink=0.8)
        left.set_ylabel("depth-mixing step (sublayer order)")
    if title:
        figure.suptitle(title, fontsize=10)
    figure.supxlabel("\n".join(textwrap.wrap(SOURCES_CAPTION, int(12 * (3.0 + 0.9 * width)))), fontsize=7)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    return path
