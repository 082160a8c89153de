"""Pre-train the PreNorm baseline and AttnRes as examples/pretrain.py does, pipeline-parallel under torchrun.

The same byte-level Shakespeare windows, model flags and outputs (`loss_curves.png`, `results.md`, `results.json` in
`--output`) as examples/pretrain.py; the model is split into pipeline stages on PyTorch's engine
(`torch.distributed.pipelining`, through `attnres.training.pipeline`), each rank running `--stages-per-rank` of them,
and AttnRes boundaries send each completed block once per rank (cross-stage caching, docs/design.md §11). The
recipe and what is supported: docs/training.md#pipeline-parallel.

    torchrun --nproc_per_node 2 examples/pretrain_pp.py
    torchrun --nproc_per_node 2 examples/pretrain_pp.py --layers 8 --stages-per-rank 2 \\
        --schedule interleaved-1f1b --microbatches 4 --activation-checkpointing

`--batch-size` is the batch of the whole pipeline (its ranks share every batch), split into `--microbatches`. On
GPUs each rank takes the GPU of its local rank (NCCL); on the CPU, gloo. Bad flags are refused in one line before
any process group starts.
"""

import argparse
import json
import math
import os
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist
from pretrain import EVAL_PLAYS, RandomWindows, build_model, byte_stream, plot, table
from torch import nn
from transformers import get_cosine_schedule_with_warmup

from attnres.training import optimizer_groups, shakespeare_plays
from attnres.training.pipeline import (
    MULTI_STAGE_SCHEDULES,
    SCHEDULES,
    SINGLE_STAGE_SCHEDULES,
    CachingPipelineStage,
    PipelineLayout,
    PipelineLoss,
    clip_grad_norm,
    pipeline_schedule,
    stage_modules,
)


