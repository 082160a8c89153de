"""`evaluate`: run the attnres task suites on an AttnRes model (and optionally a baseline) through lm-eval's Python
API, and write the raw results, the paper-layout table and a bar chart."""

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lm_eval
import torch
from lm_eval.api.model import LM
from lm_eval.models.huggingface import HFLM
from lm_eval.utils import handle_non_serializable
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from ..inputs import ModelSource, check_model_source
from .paper import PAPER_MODEL
from .report import TableRow, build_rows, plot_bar_chart, render_markdown_table, render_settings
from .suite import (
    Benchmark,
    check_requirements,
    load_benchmark,
    needs_lm_eval_tasks,
    resolve_benchmarks,
    task_manager,
)


ModelSpec = str | os.PathLike | PreTrainedModel | LM


@dataclasses.dataclass
class EvalReport:
    """What `evaluate` produced: the table rows, lm-eval's raw outputs and the files written."""

    benchmarks: list[Benchmark]
    rows: list[TableRow]
    results: dict[str, Any]
    baseline_results: dict[str, Any] | None
    markdown: str
    files: dict[str, Path]


def evaluate(
    model: ModelSpec,
    baseline: ModelSpec | None = None,
    tasks: Sequence[str] | None = None,
    limit: int | float | None = None,
    batch_size: int | str = 1,
    output_dir: str | os.PathLike = "attnres_eval",
    *,
    tokenizer: PreTrainedTokenizerBase | str | None = None,
    baseline_tokenizer: PreTrainedTokenizerBase | str | None = None,
    device: str | None = None,
    dtype: str | torch.dtype = "auto",
    allow_code_execution: bool = False,
    include_path: Sequence[str | os.PathLike] = (),
) -> EvalReport:
    """Evaluate `model` (and `baseline`) on attnres benchmarks and write `output_dir/{results_attnres.json,
    results_baseline.json, table.md, chart.png}`.

    Args:
        model: the AttnRes model: a local folder, a `.gguf` file, a Hub id, a loaded `PreTrainedModel` (then give
            `tokenizer`), or any lm-eval `LM`.
        baseline: the model to compare against, in the same forms; its column stays empty when omitted.
        tasks: suite or benchmark names (`attnres_paper`, `attnres_smoke`, `attnres_paper_gsm8k`, ...); defaults to
            the paper suite.
        limit: examples per lm-eval task (an int, or a fraction below 1). Scores then are not comparable with the
            paper's; use it for smoke runs.
        batch_size: lm-eval batch size (`"auto"` lets lm-eval search on GPU).
        tokenizer, baseline_tokenizer: tokenizers (or their folders) for models passed as `PreTrainedModel`; by default
            loaded from the model's `name_or_path`.
        device, dtype: where and in which dtype models given by path are loaded (default: CUDA when available,
            the checkpoint's dtype).
        allow_code_execution: opt in to benchmarks that execute model-written code (HumanEval, MBPP). Sets
            `HF_ALLOW_CODE_EVAL=1` in this process and lm-eval's `confirm_run_unsafe_code`.
        include_path: extra folders of lm-eval YAML; a task defined there replaces the shipped one of the same name
            (the way to point a task at a local dataset copy).

    Raises:
        FileNotFoundError, ValueError: before any work, for a model path that does not exist or is not a model, or a
            bad `limit` or `batch_size`.
        CodeExecutionNotAllowedError, MissingExtraError: before any model work, when a benchmark cannot run.
        DatasetUnavailableError: when a benchmark's dataset cannot be loaded; the message says how to supply it.
    """
    _check_model_spec("model", model)
    if baseline is not None:
        _check_model_spec("baseline", baseline)
    _check_limit(limit)
    _check_batch_size(batch_size)
    include_paths = tuple(str(path) for path in include_path)
    benchmarks = resolve_benchmarks(tasks, include_paths)
    manager = task_manager(include_paths, include_defaults=needs_lm_eval_tasks(benchmarks, include_paths))
    for benchmark in benchmarks:
        check_requirements(benchmark, manager, allow_code_execution=allow_code_execution)
    if allow_code_execution:
        os.environ["HF_ALLOW_CODE_EVAL"] = "1"

    def run(spec: ModelSpec, spec_tokenizer: PreTrainedTokenizerBase | str | None) -> dict[str, Any]:
        lm = as_lm(spec, spec_tokenizer, batch_size=batch_size, device=device, dtype=dtype)
        # Fresh task objects per model: lm-eval stores each run's requests on them.
        groups = [load_benchmark(benchmark, manager) for benchmark in benchmarks]
        return lm_eval.simple_evaluate(
            model=lm,
            tasks=groups,
            task_manager=manager,
            limit=limit,
            log_samples=False,
            confirm_run_unsafe_code=allow_code_execution,
        )

    results = run(model, tokenizer)
    baseline_results = run(baseline, baseline_tokenizer) if baseline is not None else None

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    files = {"results": output_dir / "results_attnres.json"}
    _write_json(results, files["results"])
    if baseline_results is not None:
        files["baseline_results"] = output_dir / "results_baseline.json"
        _write_json(baseline_results, files["baseline_results"])

    rows = build_rows(benchmarks, results, baseline_results)
    caveat = f" with --limit {limit}: not comparable with the paper" if limit is not None else ""
    markdown = (
        f"# AttnRes evaluation{caveat}\n\n"
        f"AttnRes: `{_describe(model)}`; baseline: `{_describe(baseline) if baseline is not None else 'not run'}`. "
        f"Paper columns: {PAPER_MODEL} (arXiv:2603.15031).\n\n"
        f"{render_markdown_table(rows)}\n"
        f"## Settings\n\n{render_settings(benchmarks)}"
    )
    files["table"] = output_dir / "table.md"
    files["table"].write_text(markdown, encoding="utf-8")
    files["chart"] = plot_bar_chart(rows, output_dir / "chart.png", title=f"AttnRes evaluation{caveat}")
    return EvalReport(benchmarks, rows, results, baseline_results, markdown, files)


