"""The lm-eval task suites (`attnres/eval`): shipped YAML, the paper-table report, and offline end-to-end runs."""

import ast
import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import yaml
from lm_eval.config.task import TaskConfig
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, PreTrainedTokenizerFast

from attnres import AttnResForCausalLM
from attnres.eval import PAPER_SCORES, PaperScore, evaluate
from attnres.eval.report import TableRow, build_rows, render_markdown_table
from attnres.eval.suite import (
    PAPER_SUITE,
    SMOKE_SUITE,
    TASKS_DIR,
    CodeExecutionNotAllowedError,
    DatasetUnavailableError,
    MissingExtraError,
    check_requirements,
    leaf_task_configs,
    load_benchmark,
    local_task_manager,
    resolve_benchmarks,
    task_manager,
)
from attnres_cli import default_demo_model

from conftest import tiny_config


# lm-eval task count behind each paper benchmark: catches a member that silently expands to nothing or to the wrong set.
EXPECTED_LEAVES = {
    "MMLU": 57, "MMLU-Pro Hard": 14, "GPQA-Diamond": 1, "BBH": 27, "ARC-Challenge": 1, "HellaSwag": 1, "TriviaQA": 1,
    "GSM8K": 1, "MGSM": 11, "Minerva Math": 7, "HumanEval": 1, "MBPP": 1, "CMMLU": 67, "C-Eval": 52,
}  # fmt: skip


@pytest.fixture(scope="module")
def full_manager():
    """lm-eval's built-in tasks plus ours (indexing ~15k YAML files takes ~20 s, so once per module)."""
    return task_manager((), include_defaults=True)


