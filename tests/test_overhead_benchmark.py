"""The overhead benchmark's measures (benchmarks/overhead.py): allocator-independent memory, flanked time ratios, a
process per model."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.overhead import (
    TensorMemoryPeak,
    decode_sequence,
    flanked_ratios,
    model_processes,
    precision,
    rotated,
    round_order,
)


def test_tensor_memory_peak_counts_live_storages_once():
    """Storages count from the operation that returns them until they are freed; views add nothing."""
    mib = 2**20
    with TensorMemoryPeak() as tensors:
        first = torch.ones(mib // 4)  # 1 MiB of fp32
        second = torch.ones(mib // 2)  # 2 MiB: 3 MiB held
        view = second[:10].view(2, 5)
        del first, second, view
        third = torch.zeros(mib // 4)  # 1 MiB, after 3 MiB were freed
    assert tensors.peak == 3 * mib
    assert tensors.held == mib
    del third
    assert tensors.held == 0


def test_flanked_ratio_cancels_a_linear_drift():
    """The machine slows down steadily: each sample takes 10% of the first one's time longer than the one before. A
    model 1.1x the baseline's cost measures 1.1 between two baseline samples; the run's last sample, which has only
    the baseline before it, reads the drift too."""
    order = round_order("llama", ["standard", "block"], 0) + round_order("llama", ["standard", "block"], 1)
    cost = {"llama": 1.0, "standard": 1.0, "block": 1.1}
    sequence = [(name, cost[name] * (1 + 0.1 * i)) for i, name in enumerate(order)]
    expected_order = ["llama", "standard", "llama", "block", "llama", "block", "llama", "standard"]
    assert [name for name, _ in sequence] == expected_order
    for ratio in flanked_ratios(sequence, "block", "llama"):
        assert abs(ratio - 1.1) < 1e-12
    assert sequence[3][1] / sequence[2][1] > 1.1 + 0.05  # the ratio to the baseline sample before it alone
    first, last = flanked_ratios(sequence, "standard", "llama")
    assert abs(first - 1.0) < 1e-12
    assert abs(last - (1 + 0.1 * 7) / (1 + 0.1 * 6)) < 1e-12
    assert flanked_ratios(sequence, "llama", "llama") == [1.0] * 4


def test_round_order_puts_the_baseline_before_every_model_in_rotation():
    """Each round runs the baseline right before each AttnRes model, and the AttnRes models rotate."""
    others = ["standard", "block", "full"]
    assert round_order("llama", others, 0) == ["llama", "standard", "llama", "block", "llama", "full"]
    assert round_order("llama", others, 1) == ["llama", "block", "llama", "full", "llama", "standard"]
    assert round_order("llama", others, 3) == round_order("llama", others, 0)


def test_rotation_gives_every_model_every_position():
    """Over as many rounds as there are models, each model runs once in each position of the round."""
    models = ["llama", "standard", "block", "full"]
    rounds = [rotated(models, r) for r in range(len(models))]
    assert rounds[0] == models
    for round_ in rounds:
        assert sorted(round_) == sorted(models)
    for position in range(len(models)):
        assert sorted(round_[position] for round_ in rounds) == sorted(models)
    assert rotated(models, 5) == rounds[1]


def test_each_model_runs_and_times_its_samples_in_a_process_of_its_own():
    """Every model of the shape lives in its own process, which times what it is asked to run; decode streams keep
    their KV caches there, token by token in the rounds' order. An error in a model's process comes back as an error
    that names the model and carries the traceback."""
    threads = torch.get_num_threads()
    with model_processes("small-moe", threads, compile_models=False, autocast=None) as processes:
        assert list(processes) == ["mixtral", "standard", "block", "full"]
        pids = {process.process.pid for process in processes.values()}
        assert len(pids) == 4 and os.getpid() not in pids
        ids = torch.randint(0, 8192, (1, 16))
        for process in processes.values():
            process.call("start", "decode", ids)
        sequence = decode_sequence({name: processes[name] for name in ("mixtral", "block")}, "mixtral", ids)
        assert [name for name, _ in sequence[:4]] == ["mixtral", "block", "mixtral", "block"]
        assert len(sequence) == 2 * 64 and all(seconds > 0 for _, seconds in sequence)
        processes["full"].call("start", "prefill", ids)
        assert processes["full"].call("time", "prefill", ids) > 0
        with pytest.raises(RuntimeError, match=r"(?s)the model 'standard'.*KeyError: 'unknown-stream'"):
            processes["standard"].call("decode_step", "unknown-stream", 16)


def run_benchmark(tmp_path: Path, workload: str, *options: str) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m benchmarks.overhead` on the small shape, one round of `workload`, no memory: its run and its JSON."""
    output = tmp_path / "overhead.json"
    command = [sys.executable, "-m", "benchmarks.overhead", "--shapes", "small", "--workloads", workload]
    command += ["--no-memory", "--repeats", "1", *options, "--output", str(output)]
    root = Path(__file__).resolve().parents[1]
    result = subprocess.run(command, cwd=root, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result, json.loads(output.read_text())


def test_benchmark_runs_the_workloads_asked_for(tmp_path):
    """`--workloads prefill` times prefills only: the JSON rows hold prefill ratios and no other workload's, and the
    table shows the others as `-`. The baseline runs right before each AttnRes model: as many samples as they have.
    `--instances 2` times two sets of processes, each building every model afresh: the samples of both, and each
    set's own median ratio."""
    result, results = run_benchmark(tmp_path, "prefill", "--seconds", "0", "--instances", "2")
    rows = results["rows"]
    assert results["instances"] == 2 and result.stderr.count("instance ") == 2
    assert [row["model"] for row in rows] == ["llama", "standard", "block", "full"]
    for row in rows:
        assert row["prefill_samples"] == (6 if row["model"] == "llama" else 2)
        assert len(row["prefill_ratio_instances"]) == 2
        assert row["prefill_s"] > 0 and not any(key.startswith(("decode", "train")) for key in row)
    assert "| small | eager | block | " in result.stdout and result.stdout.count(" | - | - | - | - |") == 4


def test_autocast_runs_every_workload_under_autocast(tmp_path):
    """`--autocast bf16`: each model's process runs its workloads under bf16 autocast (here, a training step), and
    the rows and settings say so. The results record the CPU's instruction set, and the run warns where the CPU has no
    bf16 matrix instructions (its ratios then say little)."""
    with precision("bf16"):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    result, results = run_benchmark(tmp_path, "train", "--train-seconds", "0", "--autocast", "bf16")
    assert results["autocast"] == "bf16"
    machine = results["machine"]
    assert machine["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    warned = "has no bf16 matrix instructions" in result.stderr
    assert warned == ("bf16" not in machine["native_low_precision"])
    assert {row["mode"] for row in results["rows"]} == {"eager, bf16 autocast"}
    assert all(row["train_s"] > 0 for row in results["rows"])
