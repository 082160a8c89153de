"""The compute-equivalent-multiplier runner (benchmarks/scaling.py) end to end at a tiny size: every arm, budget and
seed runs; compute grows with the budget; the multiplier is what its fit says; seeds run apart merge into the same
report; and an ablation of other settings is not reused."""

import json
import math
import statistics

import pytest

from benchmarks import scaling


TINY = (
    "--hidden-size 32 --layers 2 --heads 2 --seq-len 32 --batch-size 4 --steps 6 --eval-sequences 4 --block-size 2"
).split()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scaling")
    return scaling.main([*TINY, "--seeds", "0", "1", "--output-dir", str(folder), "--name", "tiny"]), folder


def test_every_arm_budget_and_seed_runs_and_is_reported(report):
    report, folder = report
    keys = sorted((r["variant"], r["budget"], r["seed"]) for r in report["runs"])
    expected = [("baseline", b, s) for b in (1.0, 1.5, 2.0) for s in (0, 1)] + [
        (arm, 1.0, s) for arm in ("block", "full") for s in (0, 1)
    ]
    assert keys == sorted(expected)
    for seed in (0, 1):
        baseline = sorted(
            (r for r in report["runs"] if r["variant"] == "baseline" and r["seed"] == seed), key=lambda r: r["budget"]
        )
        assert [r["tokens"] for r in baseline] == [6 * 4 * 32, 9 * 4 * 32, 12 * 4 * 32]
        assert baseline[0]["compute"] < baseline[1]["compute"] < baseline[2]["compute"]
        assert baseline[2]["final_validation_loss"] < baseline[0]["final_validation_loss"]  # more steps help
        block = next(r for r in report["runs"] if r["variant"] == "block" and r["seed"] == seed)
        assert block["compute"] > baseline[0]["compute"]  # the depth mixing costs a little
    for suffix in (".json", ".md", ".png"):
        assert (folder / f"tiny{suffix}").stat().st_size > 0
    assert json.loads((folder / "tiny.json").read_text())["summary"] == report["summary"]


def test_the_multiplier_is_what_the_fit_says(report):
    report, _ = report
    baseline = [(r["compute"], r["final_validation_loss"]) for r in report["runs"] if r["variant"] == "baseline"]
    a, b = scaling.fit(baseline)
    assert b < 0  # loss falls with compute
    for arm, values in report["summary"]["arms"].items():
        runs = [r for r in report["runs"] if r["variant"] == arm]
        loss = statistics.fmean(r["final_validation_loss"] for r in runs)
        compute = statistics.fmean(r["compute"] for r in runs)
        assert values["multiplier"] == pytest.approx(math.exp((loss - a) / b) / compute, rel=1e-9)
        low, high = values["interval_95"]
        assert low <= high and low > 0


def test_seeds_run_apart_merge_into_the_same_report(report, tmp_path):
    whole, _ = report
    parts = []
    for seed in ("0", "1"):
        scaling.main([*TINY, "--seeds", seed, "--output-dir", str(tmp_path), "--name", f"part{seed}"])
        parts.append(str(tmp_path / f"part{seed}.json"))
    merged = scaling.main(["--from-json", *parts, "--output-dir", str(tmp_path), "--name", "merged"])
    by_key = {(r["variant"], r["budget"], r["seed"]): r["final_validation_loss"] for r in whole["runs"]}
    assert {(r["variant"], r["budget"], r["seed"]): r["final_validation_loss"] for r in merged["runs"]} == by_key
    assert merged["summary"]["arms"]["block"]["multiplier"] == pytest.approx(
        whole["summary"]["arms"]["block"]["multiplier"], rel=1e-12
    )


def test_an_ablation_of_other_settings_is_not_reused(tmp_path):
    ablation_report = {"settings": {key: None for key in scaling._SHARED}, "runs": []}
    path = tmp_path / "ablation.json"
    path.write_text(json.dumps(ablation_report))
    with pytest.raises(SystemExit, match="--reuse-ablation .*: its hidden_size=None, here 32"):
        scaling.main([*TINY, "--reuse-ablation", str(path), "--output-dir", str(tmp_path)])
