"""The vLLM benchmark's pooling of instances and its refusals (benchmarks/vllm.py); the engines themselves run in
`python -m benchmarks.vllm`, minutes per start, and are not started here."""

import statistics
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import benchmarks.vllm as vllm_benchmark


REPO_ROOT = Path(__file__).resolve().parents[1]


def test_instances_pool_their_rounds_and_keep_each_median(monkeypatch, tmp_path):
    """Each instance's engines report their own samples: the ratios pool every round of every instance, each instance's
    median ratio is kept beside them, and start-up is the median over instances."""
    samples = {  # instance -> batch -> engine -> tokens/s per round
        0: {"1": {"llama-native": [10.0, 10.0, 10.0], "attnres-native": [9.0, 9.5, 10.0]}},
        1: {"1": {"llama-native": [20.0, 20.0, 20.0], "attnres-native": [21.0, 22.0, 20.0]}},
    }
    startups = {0: {"llama-native": 60.0, "attnres-native": 70.0}, 1: {"llama-native": 62.0, "attnres-native": 80.0}}

    def run_instance(mode, models, names, args, folder):
        assert folder.is_dir() and folder.parent == tmp_path  # each instance's engines get caches of their own
        instance = int(folder.name.removeprefix("instance-"))
        return dict(
            startup_seconds=startups[instance],
            dynamo_after_startup={},
            compile_phase_seconds={},
            dynamo_after_run={},
            samples=samples[instance],
        )

    monkeypatch.setattr(vllm_benchmark, "run_instance", run_instance)
    args = SimpleNamespace(instances=2, batches=[1], rounds=3)
    result = vllm_benchmark.run_mode("compiled", {}, ["llama-native", "attnres-native"], args, tmp_path)

    stats = result["batches"]["1"]
    pooled = [0.9, 0.95, 1.0, 1.05, 1.1, 1.0]
    assert stats["ratio_median"]["attnres-native/llama-native"] == pytest.approx(statistics.median(pooled))
    assert stats["ratio_instances"]["attnres-native/llama-native"] == pytest.approx([0.95, 1.05])
    assert stats["tokens_per_second"]["llama-native"] == 15.0
    assert result["startup_seconds"] == {"llama-native": 61.0, "attnres-native": 75.0}
    assert result["startup_seconds_instances"]["attnres-native"] == [70.0, 80.0]
    settings = {"engines": ["llama-native", "attnres-native"]}
    rows = vllm_benchmark.table({"modes": {"compiled": result}, "settings": settings}).splitlines()
    (row,) = [row for row in rows if row.startswith("| compiled | 1 | attnres-native |")]
    assert row.startswith("| compiled | 1 | attnres-native | 15.0 | 1.000 (") and row.endswith(" [0.950, 1.050] |")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--instances", "0"], "--instances=0: must be a positive integer"),
        (["--engines", "attnres-native"], "--engines=attnres-native: must include llama-native"),
    ],
)
def test_bad_arguments_are_refused_in_one_line(arguments, message):
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.vllm", *arguments], capture_output=True, text=True, cwd=REPO_ROOT
    )
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr
