"""The ablation runner (benchmarks/ablation.py) end to end at a tiny size: its table, curves and JSON, and the
fairness it promises (same shared initialisation, same data order)."""

import importlib.util
import json
from pathlib import Path

import pytest


RUNNER = Path(__file__).resolve().parents[1] / "benchmarks" / "ablation.py"
TINY = (
    "--hidden-size 32 --layers 2 --heads 2 --seq-len 32 --batch-size 4 --steps 4 --eval-every 2 "
    "--eval-sequences 4 --depth-heads 2 --window 2"
).split()


@pytest.fixture(scope="module")
def ablation():
    spec = importlib.util.spec_from_file_location("ablation", RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_runner_writes_the_table_curves_and_json(ablation, tmp_path):
    report = ablation.main([*TINY, "--output-dir", str(tmp_path), "--name", "tiny", "--save-models", str(tmp_path)])
    rows = ablation.variants(ablation.parse_args(TINY))
    runs = report["runs"]
    assert [r["variant"] for r in runs if r["seed"] == 0] == [row.name for row in rows]
    assert sorted(r["variant"] for r in runs if r["seed"] == 1) == ["baseline", "block"]

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

    table = (tmp_path / "tiny.md").read_text()
    for row in rows:
        assert f"| {row.label} |" in table
    assert "Run-to-run noise" in table and "(n=2)" in table
    assert json.loads((tmp_path / "tiny.json").read_text())["runs"] == runs
    assert (tmp_path / "tiny_loss_curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "mhc" / "config.json").is_file()  # --save-models, for `attnres inspect`


def test_runner_rejects_unknown_variants(ablation):
    with pytest.raises(SystemExit):
        ablation.parse_args(["--variants", "resnet"])
