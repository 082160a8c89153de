"""The paper's headline claim at this machine's scale: how much compute is Block AttnRes worth? The PreNorm baseline
is trained at several compute budgets, Block (and Full) AttnRes at the smallest; a fit of the baseline's validation
loss against compute says what compute the baseline needs to reach AttnRes's loss, and the multiplier is that
compute divided by AttnRes's own. The paper reports about 1.25 for Block AttnRes (Kimi Team, arXiv:2603.15031).

Models, data and training are `ablation.py`'s (byte-level Shakespeare, 12 layers of width 64 by default, AdamW with
warm-up and cosine decay over each run's own steps); a budget multiplies the number of steps, so the baseline at 2x
reads twice the tokens of the same model. Within a seed every arm starts from the same shared initialisation and
reads the same batches in the same order, the larger budgets reading more of them.

Compute counts training FLOPs per token: 6 x the parameters (the tied embedding once, as the output head's matmul),
plus attention's 12 x layers x width x context / 2 (scores and values, forward and backward, the causal half), plus,
for AttnRes, 12 x width x sources for each depth-mixing step (logits and weighted sum, forward and backward).

The fit is `loss = a + b ln C` over every baseline run (least squares); with three budgets it is the simplest curve
the data can test, and it is only used between the budgets it spans (a multiplier beyond them is flagged as an
extrapolation). The interval is a bootstrap over seeds: seeds are resampled with replacement (a seed's runs stay
together, since they share initialisation and data), the fit and the multiplier recomputed, 2000 times; the 2.5th and
97.5th percentiles are reported.

    python -m benchmarks.scaling                     # 2-core CPU: about 40 minutes with --reuse-ablation
    python -m benchmarks.scaling --threads 1 --seeds 0 --name part0 &   # seeds in parallel processes, then:
    python -m benchmarks.scaling --from-json benchmarks/results/part0.json benchmarks/results/part1.json ...
    python -m benchmarks.scaling --reuse-ablation benchmarks/results/ablation.json   # its 1x runs, same settings

Writes `<name>.json` (settings, versions, every run), `<name>.md` (the table) and `<name>.png` (loss against
compute, the fit and AttnRes's points) to `--output-dir` (default `benchmarks/results`).
"""

import argparse
import json
import math
import random
import statistics
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import ablation


DEFAULT_BUDGETS = (1.0, 1.5, 2.0)
DEFAULT_ARMS = ("block", "full")
BOOTSTRAP_SAMPLES = 2000
# The ablation's settings a reused run must share (its steps are the 1x budget's).
_SHARED = (
    "hidden_size",
    "intermediate_size",
    "layers",
    "heads",
    "block_size",
    "seq_len",
    "batch_size",
    "steps",
    "lr",
    "eval_every",
    "eval_sequences",
    "device",
    "dtype",
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--budgets",
        nargs="+",
        type=float,
        default=list(DEFAULT_BUDGETS),
        help="the baseline's budgets, as multiples of the 1x steps (the smallest is AttnRes's)",
    )
    parser.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=("block", "full"))
    parser.add_argument(
        "--reuse-ablation",
        type=Path,
        default=None,
        help="take the smallest budget's runs from an ablation JSON of the same settings",
    )
    parser.add_argument("--name", default="scaling")
    parser.add_argument("--output-dir", type=Path, default=ablation.RESULTS_DIR)
    parser.add_argument("--from-json", type=Path, nargs="+", default=None, help="merge finished reports, then report")
    args, rest = parser.parse_known_args(argv)
    if "--seeds" not in rest:
        rest += ["--seeds", "0", "1", "2"]
    if sorted(args.budgets) != args.budgets or args.budgets[0] <= 0 or len(set(args.budgets)) < 2:
        parser.error(f"--budgets {args.budgets}: must be increasing positive multiples, at least two")
    args.training = ablation.parse_args([*rest, "--name", args.name, "--output-dir", str(args.output_dir)])
    return args