def as_lm(
    spec: ModelSpec,
    tokenizer: PreTrainedTokenizerBase | str | None = None,
    *,
    batch_size: int | str = 1,
    device: str | None = None,
    dtype: str | torch.dtype = "auto",
) -> LM:
    """Wrap a model given as an lm-eval `LM`, a loaded `PreTrainedModel` or a path into lm-eval's `HFLM`.

    Models given by path are loaded here rather than by HFLM so that a local folder or a `.gguf` file is read exactly
    as `AutoModelForCausalLM.from_pretrained` reads it (with AttnRes registered by importing this package), without
    HFLM's Hub-oriented defaults (revision, remote code).
    """
    source = _check_model_spec("spec", spec)
    if isinstance(spec, LM):
        return spec
    if source is not None:
        gguf = {"gguf_file": source.gguf_file} if source.gguf_file is not None else {}
        spec = AutoModelForCausalLM.from_pretrained(source.location, dtype=dtype, **gguf)
        spec.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if tokenizer is None:
            tokenizer = AutoTokenizer.from_pretrained(source.location, **gguf)
    if tokenizer is None:
        tokenizer = spec.name_or_path
    if isinstance(tokenizer, str):
        tokenizer = AutoTokenizer.from_pretrained(tokenizer)
    return HFLM(pretrained=spec, tokenizer=tokenizer, backend="causal", batch_size=batch_size)


def _check_model_spec(name: str, spec: ModelSpec) -> ModelSource | None:
    """Where a model given by path is (None for a loaded model or an `LM`); fails for anything else."""
    if isinstance(spec, (PreTrainedModel, LM)):
        return None
    if not isinstance(spec, (str, os.PathLike)):
        allowed = "a model folder, a .gguf file, a Hub id, a PreTrainedModel or an lm-eval LM"
        raise ValueError(f"{name}={spec!r}: must be {allowed}")
    return check_model_source(name, spec)


def _check_limit(limit: int | float | None) -> None:
    whole = isinstance(limit, int) and not isinstance(limit, bool) and limit >= 1
    fraction = isinstance(limit, float) and 0 < limit < 1
    if limit is not None and not (whole or fraction):
        raise ValueError(f"limit={limit!r}: must be None, a positive number of examples, or a fraction in (0, 1)")


def _check_batch_size(batch_size: int | str) -> None:
    """lm-eval's batch sizes: a positive integer, `"auto"`, or `"auto:N"` (search N times)."""
    if isinstance(batch_size, str) and batch_size.startswith("auto"):
        times = batch_size.removeprefix("auto")
        if times == "" or (times.startswith(":") and times[1:].isdigit() and int(times[1:]) > 0):
            return
    elif isinstance(batch_size, int) and not isinstance(batch_size, bool) and batch_size >= 1:
        return
    raise ValueError(f"batch_size={batch_size!r}: must be a positive integer, 'auto' or 'auto:N'")


def _describe(spec: ModelSpec) -> str:
    if isinstance(spec, PreTrainedModel):
        return spec.name_or_path or type(spec).__name__
    if isinstance(spec, LM):
        return type(spec).__name__
    return str(spec)


def _write_json(results: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(results, indent=2, default=handle_non_serializable, ensure_ascii=False), encoding="utf-8")
