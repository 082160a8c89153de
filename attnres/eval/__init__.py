"""lm-eval task suites for AttnRes and the paper-table runner (`attnres eval`).

`attnres_paper` maps each benchmark of the paper's downstream table onto lm-eval's own task with a fixed shot count
and metric; `attnres_smoke` runs the same task formats on data shipped with the package, offline. The YAML lives in
`attnres/eval/tasks` (`TASKS_DIR`), usable directly as lm-eval's `--include_path`.

lm-eval and matplotlib come with the optional `eval` extra, so they are imported on first use of `evaluate` and
friends rather than with this package: `attnres_cli` must start (and `attnres convert` work) without them.
"""

import importlib
from typing import Any

from .paper import PAPER_SCORES, PaperScore


_LAZY = {
    "evaluate": "runner",
    "EvalReport": "runner",
    "as_lm": "runner",
    "render_markdown_table": "report",
    "build_rows": "report",
    "TableRow": "report",
    "Benchmark": "suite",
    "resolve_benchmarks": "suite",
    "TASKS_DIR": "suite",
    "PAPER_SUITE": "suite",
    "SMOKE_SUITE": "suite",
    "CodeExecutionNotAllowedError": "suite",
    "DatasetUnavailableError": "suite",
    "MissingExtraError": "suite",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)


__all__ = [
    "PAPER_SCORES",
    "PAPER_SUITE",
    "SMOKE_SUITE",
    "TASKS_DIR",
    "Benchmark",
    "CodeExecutionNotAllowedError",
    "DatasetUnavailableError",
    "EvalReport",
    "MissingExtraError",
    "PaperScore",
    "TableRow",
    "as_lm",
    "build_rows",
    "evaluate",
    "render_markdown_table",
    "resolve_benchmarks",
]