class OneLineParser(argparse.ArgumentParser):
    """Reports a bad flag in one line, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def parse_arguments() -> argparse.Namespace:
    parser = OneLineParser(description=__doc__.split("\n\n")[0])
    # examples/pretrain.py's flags
    parser.add_argument("--modes", nargs="+", default=["standard", "block"], choices=["standard", "block", "full"])
    parser.add_argument("--block-size", type=int, default=4, help="Block AttnRes: sublayers per block")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=16, help="per pipeline, split into --microbatches")
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--eval-every", type=int, default=50)
    parser.add_argument("--eval-windows", type=int, default=64, help="rounded up to whole batches")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=Path("pretrain-pp-output"))
    # the pipeline
    parser.add_argument("--stages-per-rank", type=int, default=1, help="more than 1 needs an interleaved schedule")
    parser.add_argument("--schedule", choices=list(SCHEDULES), default="1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--no-cross-stage-cache", action="store_true", help="send the whole depth state every time")
    parser.add_argument("--activation-checkpointing", action="store_true")
    args = parser.parse_args()

    # Checked here, before any process group starts: torchrun has set the world size.
    world = int(os.environ.get("WORLD_SIZE", "1"))
    stages = world * args.stages_per_rank
    if world < 2:
        parser.error(f"WORLD_SIZE={world}: run under torchrun with --nproc_per_node 2 or more")
    if args.stages_per_rank < 1 or stages > args.layers:
        parser.error(
            f"--stages-per-rank={args.stages_per_rank}: {world} ranks x {args.stages_per_rank} = {stages} stages, "
            f"more than the {args.layers} decoder layers (--layers); each stage needs at least one"
        )
    if args.microbatches < 1 or args.batch_size % args.microbatches:
        parser.error(f"--microbatches={args.microbatches}: must divide --batch-size={args.batch_size}")
    if args.schedule in SINGLE_STAGE_SCHEDULES and args.stages_per_rank != 1:
        parser.error(
            f"--schedule={args.schedule} runs one stage per rank; with --stages-per-rank={args.stages_per_rank} use "
            f"{' or '.join(MULTI_STAGE_SCHEDULES)}"
        )
    rounds = max(1, args.microbatches // world)
    if args.schedule == "interleaved-1f1b" and args.microbatches % rounds:
        parser.error(
            f"--microbatches={args.microbatches}: interleaved-1f1b runs rounds of {world} ranks, so a multiple of "
            f"{world} or fewer than {2 * world}"
        )
    return args


class Pipeline:
    """One model's stages on this rank, with the schedule, optimizer and learning-rate schedule that train them."""

    def __init__(self, args: argparse.Namespace, mode: str, device: torch.device):
        model = build_model(args, mode).to(device)
        self.config = model.config
        if args.activation_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = PipelineLayout.of(model, world, args.stages_per_rank)
        self.modules = stage_modules(model, layout, rank, cross_stage_cache=not args.no_cross_stage_cache)
        self.stages = [CachingPipelineStage(module, device) for module in self.modules]
        self.schedule = pipeline_schedule(args.schedule, self.stages, args.microbatches, PipelineLoss(model.config))
        self.first = any(module.is_first for module in self.modules)
        self.last = any(module.is_last for module in self.modules)
        self.last_rank = layout.rank(layout.num_stages - 1)
        self.optimizer = torch.optim.AdamW(optimizer_groups(nn.ModuleList(self.modules), args.weight_decay), lr=args.lr)
        self.lr_schedule = get_cosine_schedule_with_warmup(self.optimizer, max(1, args.steps // 20), args.steps)
        self.device, self.bf16 = device, args.bf16

    def run(self, batch: torch.Tensor, train: bool) -> float:
        """One schedule step on `batch` (forward and backward when training), its mean loss on every rank."""
        losses = []
        inputs = (batch,) if self.first else ()
        targets = dict(target=batch, losses=losses) if self.last else {}
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
            if train:
                self.schedule.step(*inputs, **targets, return_outputs=False)
            else:
                for module in self.modules:
                    module.eval()
                with torch.no_grad():
                    self.schedule.eval(*inputs, **targets)
                for module in self.modules:
                    module.train()
        loss = torch.stack(losses).mean().float().cpu() if self.last else torch.zeros(())
        dist.broadcast(loss, src=self.last_rank)
        return loss.item()

    def train_step(self, batch: torch.Tensor) -> float:
        loss = self.run(batch, train=True)
        clip_grad_norm(self.modules, max_norm=1.0)
        self.optimizer.step()
        self.lr_schedule.step()
        self.optimizer.zero_grad()
        return loss

    def parameters(self) -> int:
        """The model's parameter count, over every rank's stages."""
        count = torch.tensor(sum(p.numel() for module in self.modules for p in module.parameters()))
        dist.all_reduce(count)
        return int(count)


def train(args: argparse.Namespace, mode: str, device: torch.device, train_data, eval_data) -> dict:
    pipeline = Pipeline(args, mode, device)
    block_size = pipeline.config.depth_block_size if mode != "standard" else None
    order = torch.randperm(len(train_data), generator=torch.Generator().manual_seed(args.seed))
    logging_steps = max(1, args.eval_every // 5)
    train_losses, eval_losses = [], []
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        indices = order[(step - 1) * args.batch_size : step * args.batch_size]
        batch = torch.stack([train_data[int(i)]["input_ids"] for i in indices]).to(device)
        loss = pipeline.train_step(batch)
        if step % logging_steps == 0:
            train_losses.append((step, loss))
        if step % args.eval_every == 0 or step == args.steps:
            batches = eval_data.split(args.batch_size)
            eval_losses.append((step, sum(pipeline.run(b.to(device), train=False) for b in batches) / len(batches)))
            if dist.get_rank() == 0:
                print(f"{mode}: step {step}, held-out loss {eval_losses[-1][1]:.4f}")
    return {
        "residual_mode": mode,
        "block_size": block_size,
        "num_blocks": math.ceil(pipeline.config.num_sublayers / block_size) if block_size else None,
        "parameters": pipeline.parameters(),
        "seconds": time.perf_counter() - started,
        "train": train_losses,
        "eval": eval_losses,
    }


def main() -> None:
    args = parse_arguments()
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    args.output.mkdir(parents=True, exist_ok=True)

    plays = shakespeare_plays()
    train_stream = byte_stream([text for name, text in plays.items() if name not in EVAL_PLAYS])
    eval_stream = byte_stream([plays[name] for name in EVAL_PLAYS])
    train_data = RandomWindows(train_stream, args.seq_len, args.steps * args.batch_size, args.seed)
    eval_windows = math.ceil(args.eval_windows / args.batch_size) * args.batch_size
    eval_set = RandomWindows(eval_stream, args.seq_len, eval_windows, args.seed + 1)
    eval_data = torch.stack([eval_set[i]["input_ids"] for i in range(len(eval_set))])

    runs = [train(args, mode, device, train_data, eval_data) for mode in args.modes]
    if dist.get_rank() == 0:
        plot(runs, args.output / "loss_curves.png")
        summary = table(runs, args)
        (args.output / "results.md").write_text(summary + "\n")
        settings = vars(args) | {"output": str(args.output), "world_size": dist.get_world_size()}
        (args.output / "results.json").write_text(json.dumps({"args": settings, "runs": runs}, indent=1))
        print(summary)
        print(f"\nWrote {args.output / 'loss_curves.png'}, results.md and results.json")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
