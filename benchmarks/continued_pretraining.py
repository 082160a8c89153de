"""Does converting pay off when the whole model trains on? A PreNorm model pretrained from scratch here is continued
two ways on the same data for the same steps: (a) as it is, (b) converted exactly to Block AttnRes (zero pseudo-
queries, the exact retrofit's output scales, so it starts as the same function) with every parameter trained. The
learning rate of each arm is picked on validation windows; the arms are compared on other, held-out windows.

Models, data and training are `ablation.py`'s (byte-level Shakespeare, 12 layers of width 64 by default): the
source is the ablation's baseline pretrained for `--steps` steps (its 1x budget), then each arm trains for
`--continue-steps` more with warm-up and cosine decay at each of `--lrs`. Every arm of a seed starts from the same
pretrained model and reads the same continuation batches (drawn from another stream than pretraining's). The
ablation's validation windows are split: the first half picks each arm's learning rate (the lowest mean over seeds),
the second half is the held-out loss reported. The comparison is paired by seed: (b) - (a), mean ± sd, and a
two-sided paired t-test at 5% (`ablation.T_975`).

    python -m benchmarks.continued_pretraining                      # 2-core CPU: about 35 minutes
    for s in 0 1 2; do python -m benchmarks.continued_pretraining --threads 1 --seeds $s --name cpt$s & done; wait
    python -m benchmarks.continued_pretraining --from-json benchmarks/results/cpt{0,1,2}.json

Writes `<name>.json` (settings, versions, every run) and `<name>.md` (the table) to `--output-dir`.
"""

import argparse
import copy
import json
import math
import statistics
from pathlib import Path

import torch

from attnres import AttnResConfig, AttnResForCausalLM
from benchmarks import ablation


ARMS = ("as_is", "converted")
CONTINUATION_SEED_OFFSET = 1000  # the continuation's batches come from another stream than pretraining's


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--continue-steps", type=int, default=500)
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-3, 3e-3])
    parser.add_argument("--name", default="continued_pretraining")
    parser.add_argument("--output-dir", type=Path, default=ablation.RESULTS_DIR)
    parser.add_argument("--from-json", type=Path, nargs="+", default=None, help="merge finished reports, then report")
    args, rest = parser.parse_known_args(argv)
    if "--seeds" not in rest:
        rest += ["--seeds", "0", "1", "2"]
    args.training = ablation.parse_args([*rest, "--name", args.name, "--output-dir", str(args.output_dir)])
    return args


def converted(model: AttnResForCausalLM, block_size: int) -> AttnResForCausalLM:
    """The PreNorm model as Block AttnRes, exactly: its weights, zero pseudo-queries, the exact retrofit's eps."""
    fields = {**model.config.to_dict(), "residual_mode": "block", "block_size": block_size, "exact_retrofit": True}
    result = AttnResForCausalLM(AttnResConfig.from_dict(fields))
    missing, unexpected = result.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("_residual." in name for name in missing), (missing, unexpected)
    return result.train()


def continue_training(
    model: AttnResForCausalLM, batches: list[torch.Tensor], args: argparse.Namespace
) -> AttnResForCausalLM:
    """`args.steps` steps of the ablation's recipe at `args.lr` (warm-up, cosine decay, AdamW, clipping)."""
    optimizer = ablation.optimizer_for(model, args)
    model.train()
    for step, batch in enumerate(batches):
        ablation.training_step(model, optimizer, batch, ablation.learning_rate(step, args))
    return model


def summary(report: dict) -> dict:
    runs = report["runs"]
    seeds = sorted({r["seed"] for r in runs})
    chosen = {}
    for arm in ARMS:
        lrs = sorted({r["lr"] for r in runs if r["arm"] == arm})
        means = {
            lr: statistics.fmean(r["validation_loss"] for r in runs if r["arm"] == arm and r["lr"] == lr) for lr in lrs
        }
        chosen[arm] = min(means, key=means.get)
    held_out = {
        arm: {r["seed"]: r["held_out_loss"] for r in runs if r["arm"] == arm and r["lr"] == chosen[arm]} for arm in ARMS
    }
    differences = [held_out["converted"][s] - held_out["as_is"][s] for s in seeds]
    mean = statistics.fmean(differences)
    sd = statistics.stdev(differences) if len(differences) > 1 else math.nan
    t = mean / (sd / math.sqrt(len(differences))) if len(differences) > 1 and sd > 0 else math.nan
    critical = ablation.T_975[len(differences) - 2] if len(differences) > 1 else math.nan
    return {
        "seeds": seeds,
        "chosen_lr": chosen,
        "held_out": {arm: [held_out[arm][s] for s in seeds] for arm in ARMS},
        "source_held_out": [next(r["source_held_out_loss"] for r in runs if r["seed"] == s) for s in seeds],
        "difference": {"mean": mean, "sd": sd, "t": t, "t_975": critical, "resolved": abs(t) > critical},
    }