@pytest.fixture
def one_thread():
    """Run model code on one thread: these models are too small to gain from more, and on a shared 2-core CI machine
    oversubscribed OpenMP threads spin and make each forward pass ten times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in memory (no Hub): 3 special tokens + 256 bytes, so any text round-trips."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{char: index + 3 for index, char in enumerate(alphabet)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>")


def tiny_model(tokenizer: PreTrainedTokenizerFast) -> AttnResForCausalLM:
    return AttnResForCausalLM(tiny_config(vocab_size=len(tokenizer), max_position_embeddings=2048)).eval()


# --------------------------------------------------------------------------------------------------- shipped YAML


def test_every_shipped_yaml_is_indexed_by_lm_eval():
    # lm-eval's indexer skips a YAML it cannot parse with only a debug log; every file must become an entry.
    index = local_task_manager().task_index
    indexed = {entry.yaml_path for entry in index.values() if entry.yaml_path is not None}
    shipped = set(TASKS_DIR.rglob("*.yaml"))
    assert len(shipped) == 20
    assert shipped == indexed


def test_paper_suite_is_the_paper_table():
    benchmarks = resolve_benchmarks([PAPER_SUITE])
    assert [benchmark.title for benchmark in benchmarks] == list(PAPER_SCORES)
    assert all(benchmark.notes for benchmark in benchmarks)
    assert len({benchmark.name for benchmark in benchmarks}) == 14


def test_resolving_names_expands_suites_and_rejects_unknown_names():
    names = [benchmark.name for benchmark in resolve_benchmarks([SMOKE_SUITE, "attnres_smoke_mc", "attnres_paper_gsm8k"])]
    assert names == ["attnres_smoke_mc", "attnres_smoke_gen", "attnres_paper_gsm8k"]
    with pytest.raises(KeyError, match="attnres_smoke"):
        resolve_benchmarks(["gsm8k"])  # lm-eval's own task, not one of our benchmarks


def _function_references(path: Path) -> list[str]:
    """The `!function` targets of a YAML file (lm-eval leaves them as '<yaml folder>/<module>.<name>' unresolved)."""

    class Loader(yaml.SafeLoader):
        pass

    found: list[str] = []
    Loader.add_constructor("!function", lambda loader, node: found.append(loader.construct_scalar(node)))
    yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)
    return found


def _defines_function(folder: Path, reference: str) -> bool:
    """Resolve `reference` the way lm-eval does (a module file beside the YAML first, then an importable module) and
    check, without importing it (some task modules need the Hub at import), that the module defines the name."""
    module, _, function = reference.rpartition(".")
    source = folder / f"{module.replace('.', '/')}.py"
    if not source.is_file():
        spec = importlib.util.find_spec(module)
        if spec is None or spec.origin is None:
            return False
        source = Path(spec.origin)
    tree = ast.parse(source.read_text(encoding="utf-8"))
    defined = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    defined |= {  # module-level aliases such as `process_biology = partial(process_docs, ...)`
        target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
        if isinstance(target, ast.Name)
    }  # fmt: skip
    return function in defined


@pytest.mark.parametrize("benchmark", resolve_benchmarks([PAPER_SUITE, SMOKE_SUITE]), ids=lambda b: b.name)
def test_benchmark_resolves_to_lm_eval_tasks_whose_configs_parse(benchmark, full_manager):
    """The strongest check that needs no dataset: every task a benchmark reaches exists in lm-eval, its config parses
    into lm-eval's TaskConfig, inherits the benchmark's shot count, reports the benchmark's metric and filter, and
    every `!function` it names exists."""
    for member in benchmark.lm_eval_tasks:
        assert member in full_manager.task_index, member
    leaves = leaf_task_configs(full_manager, benchmark.name)
    if benchmark.title in EXPECTED_LEAVES:
        assert len(leaves) == EXPECTED_LEAVES[benchmark.title]
    for leaf in leaves:
        structural = {key: leaf.pop(key, None) for key in ("tag", "group", "task_list")}
        config = TaskConfig(**leaf)
        assert config.num_fewshot == benchmark.num_fewshot, config.task
        assert config.dataset_path or config.custom_dataset, config.task
        metric_names = [str(metric["metric"]).rpartition(".")[2] for metric in config.metric_list]
        assert benchmark.metric in metric_names, (config.task, metric_names)
        filters = [entry["name"] for entry in config.filter_list or []] or ["none"]
        assert benchmark.metric_filter in filters, (config.task, filters)
        assert structural["group"] is None
    for path in {full_manager.task_index[leaf["task"]].yaml_path for leaf in leaves}:
        for reference in _function_references(path):
            assert _defines_function(path.parent, reference), (path, reference)


def test_code_execution_requires_opt_in(full_manager, tmp_path):
    humaneval, mbpp = resolve_benchmarks(["attnres_paper_humaneval", "attnres_paper_mbpp"])
    for benchmark in (humaneval, mbpp):
        with pytest.raises(CodeExecutionNotAllowedError, match="--allow-code-execution"):
            check_requirements(benchmark, full_manager, allow_code_execution=False)
        check_requirements(benchmark, full_manager, allow_code_execution=True)
    (arc,) = resolve_benchmarks(["attnres_paper_arc_challenge"])
    check_requirements(arc, full_manager, allow_code_execution=False)
    # evaluate() refuses before it loads any model (the folder holds only an empty config).
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CodeExecutionNotAllowedError):
        evaluate(tmp_path, tasks=["attnres_paper_humaneval"])


def test_missing_optional_extra_names_the_extra(full_manager):
    (minerva,) = resolve_benchmarks(["attnres_paper_minerva_math"])
    assert minerva.extra == "eval-math" and "math_verify" in minerva.requires_modules
    unavailable = dataclasses.replace(minerva, requires_modules=("attnres_no_such_module",))
    with pytest.raises(MissingExtraError, match=r"attnres_no_such_module: pip install 'attnres\[eval-math\]'"):
        check_requirements(unavailable, full_manager, allow_code_execution=False)


# ------------------------------------------------------------------------------------------------ offline datasets


def test_smoke_suite_loads_its_shipped_data_offline():
    manager = local_task_manager()
    sizes = {}
    for benchmark in resolve_benchmarks([SMOKE_SUITE]):
        (task,) = load_benchmark(benchmark, manager).get_all_tasks()
        sizes[task.task_name] = (len(task.eval_docs), len(task.fewshot_docs()))
    assert sizes == {"attnres_smoke_mc_arc": (24, 3), "attnres_smoke_gen_arithmetic": (16, 3)}


def _override_yaml(folder: Path, task: str, dataset: dict) -> None:
    shipped = local_task_manager().task_index[task].yaml_path
    (folder / f"{task}.yaml").write_text(
        yaml.safe_dump({"task": task, "include": str(shipped), "custom_dataset": None, **dataset}), encoding="utf-8"
    )


def test_include_path_points_a_task_at_a_local_dataset_copy(tmp_path):
    rows = [json.loads(line) for line in (TASKS_DIR / "smoke/data/smoke_mc_test.jsonl").read_text().splitlines()]
    (tmp_path / "test.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[:5]), encoding="utf-8")
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows[5:8]), encoding="utf-8")
    files = {"train": str(tmp_path / "train.jsonl"), "test": str(tmp_path / "test.jsonl")}
    _override_yaml(tmp_path, "attnres_smoke_mc_arc", {"dataset_path": "json", "dataset_kwargs": {"data_files": files}})
    (benchmark,) = resolve_benchmarks(["attnres_smoke_mc"], include_paths=[tmp_path])
    (task,) = load_benchmark(benchmark, local_task_manager([tmp_path])).get_all_tasks()
    assert [doc["id"] for doc in task.eval_docs] == [row["id"] for row in rows[:5]]


def test_unavailable_dataset_error_names_the_task_and_the_remedies(tmp_path):
    missing = tmp_path / "not-downloaded"
    _override_yaml(tmp_path, "attnres_smoke_mc_arc", {"dataset_path": str(missing)})
    (benchmark,) = resolve_benchmarks(["attnres_smoke_mc"])
    with pytest.raises(DatasetUnavailableError) as caught:
        load_benchmark(benchmark, local_task_manager([tmp_path]))
    message = str(caught.value)
    for needle in ("Smoke MC (ARC format)", "attnres_smoke_mc", "attnres_smoke_mc_arc", str(missing),
                   "HF_DATASETS_OFFLINE=1", "--include-path", "dataset_path:", "dataset_kwargs:"):  # fmt: skip
        assert needle in message, needle


def test_paper_dataset_error_names_the_hub_dataset(full_manager, monkeypatch):
    # Simulate "no Hub access, nothing cached" the way the datasets library reports it, without touching the network.
    import datasets

    def unreachable(path, name=None, **kwargs):
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (OfflineModeIsEnabled)")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    (mmlu,) = resolve_benchmarks(["attnres_paper_mmlu"])
    with pytest.raises(DatasetUnavailableError) as caught:
        load_benchmark(mmlu, full_manager)
    message = str(caught.value)
    assert "Benchmark 'MMLU' (task group 'attnres_paper_mmlu', 57 lm-eval task(s)" in message
    assert "cais/mmlu (57 configurations)" in message
    assert "--tasks attnres_paper_mmlu --limit 1" in message


# ----------------------------------------------------------------------------------------------------- the report


def test_table_renderer_writes_the_paper_layout():
    benchmarks = resolve_benchmarks(["attnres_paper_mmlu", "attnres_paper_gsm8k", "attnres_smoke_gen"])
    attnres = {"results": {
        "attnres_paper_mmlu": {"acc,none": 0.6712, "acc_stderr,none": 0.01},
        "attnres_paper_gsm8k": {"exact_match,flexible-extract": 0.25, "exact_match,strict-match": 0.2},
        "attnres_smoke_gen": {"exact_match,get-answer": 0.5},
    }}  # fmt: skip
    baseline = {"results": {
        "attnres_paper_mmlu": {"acc,none": 0.66},
        "attnres_paper_gsm8k": {"exact_match,flexible-extract": 0.2504},
        "attnres_smoke_gen": {"exact_match,get-answer": 0.5},
    }}  # fmt: skip
    rows = build_rows(benchmarks, attnres, baseline)
    assert rows[0] == TableRow("MMLU", 66.0, pytest.approx(67.12), PaperScore(65.9, 67.0))
    assert render_markdown_table(rows) == (
        "| Benchmark | Baseline | AttnRes | Δ | Paper baseline | Paper AttnRes | Paper Δ |\n"
        "|---|---:|---:|---:|---:|---:|---:|\n"
        "| MMLU | 66.0 | 67.1 | +1.1 | 65.9 | 67.0 | +1.1 |\n"
        "| GSM8K | 25.0 | 25.0 | +0.0 | 74.9 | 77.4 | +2.5 |\n"
        "| Smoke generation (GSM8K format) | 50.0 | 50.0 | +0.0 | — | — | — |\n"
    )
    with pytest.warns(UserWarning, match="no 'acc,none' for attnres_paper_mmlu"):
        no_baseline = build_rows(benchmarks[:1], {"results": {"attnres_paper_mmlu": {"acc_norm,none": 0.5}}})
    assert render_markdown_table(no_baseline).splitlines()[-1] == "| MMLU | — | — | — | 65.9 | 67.0 | +1.1 |"


# -------------------------------------------------------------------------------------------------- end to end


def _assert_written(report, output_dir: Path, *, with_baseline: bool) -> None:
    expected = {"results_attnres.json", "table.md", "chart.png"} | ({"results_baseline.json"} if with_baseline else set())
    assert {path.name for path in report.files.values()} == expected
    assert all(path.parent == output_dir for path in report.files.values())
    assert report.files["chart"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    raw = json.loads(report.files["results"].read_text())
    assert set(raw["results"]) >= {"attnres_smoke_mc", "attnres_smoke_gen", "attnres_smoke_mc_arc"}
    assert render_markdown_table(report.rows) in report.files["table"].read_text()


def test_smoke_suite_end_to_end_on_a_tiny_model(tmp_path, one_thread):
    tokenizer = byte_tokenizer()
    model = tiny_model(tokenizer)
    report = evaluate(
        model, baseline=model, tasks=[SMOKE_SUITE], limit=4, batch_size=4, output_dir=tmp_path,
        tokenizer=tokenizer, baseline_tokenizer=tokenizer,
    )  # fmt: skip
    _assert_written(report, tmp_path, with_baseline=True)
    assert [row.benchmark for row in report.rows] == ["Smoke MC (ARC format)", "Smoke generation (GSM8K format)"]
    for row in report.rows:
        assert row.attnres is not None and 0.0 <= row.attnres <= 100.0
        assert row.baseline == row.attnres and row.paper is None
    assert report.results["n-samples"]["attnres_smoke_mc_arc"] == {"original": 24, "effective": 4}
    assert report.results["n-shot"]["attnres_smoke_gen_arithmetic"] == 3


def test_cli_runs_the_smoke_suite_from_a_saved_model(tmp_path, capsys, one_thread):
    from attnres_cli import main

    tokenizer = byte_tokenizer()
    tiny_model(tokenizer).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    output = tmp_path / "report"
    status = main(["eval", str(tmp_path / "model"), "--tasks", "attnres_smoke_mc,attnres_smoke_gen", "--limit", "2",
                   "--batch-size", "2", "--device", "cpu", "--output-dir", str(output)])  # fmt: skip
    assert status == 0
    assert {path.name for path in output.iterdir()} == {"results_attnres.json", "table.md", "chart.png"}
    assert "| Smoke MC (ARC format) | — |" in capsys.readouterr().out
    assert main(["eval", str(tmp_path / "model"), "--tasks", "gsm8k"]) == 2
    assert "not a benchmark or suite" in capsys.readouterr().err


def test_converted_smollm2_scores_equal_the_original(tmp_path, one_thread):
    """The retrofit is exact (docs/design.md §5), so the benchmark cannot tell the converted model from its source."""
    from attnres.conversion import convert
    from attnres.conversion.sources import materialize_gguf

    gguf = default_demo_model()
    # Dequantise the GGUF once (the slow step), the way `convert(gguf, ...)` stages it, and use that float32 copy as
    # both the baseline and the conversion's source.
    original = tmp_path / "original"
    original.mkdir()
    materialize_gguf(gguf.parent, gguf.name, original, str(gguf))
    converted = tmp_path / "smollm2-attnres"
    convert(original, converted, mode="block", verify=False, progress=False)
    assert AutoConfig.from_pretrained(original).model_type == "llama"
    assert AutoConfig.from_pretrained(converted).residual_mode == "block"

    report = evaluate(
        str(converted), baseline=str(original), tasks=[SMOKE_SUITE], limit=8, batch_size=4,
        output_dir=tmp_path / "eval", device="cpu", dtype=torch.float32,
    )  # fmt: skip
    _assert_written(report, tmp_path / "eval", with_baseline=True)
    for task in ("attnres_smoke_mc_arc", "attnres_smoke_gen_arithmetic"):
        original_scores, retrofit_scores = report.baseline_results["results"][task], report.results["results"][task]
        assert retrofit_scores == original_scores, task  # every metric and its stderr, bit for bit
    assert [row.delta for row in report.rows] == [0.0, 0.0]
    # SmolLM2 beats chance (25%) on the multiple-choice smoke task, so the equality is not vacuous.
    assert report.rows[0].attnres > 50.0
