"""The continued-pretraining runner (benchmarks/continued_pretraining.py) end to end at a tiny size: both arms start
from the same pretrained model, the converted one computing the same function; every arm, learning rate and seed
runs; each arm's learning rate is the one validation picks; the paired difference is computed from the held-out
losses; and seeds run apart merge into the same report."""

import statistics

import pytest
import torch

from benchmarks import ablation, continued_pretraining


TINY = (
    "--hidden-size 32 --layers 2 --heads 2 --seq-len 32 --batch-size 4 --steps 6 --eval-sequences 8 --block-size 2 "
    "--continue-steps 4"
).split()


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cpt")
    return continued_pretraining.main([*TINY, "--seeds", "0", "1", "--output-dir", str(folder), "--name", "tiny"])


def test_the_converted_arm_starts_as_the_same_function():
    args = ablation.parse_args(TINY[:-2])
    torch.manual_seed(0)
    source = ablation.build_model(args, ablation.variants(args)[0], seed=0).eval()
    with torch.no_grad():
        for name, parameter in source.named_parameters():  # trained-looking norms, so the eps matter
            if name.endswith("layernorm.weight"):
                parameter.mul_(torch.rand_like(parameter) + 0.5)
    block = continued_pretraining.converted(source, block_size=2).eval()
    assert block.config.residual_mode == "block" and block.config.exact_retrofit
    ids = torch.randint(256, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(block(ids).logits, source(ids).logits, atol=1e-5, rtol=0)


def test_every_arm_rate_and_seed_runs_and_the_choice_is_validations(report):
    keys = sorted((r["arm"], r["lr"], r["seed"]) for r in report["runs"])
    assert keys == sorted((arm, lr, s) for arm in ("as_is", "converted") for lr in (1e-3, 3e-3) for s in (0, 1))
    summary = report["summary"]
    for arm in ("as_is", "converted"):
        means = {
            lr: statistics.fmean(r["validation_loss"] for r in report["runs"] if r["arm"] == arm and r["lr"] == lr)
            for lr in (1e-3, 3e-3)
        }
        assert summary["chosen_lr"][arm] == min(means, key=means.get)
    for seed in (0, 1):  # both arms of a seed continue the same source
        sources = {r["source_held_out_loss"] for r in report["runs"] if r["seed"] == seed}
        assert len(sources) == 1
    differences = [c - a for c, a in zip(summary["held_out"]["converted"], summary["held_out"]["as_is"])]
    assert summary["difference"]["mean"] == pytest.approx(statistics.fmean(differences), abs=1e-12)
    assert summary["difference"]["t_975"] == ablation.T_975[0]


def test_seeds_run_apart_merge_into_the_same_report(report, tmp_path):
    parts = []
    for seed in ("0", "1"):
        continued_pretraining.main([*TINY, "--seeds", seed, "--output-dir", str(tmp_path), "--name", f"part{seed}"])
        parts.append(str(tmp_path / f"part{seed}.json"))
    merged = continued_pretraining.main(["--from-json", *parts, "--output-dir", str(tmp_path), "--name", "merged"])
    assert merged["summary"]["held_out"] == report["summary"]["held_out"]
    assert (tmp_path / "merged.md").read_text().startswith("| arm |")
