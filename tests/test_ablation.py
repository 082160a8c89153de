"""The ablation runner (benchmarks/ablation.py) end to end at a tiny size: its tables, curves and JSON, the fairness it
promises (same shared initialisation, same data order), the paired statistics it reports, and a default that runs
every reported variant with several seeds on a model deep enough for PreNorm's growth to show."""

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest


RUNNER = Path(__file__).resolve().parents[1] / "benchmarks" / "ablation.py"
TINY = (
    "--hidden-size 32 --layers 2 --heads 2 --seq-len 32 --batch-size 4 --steps 4 --eval-every 2 "
    "--eval-sequences 4 --depth-heads 2 --window 2 --block-size 2"
).split()


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("ablation", RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_default_runs_every_reported_variant_with_three_seeds_on_a_deep_model(ablation):
    args = ablation.parse_args([])
    assert args.variants == ["baseline", "block", "full"]
    assert len(args.seeds) >= 3
    assert args.layers >= 12
    sublayers = 2 * args.layers
    assert 1 < args.block_size and sublayers // args.block_size >= 2  # Block AttnRes, not Full in disguise


def test_runner_writes_the_tables_curves_and_json(ablation, tmp_path):
    every = [row.name for row in ablation.variants(ablation.parse_args(TINY))]
    argv = [*TINY, "--variants", *every, "--seeds", "0", "1", "--output-dir", str(tmp_path), "--name", "tiny"]
    report = ablation.main([*argv, "--save-models", str(tmp_path)])
    rows = ablation.variants(ablation.parse_args(TINY))
    runs = report["runs"]
    for seed in (0, 1):  # every variant runs every seed
        assert [r["variant"] for r in runs if r["seed"] == seed] == [row.name for row in rows]

    # Same data order for every variant of a seed, a different one for the other seed.
    digests = {r["seed"]: set() for r in runs}
    for run in runs:
        digests[run["seed"]].add(run["data_digest"])
    assert len(digests[0]) == len(digests[1]) == 1 and digests[0] != digests[1]
    # Same shared initialisation: the modes that equal the baseline at init score the same before training.
    first = {r["variant"]: r["validation_losses"][0] for r in runs if r["seed"] == 0}
    for name in ("denseformer", "hc"):
        assert first[name] == pytest.approx(first["baseline"], abs=1e-5)
    assert first["full"] != pytest.approx(first["baseline"], abs=1e-5)  # uniform averaging is not the baseline
    for run in runs:
        assert run["eval_steps"] == [0, 2, 4] and len(run["validation_losses"]) == 3
        assert 0 < run["final_validation_loss"] < 6 and run["tokens_per_second"] > 0
        assert run["final_validation_loss"] < run["validation_losses"][0]  # four steps at lr 3e-3 already help
        assert (run["residual_parameters"] == 0) == (run["variant"] == "baseline")
        assert len(run["input_rms"]) == len(run["output_rms"]) == 4  # one per sublayer
        assert all(value > 0 for value in run["input_rms"]) and run["final_input_rms"] > 0

    table = (tmp_path / "tiny.md").read_text()
    for row in rows:
        assert f"| {row.label} | 2 (0, 1) |" in table
    assert "| Block AttnRes (S=2) − PreNorm baseline | 2 |" in table and "t₀.₉₇₅ = 12.71" in table
    assert json.loads((tmp_path / "tiny.json").read_text())["runs"] == runs
    assert (tmp_path / "tiny_loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "mhc" / "config.json").is_file()  # --save-models, for `attnres inspect`

    # --from-json re-renders the same table from the JSON alone.
    again = tmp_path / "again"
    ablation.main(["--from-json", str(tmp_path / "tiny.json"), "--output-dir", str(again), "--name", "tiny"])
    assert (again / "tiny.md").read_text() == table


def test_reports_of_other_seeds_merge_into_the_report_of_one_run(ablation, tmp_path):
    small = [*TINY, "--variants", "baseline", "block", "--output-dir", str(tmp_path)]
    together = ablation.main([*small, "--seeds", "0", "1", "--name", "together"])
    for seed in ("0", "1"):
        ablation.main([*small, "--seeds", seed, "--name", f"seed{seed}"])
    merged = ablation.main(
        ["--from-json", str(tmp_path / "seed1.json"), str(tmp_path / "seed0.json"), "--output-dir", str(tmp_path),
         "--name", "merged"]
    )  # fmt: skip
    assert merged["settings"]["seeds"] == [0, 1]
    key = ("variant", "seed", "final_validation_loss", "validation_losses", "data_digest", "input_rms")
    assert [[run[k] for k in key] for run in merged["runs"]] == [[run[k] for k in key] for run in together["runs"]]
    with pytest.raises(ValueError, match="two reports"):
        ablation.merged_reports([json.loads((tmp_path / "seed0.json").read_text())] * 2)
    other = ablation.main([*small, "--seeds", "2", "--steps", "2", "--eval-every", "1", "--name", "other"])
    with pytest.raises(ValueError, match="same settings"):
        ablation.merged_reports([together, other])


def test_paired_difference_is_per_seed_with_the_t_criterion(ablation):
    def run(variant, seed, loss):
        return dict(variant=variant, seed=seed, final_validation_loss=loss)

    a = [1.50, 1.60, 1.55]
    b = [1.52, 1.625, 1.565]  # worse by 0.02, 0.025, 0.015: consistent although smaller than either's spread
    runs = [run("a", s, v) for s, v in enumerate(a)] + [run("b", s, v) for s, v in enumerate(b)]
    pair = ablation.paired_difference(runs, "b", "a")
    assert pair["seeds"] == [0, 1, 2]
    assert pair["differences"] == pytest.approx([0.02, 0.025, 0.015])
    assert pair["mean"] == pytest.approx(0.02) and pair["sd"] == pytest.approx(0.005)
    assert pair["t"] == pytest.approx(0.02 / (0.005 / math.sqrt(3)))
    assert pair["critical"] == pytest.approx(4.303) and pair["resolved"]
    assert 0.02 < statistics.stdev(a)  # unpaired, the gap would hide in the seed spread

    noisy = [run("a", s, v) for s, v in enumerate(a)] + [run("c", s, v) for s, v in enumerate([1.55, 1.58, 1.57])]
    pair = ablation.paired_difference(noisy, "c", "a")
    assert not pair["resolved"]  # +0.05, -0.02, +0.02: t = 0.82
    assert ablation.paired_difference(runs[:1] + runs[3:4], "b", "a") is None  # one common seed: no spread


def test_runner_rejects_unknown_variants(ablation):
    with pytest.raises(SystemExit):
        ablation.parse_args(["--variants", "resnet"])