def flops_per_token(run: dict, settings: dict) -> float:
    """Training FLOPs per token (module docstring)."""
    width, layers, context = settings["hidden_size"], settings["layers"], settings["seq_len"]
    dense = 6 * run["parameters"]  # the tied embedding counted once: as the output head, a matmul
    attention = 12 * layers * width * context / 2
    depth = 0.0
    if run["variant"] in ("block", "full"):
        from attnres.depth_mixing import num_depth_sources

        sublayers = 2 * layers
        block = 1 if run["variant"] == "full" else settings["block_size"]
        sources = sum(num_depth_sources(p, block, sublayers) for p in range(1, sublayers + 2))
        depth = 12 * width * sources
    return dense + attention + depth


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares `loss = a + b ln C` over (compute, loss) points."""
    xs = [math.log(c) for c, _ in points]
    ys = [loss for _, loss in points]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y - b * mean_x, b


def multiplier(runs: list[dict], settings: dict, arm: str, seeds: list[int]) -> float:
    """The baseline compute at which the fit reaches the arm's mean loss, over the arm's compute, for these seeds
    (repeats allowed: a bootstrap sample)."""
    by_seed = {}
    for run in runs:
        by_seed.setdefault(run["seed"], []).append(run)
    baseline = [
        (r["compute"], r["final_validation_loss"]) for s in seeds for r in by_seed[s] if r["variant"] == "baseline"
    ]
    arm_runs = [r for s in seeds for r in by_seed[s] if r["variant"] == arm]
    a, b = fit(baseline)
    loss = statistics.fmean(r["final_validation_loss"] for r in arm_runs)
    compute = statistics.fmean(r["compute"] for r in arm_runs)
    return math.exp((loss - a) / b) / compute


def summary(report: dict) -> dict:
    runs, settings = report["runs"], report["settings"]
    seeds = sorted({r["seed"] for r in runs})
    rng = random.Random(0)
    budgets = sorted({r["budget"] for r in runs if r["variant"] == "baseline"})
    span = [
        min(r["compute"] for r in runs if r["variant"] == "baseline"),
        max(r["compute"] for r in runs if r["variant"] == "baseline"),
    ]
    result = {
        "seeds": seeds,
        "fit": dict(
            zip(
                ("a", "b"),
                fit([(r["compute"], r["final_validation_loss"]) for r in runs if r["variant"] == "baseline"]),
            )
        ),
        "baseline_compute_span": span,
        "arms": {},
    }
    for arm in sorted({r["variant"] for r in runs} - {"baseline"}):
        estimate = multiplier(runs, settings, arm, seeds)
        samples = sorted(
            multiplier(runs, settings, arm, rng.choices(seeds, k=len(seeds))) for _ in range(BOOTSTRAP_SAMPLES)
        )
        low, high = samples[int(0.025 * len(samples))], samples[int(0.975 * len(samples)) - 1]
        arm_compute = statistics.fmean(r["compute"] for r in runs if r["variant"] == arm)
        reached = estimate * arm_compute
        result["arms"][arm] = {
            "multiplier": estimate,
            "interval_95": [low, high],
            "loss": [r["final_validation_loss"] for r in runs if r["variant"] == arm],
            "compute": arm_compute,
            "extrapolated": not span[0] <= reached <= span[1],
        }
    result["baseline_loss"] = {
        str(budget): [r["final_validation_loss"] for r in runs if r["variant"] == "baseline" and r["budget"] == budget]
        for budget in budgets
    }
    return result


def table(report: dict) -> str:
    s = report["summary"]
    lines = [
        f"Seeds {s['seeds']}; fit loss = {s['fit']['a']:.4f} + ({s['fit']['b']:.4f}) ln C over the baseline's runs.",
        "",
        "| run | budget | compute per run (FLOPs) | validation loss, mean ± sd (nats/byte) |",
        "|---|---|---|---|",
    ]
    for variant in ["baseline", *s["arms"]]:
        for budget in sorted({r["budget"] for r in report["runs"] if r["variant"] == variant}):
            group = [r for r in report["runs"] if r["variant"] == variant and r["budget"] == budget]
            losses = [r["final_validation_loss"] for r in group]
            sd = statistics.stdev(losses) if len(losses) > 1 else math.nan
            compute = statistics.fmean(r["compute"] for r in group)
            lines.append(f"| {variant} | {budget:g}x | {compute:.3e} | {statistics.fmean(losses):.4f} ± {sd:.4f} |")
    lines += [
        "",
        "| arm | compute-equivalent multiplier | 95% interval (bootstrap over seeds) | note |",
        "|---|---|---|---|",
    ]
    for arm, values in s["arms"].items():
        note = (
            "beyond the baseline's budgets: extrapolated" if values["extrapolated"] else "within the baseline's budgets"
        )
        low, high = values["interval_95"]
        lines.append(f"| {arm} | {values['multiplier']:.3f} | {low:.3f}-{high:.3f} | {note} |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = report["summary"]
    figure, axis = plt.subplots(figsize=(6, 4))
    for variant, marker in [("baseline", "o"), ("block", "s"), ("full", "^")]:
        group = [r for r in report["runs"] if r["variant"] == variant]
        if group:
            axis.scatter(
                [r["compute"] for r in group], [r["final_validation_loss"] for r in group], marker=marker, label=variant
            )
    low, high = s["baseline_compute_span"]
    xs = [low * (high / low) ** (i / 50) for i in range(51)]
    axis.plot(xs, [s["fit"]["a"] + s["fit"]["b"] * math.log(x) for x in xs], "k--", label="baseline fit")
    axis.set_xscale("log")
    axis.set_xlabel("training compute (FLOPs)")
    axis.set_ylabel("validation loss (nats/byte)")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_outputs(report: dict, output_dir: Path, name: str, final: bool) -> str:
    output_dir.mkdir(parents=True, exist_ok=True)
    if final:
        report["summary"] = summary(report)
    (output_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    if not final:
        return ""
    markdown = table(report)
    (output_dir / f"{name}.md").write_text(markdown + "\n")
    plot(report, output_dir / f"{name}.png")
    return markdown


def reused_runs(path: Path, training: argparse.Namespace, seeds: list[int], budget: float) -> list[dict]:
    """The ablation's runs of the smallest budget for these seeds; refuses an ablation of other settings."""
    report = json.loads(path.read_text())
    for key in _SHARED:
        if report["settings"][key] != vars(training)[key]:
            raise SystemExit(
                f"--reuse-ablation {path}: its {key}={report['settings'][key]!r}, here {vars(training)[key]!r}"
            )
    runs = [r for r in report["runs"] if r["seed"] in seeds and r["variant"] in ("baseline", "block", "full")]
    return [{**r, "budget": budget} for r in runs]


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    training = args.training
    if args.from_json is not None:
        report = ablation.merged_by_seed(args.from_json, key=lambda run: (run["variant"], run["seed"], run["budget"]))
        print(write_outputs(report, args.output_dir, args.name, final=True))
        return report
    if training.threads:
        torch.set_num_threads(training.threads)
    report = ablation.new_report(training, budgets=args.budgets, arms=args.arms)
    settings = report["settings"]
    smallest = args.budgets[0]
    reused = reused_runs(args.reuse_ablation, training, training.seeds, smallest) if args.reuse_ablation else []
    done = {(r["variant"], r["seed"]) for r in reused if r["variant"] in ("baseline", *args.arms)}
    rows = {row.name: row for row in ablation.variants(training)}
    train_split, validation_split = ablation.load_splits(training.data_dir)
    validation = ablation.validation_batches(validation_split, training)
    for seed in training.seeds:
        plan = [("baseline", budget) for budget in args.budgets] + [(arm, smallest) for arm in args.arms]
        for variant, budget in plan:
            if budget == smallest and (variant, seed) in done:
                report["runs"] += [r for r in reused if (r["variant"], r["seed"]) == (variant, seed)]
                continue
            steps = round(training.steps * budget)
            run_args = argparse.Namespace(**{**vars(training), "steps": steps, "eval_every": steps})
            batches = ablation.training_batches(train_split, run_args, seed)
            run, _ = ablation.train(rows[variant], seed, run_args, batches, validation)
            record = {**asdict(run), "budget": budget}
            report["runs"].append(record)
            print(f"{variant:<9} {budget:g}x seed {seed}  val {run.final_validation_loss:.4f}", flush=True)
            write_outputs(report, args.output_dir, args.name, final=False)
    for run in report["runs"]:
        run["compute"] = run["tokens"] * flops_per_token(run, settings)
    markdown = write_outputs(report, args.output_dir, args.name, final=len(training.seeds) >= 2)
    print(markdown)
    return report


if __name__ == "__main__":
    main()
