"""The task suites shipped with the package and how they are found, checked and loaded through lm-eval.

Each benchmark is an lm-eval *group* in `attnres/eval/tasks/**.yaml` that wraps lm-eval's own task for it, fixes the
shot count (`num_fewshot`) and names the reported metric (its first `aggregate_metric_list` entry). A *suite* is a
group whose members are benchmarks: `attnres_paper` (the paper's table) and `attnres_smoke` (offline CI data).

lm-eval instantiating a task downloads its dataset, so everything that can be decided before that (which benchmarks,
which lm-eval tasks they reach, whether they execute code or need optional packages) is read from the YAML index
instead; only `load_benchmark` touches data, and it turns a missing dataset into an error that says how to supply it.
"""

import copy
import dataclasses
import functools
import importlib.util
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from lm_eval.api.group import Group
from lm_eval.config.group import GroupConfig
from lm_eval.tasks import TaskManager


TASKS_DIR = Path(__file__).resolve().parent / "tasks"
PAPER_SUITE = "attnres_paper"
SMOKE_SUITE = "attnres_smoke"
_GROUP_FIELDS = frozenset(field.name for field in dataclasses.fields(GroupConfig))


class DatasetUnavailableError(RuntimeError):
    """A benchmark's dataset could not be loaded (typically: no Hub access and nothing cached)."""


class CodeExecutionNotAllowedError(RuntimeError):
    """A requested benchmark executes model-written code and the caller did not opt in."""


class MissingExtraError(ImportError):
    """A requested benchmark needs Python packages from an optional extra that is not installed."""


@dataclasses.dataclass(frozen=True)
class Benchmark:
    """One row of a results table: an lm-eval group of this package and what it reports."""

    name: str
    title: str
    lm_eval_tasks: tuple[str, ...]
    num_fewshot: int
    metric: str
    metric_filter: str
    notes: str
    requires_modules: tuple[str, ...] = ()
    extra: str | None = None

    @property
    def result_key(self) -> str:
        """The key of the reported number in lm-eval's `results[self.name]` dict."""
        return f"{self.metric},{self.metric_filter}"

    @classmethod
    def from_group_config(cls, config: dict[str, Any]) -> "Benchmark":
        members = config["task"] if isinstance(config["task"], list) else [config["task"]]
        aggregate = config["aggregate_metric_list"][0]
        filters = aggregate.get("filter_list", "none")
        metadata = config.get("metadata") or {}
        return cls(
            name=config["group"],
            title=config.get("group_alias") or config["group"],
            lm_eval_tasks=tuple(member if isinstance(member, str) else _member_name(member) for member in members),
            num_fewshot=int(config["num_fewshot"]),
            metric=aggregate["metric"],
            metric_filter=filters if isinstance(filters, str) else filters[0],
            notes=metadata.get("notes", ""),
            requires_modules=tuple(metadata.get("requires_modules", ())),
            extra=metadata.get("extra"),
        )


def _member_name(member: dict[str, Any]) -> str:
    return member.get("group") or member["task"]


@functools.lru_cache(maxsize=4)
def task_manager(include_paths: tuple[str, ...] = (), include_defaults: bool = True) -> TaskManager:
    """An lm-eval `TaskManager` that knows this package's tasks, plus `include_paths` (which win on name clashes).

    Indexing lm-eval's ~15k built-in YAML files takes tens of seconds, so managers are cached per argument set, and
    suites that only use tasks shipped here (the smoke suite) are indexed with `include_defaults=False`.
    """
    return TaskManager(include_path=[str(TASKS_DIR), *include_paths], include_defaults=include_defaults)


def local_task_manager(include_paths: Iterable[str | os.PathLike] = ()) -> TaskManager:
    """The cheap manager over this package's YAML (and the user's) only: enough to resolve suites and benchmarks."""
    return task_manager(tuple(str(path) for path in include_paths), include_defaults=False)


def resolve_benchmarks(
    names: Sequence[str] | None = None, include_paths: Iterable[str | os.PathLike] = ()
) -> list[Benchmark]:
    """Expand suite and benchmark names (default: the paper suite) into benchmarks, in order, without duplicates."""
    index = local_task_manager(include_paths).task_index
    benchmarks: dict[str, Benchmark] = {}

    def visit(name: str) -> None:
        entry = index.get(name)
        config = entry.cfg if entry is not None else None
        if config is None or "group" not in config:
            known = sorted(n for n, e in index.items() if e.cfg and "group" in e.cfg)
            raise KeyError(f"'{name}' is not a benchmark or suite of the attnres task suites; known names: {known}")
        if "aggregate_metric_list" in config:
            benchmarks.setdefault(name, Benchmark.from_group_config(config))
            return
        for member in config["task"]:
            visit(member if isinstance(member, str) else _member_name(member))

    for name in names or [PAPER_SUITE]:
        visit(name)
    return list(benchmarks.values())


def needs_lm_eval_tasks(benchmarks: Iterable[Benchmark], include_paths: Iterable[str | os.PathLike] = ()) -> bool:
    """Whether any benchmark wraps one of lm-eval's built-in tasks (so the full, slow-to-build index is needed)."""
    index = local_task_manager(include_paths).task_index
    return any(task not in index for benchmark in benchmarks for task in benchmark.lm_eval_tasks)


