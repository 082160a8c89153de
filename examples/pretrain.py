"""Pre-train a PreNorm baseline and AttnRes from scratch on Shakespeare, same seed, data and budget, and compare.

Byte-level (vocabulary 256: every UTF-8 byte is a token), so nothing is downloaded. Each model is trained with
`attnres.training.AttnResTrainer` (the Trainer with AttnRes's weight-decay groups) on the same random windows in the
same order; Macbeth and The Tempest are held out. Writes into `--output`:

    loss_curves.png   training and held-out loss of every model against steps
    results.md        the markdown table (also printed)
    results.json      every logged number

The defaults (a 4-layer, 128-wide model: 8 sublayers, so Block AttnRes with block size 4 has 2 blocks of 4
sublayers; 400 steps of 16 x 128 bytes) take a few minutes on a laptop CPU. One seed: a difference between the models
smaller than the seed-to-seed spread is not a result (`benchmarks/ablation.py` runs several seeds and says which
differences exceed it).

    python examples/pretrain.py
    python examples/pretrain.py --modes standard block full --block-size 2

To scale, widen and deepen the model and raise the budget; on GPUs add bf16 and launch with accelerate (see
examples/README.md for the FSDP / DeepSpeed configs):

    accelerate launch --config_file examples/accelerate/fsdp.yaml examples/pretrain.py \
        --hidden-size 768 --layers 12 --heads 12 --seq-len 512 --batch-size 32 --steps 20000 --bf16
"""

import argparse
import json
import math
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset
from transformers import TrainingArguments

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.training import AttnResTrainer, shakespeare_plays


EVAL_PLAYS = ("macbeth", "tempest")


class RandomWindows(Dataset):
    """`length` windows of `seq_len` bytes at offsets drawn once from `seed`: the same data for every model."""

    def __init__(self, stream: torch.Tensor, seq_len: int, length: int, seed: int):
        self.stream, self.seq_len = stream, seq_len
        generator = torch.Generator().manual_seed(seed)
        self.starts = torch.randint(0, stream.numel() - seq_len, (length,), generator=generator)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        window = self.stream[self.starts[index] : self.starts[index] + self.seq_len]
        return {"input_ids": window, "labels": window}


def byte_stream(texts: list[str]) -> torch.Tensor:
    return torch.frombuffer(bytearray("\n\n".join(texts).encode("utf-8")), dtype=torch.uint8).long()


def build_model(args: argparse.Namespace, mode: str) -> AttnResForCausalLM:
    config = AttnResConfig(
        vocab_size=256,
        hidden_size=args.hidden_size,
        intermediate_size=int(args.hidden_size * 8 / 3) // 16 * 16,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        max_position_embeddings=args.seq_len,
        residual_mode=mode,
        block_size=args.block_size,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(args.seed)  # the same initial shared weights for every mode
    return AttnResForCausalLM(config)


def train(args: argparse.Namespace, mode: str, train_data: Dataset, eval_data: Dataset) -> dict:
    model = build_model(args, mode)
    block_size = model.config.depth_block_size if mode != "standard" else None
    if block_size is not None:
        blocks = math.ceil(model.config.num_sublayers / block_size)
        print(f"{mode}: block size {block_size} sublayers, {blocks} blocks over {model.config.num_sublayers} sublayers")
    training_args = TrainingArguments(
        output_dir=str(args.output / mode),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=args.batch_size,
        learning_rate=args.lr,
        weight_decay=args.weight_decay,
        warmup_steps=max(1, args.steps // 20),
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        logging_steps=max(1, args.eval_every // 5),
        eval_strategy="steps",
        eval_steps=args.eval_every,
        save_strategy="no",
        report_to="none",
        bf16=args.bf16,
        seed=args.seed,
        data_seed=args.seed,
        dataloader_drop_last=True,
    )
    trainer = AttnResTrainer(model=model, args=training_args, train_dataset=train_data, eval_dataset=eval_data)
    started = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - started
    history = trainer.state.log_history
    return {
        "residual_mode": mode,
        "block_size": block_size,
        "num_blocks": math.ceil(model.config.num_sublayers / block_size) if block_size else None,
        "parameters": sum(p.numel() for p in model.parameters()),
        "seconds": seconds,
        "train": [(entry["step"], entry["loss"]) for entry in history if "loss" in entry],
        "eval": [(entry["step"], entry["eval_loss"]) for entry in history if "eval_loss" in entry],
    }


def plot(runs: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    for run, color in zip(runs, ("tab:gray", "tab:blue", "tab:orange", "tab:green")):
        steps, losses = zip(*run["train"])
        axes.plot(steps, losses, color=color, alpha=0.35, linewidth=1)
        steps, losses = zip(*run["eval"])
        axes.plot(steps, losses, color=color, marker="o", label=f"{run['residual_mode']} (held-out)")
    axes.set_xlabel("step")
    axes.set_ylabel("loss (nats / byte); faint: training")
    axes.set_title("Shakespeare, byte level: PreNorm baseline vs AttnRes")
    axes.legend()
    figure.savefig(path, dpi=120)


def table(runs: list[dict], args: argparse.Namespace) -> str:
    lines = [
        f"Byte-level Shakespeare, {args.layers} layers x {args.hidden_size} wide, {args.steps} steps x "
        f"{args.batch_size} x {args.seq_len} bytes, {2 * args.layers} sublayers, one seed ({args.seed}): "
        "differences smaller than the seed-to-seed spread (see benchmarks/ablation.py) are noise.",
        "",
        "| model | block size (sublayers) | blocks | parameters | final train loss | held-out loss "
        "| held-out bits/byte | time (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        final_eval = run["eval"][-1][1]
        lines.append(
            f"| {run['residual_mode']} | {run['block_size'] or '-'} | {run['num_blocks'] or '-'} | {run['parameters']:,} | "
            f"{run['train'][-1][1]:.4f} | {final_eval:.4f} | {final_eval / math.log(2):.4f} | {run['seconds']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", default=["standard", "block"], choices=["standard", "block", "full"])
    parser.add_argument(
        "--block-size", type=int, default=4, help="Block AttnRes: sublayers per block (at most 2 * --layers)"
    )
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="per device")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-windows", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast (GPUs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("pretrain-output"))
    args = parser.parse_args()
    args.output.mkdir(parents=True, exist_ok=True)

    plays = shakespeare_plays()
    train_stream = byte_stream([text for name, text in plays.items() if name not in EVAL_PLAYS])
    eval_stream = byte_stream([plays[name] for name in EVAL_PLAYS])
    train_data = RandomWindows(train_stream, args.seq_len, args.steps * args.batch_size, args.seed)
    eval_data = RandomWindows(eval_stream, args.seq_len, args.eval_windows, args.seed + 1)

    runs = [train(args, mode, train_data, eval_data) for mode in args.modes]
    plot(runs, args.output / "loss_curves.png")
    summary = table(runs, args)
    (args.output / "results.md").write_text(summary + "\n")
    (args.output / "results.json").write_text(
        json.dumps({"args": vars(args) | {"output": str(args.output)}, "runs": runs}, indent=1)
    )
    print(summary)
    print(f"\nWrote {args.output / 'loss_curves.png'}, results.md and results.json")


if __name__ == "__main__":
    main()
