"""A few training steps of a tiny AttnRes model, data-parallel or sharded, for `test_training.py`'s distributed tests.

    python tests/distributed_train.py --strategy single --output single.json
    torchrun --nproc_per_node 2 tests/distributed_train.py --strategy ddp --output ddp.json
    torchrun --nproc_per_node 2 tests/distributed_train.py --strategy fsdp --output fsdp.json

Every run sees the same global batches: each of the W processes takes its contiguous 1/W of the rows. All rows
have the same number of tokens, so the mean of the per-process mean losses is the global mean loss and the averaged
gradients are the single-process gradients; the losses of the three strategies agree up to float summation order.
Process 0 writes the global loss of every step as JSON.

`single` and `ddp` run through accelerate (on CPU it wraps the model in DDP over gloo). accelerate only offers FSDP on
accelerators (on CPU it silently falls back to DDP), so `fsdp` applies PyTorch's FSDP2 (`fully_shard`, the engine
accelerate's `fsdp_version: 2` uses on GPUs) itself: one unit per decoder layer, then the root.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.fsdp import fully_shard

from attnres import AttnResForCausalLM
from attnres.training import optimizer_groups


sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import tiny_config  # noqa: E402


GLOBAL_BATCH, SEQ_LEN = 8, 16


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", choices=("single", "ddp", "fsdp"), required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    if args.strategy == "fsdp":
        dist.init_process_group("gloo")
        world, rank = dist.get_world_size(), dist.get_rank()
    else:
        accelerator = Accelerator(cpu=True)
        world, rank = accelerator.num_processes, accelerator.process_index
    expected_world = 1 if args.strategy == "single" else 2
    if world != expected_world:
        raise SystemExit(f"--strategy {args.strategy} expects {expected_world} processes, got {world}")

    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config(residual_mode="block", block_size=2))
    if args.strategy == "fsdp":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    # FSDP2 keeps the parameter names (and shapes, as DTensors), so the weight-decay groups come out the same.
    optimizer = torch.optim.AdamW(optimizer_groups(model, weight_decay=0.1), lr=1e-2)
    if args.strategy != "fsdp":
        model, optimizer = accelerator.prepare(model, optimizer)

    data = torch.Generator().manual_seed(1)
    rows = GLOBAL_BATCH // world
    losses = []
    for _ in range(args.steps):
        batch = torch.randint(3, 96, (GLOBAL_BATCH, SEQ_LEN), generator=data)[rank * rows : (rank + 1) * rows]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()  # DDP and FSDP average the gradients over the processes here
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)

    if rank == 0:
        result = {
            "strategy": args.strategy,
            "world_size": world,
            "wrapper": type(model).__name__,  # DistributedDataParallel / FSDPAttnResForCausalLM
            "parameter": type(next(model.parameters())).__name__,  # DTensor when FSDP2 sharded the parameters
            "losses": losses,
        }
        args.output.write_text(json.dumps(result))
    # Tear down in order: every rank past its last collective, then the DDP / FSDP wrappers (which hold the process
    # group) released, then the group. Letting interpreter exit destroy them in arbitrary order could leave one rank
    # blocked in gloo's destructor after its peer had gone.
    if world > 1:
        dist.barrier()
    del model, optimizer
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