def leaf_task_configs(manager: TaskManager, name: str, overrides: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """The raw configs (functions unresolved, group overrides applied) of every task `name` expands to.

    This mirrors how lm-eval's task factory walks groups, tags and inline members, but stops short of building
    tasks, which would download their datasets.
    """
    overrides = overrides or {}
    entry = manager.task_index.get(name)
    if entry is None:
        raise KeyError(f"lm-eval knows no task, group or tag named '{name}'")
    if entry.cfg is None:  # a tag: the tasks that carry it
        return [config for tag_member in sorted(entry.tags) for config in leaf_task_configs(manager, tag_member, overrides)]
    if "group" not in entry.cfg:
        return [{**copy.deepcopy(entry.cfg), **overrides}]
    return _group_leaf_configs(manager, entry.cfg, overrides)


def _group_leaf_configs(manager: TaskManager, config: dict[str, Any], overrides: dict[str, Any]) -> list[dict[str, Any]]:
    group_overrides = {key: value for key, value in config.items() if key not in _GROUP_FIELDS}
    overrides = {**group_overrides, **overrides}
    members = config["task"] if isinstance(config["task"], list) else [config["task"]]
    leaves = []
    for member in members:
        if isinstance(member, str):
            leaves += leaf_task_configs(manager, member, overrides)
        elif "group" in member and member["group"] not in manager.task_index:  # an inline group definition
            leaves += _group_leaf_configs(manager, member, overrides)
        else:
            name = _member_name(member)
            member_overrides = {key: value for key, value in member.items() if key not in ("group", "task")}
            if name in manager.task_index:
                leaves += leaf_task_configs(manager, name, {**overrides, **member_overrides})
            else:  # an inline task definition
                leaves.append({**overrides, **member})
    return leaves


def check_requirements(benchmark: Benchmark, manager: TaskManager, *, allow_code_execution: bool) -> None:
    """Fail before any model work if `benchmark` cannot run: code execution not allowed, optional extra missing."""
    leaves = leaf_task_configs(manager, benchmark.name)
    if any(leaf.get("unsafe_code") for leaf in leaves) and not allow_code_execution:
        raise CodeExecutionNotAllowedError(
            f"Benchmark '{benchmark.title}' ({benchmark.name}) executes model-written code to score it. Run it only "
            "in a sandbox you trust, and opt in with `--allow-code-execution` (Python: allow_code_execution=True), "
            "which sets HF_ALLOW_CODE_EVAL=1 and lm-eval's confirm_run_unsafe_code."
        )
    missing = [module for module in benchmark.requires_modules if importlib.util.find_spec(module) is None]
    if missing:
        install = f"pip install 'attnres[{benchmark.extra}]'" if benchmark.extra else f"pip install {' '.join(missing)}"
        raise MissingExtraError(
            f"Benchmark '{benchmark.title}' ({benchmark.name}) needs the Python modules {', '.join(missing)}: {install}"
        )


def load_benchmark(benchmark: Benchmark, manager: TaskManager) -> Group:
    """Build the benchmark's lm-eval group, datasets included; a dataset that cannot be loaded names its remedy."""
    try:
        return manager.load(benchmark.name)["groups"][benchmark.name]
    except OSError as error:  # datasets raises ConnectionError / FileNotFoundError subclasses when data is unreachable
        raise DatasetUnavailableError(_unavailable_message(benchmark, manager, error)) from error


def _unavailable_message(benchmark: Benchmark, manager: TaskManager, error: OSError) -> str:
    leaves = leaf_task_configs(manager, benchmark.name)
    sources: dict[str, set[str]] = {}
    for leaf in leaves:
        if leaf.get("dataset_path"):
            sources.setdefault(leaf["dataset_path"], set()).add(leaf.get("dataset_name") or "default")
    described = ", ".join(
        f"{path} ({len(configs)} configurations)" if len(configs) > 1 else f"{path} ({next(iter(configs))})"
        for path, configs in sources.items()
    )
    example = leaves[0]
    example_entry = manager.task_index.get(example["task"])
    example_yaml = example_entry.yaml_path if example_entry is not None else "<the YAML that defines it>"
    return (
        f"Benchmark '{benchmark.title}' (task group '{benchmark.name}', {len(leaves)} lm-eval task(s) starting with "
        f"'{example['task']}') could not load its data: {error}\n"
        f"It reads the Hugging Face Hub dataset(s): {described or 'none declared'}.\n"
        "To evaluate without Hub access, either\n"
        f"  * cache the data where the Hub is reachable (for example `attnres eval MODEL --tasks {benchmark.name} "
        "--limit 1`), copy the Hugging Face cache ($HF_HOME, default ~/.cache/huggingface) to this machine and set "
        "HF_DATASETS_OFFLINE=1 and HF_HUB_OFFLINE=1 so it is read without network calls; or\n"
        "  * point the task at a local copy: in a folder of your own, write a YAML file containing\n"
        f"      task: {example['task']}\n"
        f"      include: {example_yaml}\n"
        "      dataset_path: /path/to/local/copy   # a saved dataset folder, or `json` / `parquet` plus\n"
        "      dataset_kwargs: {data_files: {test: /path/to/test.jsonl}}   # ...the files of each split\n"
        "    and pass the folder with `--include-path` (Python: include_path=[...]); your YAML overrides the shipped "
        "one of the same task name."
    )