def table(report: dict) -> str:
    s = report["summary"]
    rows = ["| arm | learning rate (picked on validation) | held-out loss, mean ± sd (nats/byte) |", "|---|---|---|"]
    source = s["source_held_out"]
    rows.append(
        f"| pretrained source (before continuing) | - | {statistics.fmean(source):.4f} ± "
        f"{statistics.stdev(source) if len(source) > 1 else math.nan:.4f} |"
    )
    for arm in ARMS:
        values = s["held_out"][arm]
        sd = statistics.stdev(values) if len(values) > 1 else math.nan
        rows.append(f"| {arm} | {s['chosen_lr'][arm]:g} | {statistics.fmean(values):.4f} ± {sd:.4f} |")
    d = s["difference"]
    verdict = "resolved" if d["resolved"] else "not resolved"
    rows += [
        "",
        f"converted - as_is, paired over seeds {s['seeds']}: {d['mean']:+.4f} ± {d['sd']:.4f} "
        f"(t = {d['t']:.2f}, |t| > {d['t_975']:.2f} needed: {verdict} at 5%)",
    ]
    return "\n".join(rows)


def write_outputs(report: dict, output_dir: Path, name: str, final: bool) -> str:
    output_dir.mkdir(parents=True, exist_ok=True)
    if final:
        report["summary"] = summary(report)
    (output_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    if not final:
        return ""
    markdown = table(report)
    (output_dir / f"{name}.md").write_text(markdown + "\n")
    return markdown


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    training = args.training
    if args.from_json is not None:
        report = ablation.merged_by_seed(args.from_json, key=lambda run: (run["arm"], run["seed"], run["lr"]))
        print(write_outputs(report, args.output_dir, args.name, final=True))
        return report
    if training.threads:
        torch.set_num_threads(training.threads)
    report = ablation.new_report(training, continue_steps=args.continue_steps, lrs=args.lrs)
    rows = {row.name: row for row in ablation.variants(training)}
    train_split, validation_split = ablation.load_splits(training.data_dir)
    windows = ablation.validation_batches(validation_split, training)
    windows = torch.cat(windows)
    half = len(windows) // 2
    selection = list(windows[:half].split(training.batch_size))
    held_out = list(windows[half:].split(training.batch_size))
    for seed in training.seeds:
        pretraining = ablation.training_batches(train_split, training, seed)
        _, source = ablation.train(rows["baseline"], seed, training, pretraining, selection)
        source.eval()
        source_held_out = ablation.validation_loss(source, held_out, training.device)
        continuation_args = argparse.Namespace(**{**vars(training), "steps": args.continue_steps})
        continuation = ablation.training_batches(train_split, continuation_args, seed + CONTINUATION_SEED_OFFSET)
        for arm in ARMS:
            start = copy.deepcopy(source) if arm == "as_is" else converted(source, training.block_size)
            if arm == "converted":  # the conversion is exact: the same function before any step
                gap = abs(ablation.validation_loss(start, held_out, training.device) - source_held_out)
                assert gap < 1e-4, gap
            for lr in args.lrs:
                model = continue_training(
                    copy.deepcopy(start), continuation, argparse.Namespace(**{**vars(continuation_args), "lr": lr})
                )
                record = {
                    "arm": arm,
                    "seed": seed,
                    "lr": lr,
                    "validation_loss": ablation.validation_loss(model, selection, training.device),
                    "held_out_loss": ablation.validation_loss(model, held_out, training.device),
                    "source_held_out_loss": source_held_out,
                }
                report["runs"].append(record)
                print(
                    f"{arm:<9} seed {seed} lr {lr:g}  validation {record['validation_loss']:.4f}  "
                    f"held-out {record['held_out_loss']:.4f}",
                    flush=True,
                )
                write_outputs(report, args.output_dir, args.name, final=False)
    markdown = write_outputs(report, args.output_dir, args.name, final=len(training.seeds) >= 2)
    print(markdown)
    return report


if __name__ == "__main__":
    main()
