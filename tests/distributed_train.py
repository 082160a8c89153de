"""A few training steps of a tiny Block AttnRes model and of the Llama it was converted from, data-parallel or
sharded, in fp32 and in bf16, for `test_training.py`'s distributed tests.

    python tests/distributed_train.py --runs single --output single.json
    torchrun --nproc_per_node 2 tests/distributed_train.py --runs ddp fsdp fsdp-bf16 --output fp32.json
    accelerate launch --multi_gpu --num_processes 2 --mixed_precision bf16 tests/distributed_train.py --runs ddp \
        --output bf16.json

Each run trains both models (`MODELS`) from the same weights: a seeded `LlamaForCausalLM`, and its exact retrofit to
Block AttnRes (blocks of 2 sublayers, zero pseudo-queries), which computes the same function before the first step.

Every run sees the same global batches: each of the W processes takes its contiguous 1/W of the rows. All rows
have the same number of tokens, so the mean of the per-process mean losses is the global mean loss and the averaged
gradients are the single-process gradients; the losses of the fp32 strategies agree up to float summation order.
Process 0 writes, per run and model, the global loss of every step as JSON.

`single` and `ddp` run through accelerate (on CPU it wraps the model in DDP over gloo), in the precision the launcher
sets: `accelerate launch --mixed_precision bf16` runs the forward pass under `torch.autocast(bfloat16)`. accelerate only
offers FSDP on accelerators (on CPU it silently falls back to DDP), so `fsdp` applies PyTorch's FSDP2 (`fully_shard`,
the engine accelerate's `fsdp_version: 2` uses on GPUs) itself: one unit per decoder layer, then the root;
`fsdp-bf16` does so with `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`, so the forward and
backward passes run on bf16 parameters (the whole depth state is bf16) and the gradients are reduced in fp32 into the
fp32 shards the optimizer steps.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel

from attnres import AttnResForCausalLM
from attnres.training import optimizer_groups


sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import TINY_SHAPE, exact_retrofit  # noqa: E402


GLOBAL_BATCH, SEQ_LEN = 8, 16
MODELS = ("attnres", "llama")
RUNS = ("single", "ddp", "fsdp", "fsdp-bf16")


def build_model(name: str) -> PreTrainedModel:
    """`llama`: a seeded Llama of the tests' tiny shape; `attnres`: its exact retrofit to Block AttnRes."""
    torch.manual_seed(0)
    source = LlamaForCausalLM(LlamaConfig(**TINY_SHAPE, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]))
    return source if name == "llama" else exact_retrofit(source, "block", block_size=2)


def record_dtypes(model: PreTrainedModel) -> dict[str, list[str]]:
    """Hooks filling in the dtypes the first forward pass computes in: `matmul`, the first query projection's output;
    `stream`, the residual stream as the final norm reads it (Llama), or every tensor of the depth state that the
    output's depth mixing reads, the completed blocks and the partial sum (AttnRes)."""
    dtypes = {}
    backbone = model.model

    def remember(key: str, value: torch.Tensor | tuple) -> None:
        tensors = [value] if isinstance(value, torch.Tensor) else [*value.blocks, value.partial]
        dtypes.setdefault(key, sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t is not None}))

    backbone.layers[0].self_attn.q_proj.register_forward_hook(lambda module, args, output: remember("matmul", output))
    stream_reader = backbone.output_residual if isinstance(model, AttnResForCausalLM) else backbone.norm
    stream_reader.register_forward_pre_hook(lambda module, args: remember("stream", args[0]))
    return dtypes


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter or gradient whole: an FSDP2 shard (a DTensor) is gathered, a collective of every rank."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach()


def fp32_step(reference: PreTrainedModel, trained: torch.nn.Module, global_batch: torch.Tensor) -> tuple[float, float]:
    """The fp32 loss of `global_batch` from the parameters `trained` holds, and the relative error of the gradients
    `trained` holds (those of that batch, averaged over the processes) against the fp32 gradients."""
    held = dict(trained.named_parameters())
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            parameter.copy_(whole(held[name]))
    grads = {name: whole(held[name].grad) for name, _ in reference.named_parameters()}
    reference.zero_grad()
    loss = reference(input_ids=global_batch, labels=global_batch).loss
    loss.backward()
    error = sum((grads[name] - p.grad).pow(2).sum() for name, p in reference.named_parameters()).sqrt()
    norm = sum(p.grad.pow(2).sum() for p in reference.parameters()).sqrt()
    return loss.item(), (error / norm).item()


def train(name: str, run: str, accelerator: Accelerator, steps: int) -> dict:
    world, rank = dist.get_world_size() if dist.is_initialized() else 1, accelerator.process_index
    model = build_model(name)
    dtypes = record_dtypes(model)
    if run.startswith("fsdp"):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        options = dict(mp_policy=policy) if run == "fsdp-bf16" else {}
        for layer in model.model.layers:
            fully_shard(layer, **options)
        fully_shard(model, **options)
    # FSDP2 keeps the parameter names (and shapes, as DTensors), so the weight-decay groups come out the same.
    optimizer = torch.optim.AdamW(optimizer_groups(model, weight_decay=0.1), lr=1e-2)
    if not run.startswith("fsdp"):
        model, optimizer = accelerator.prepare(model, optimizer)

    # A bf16 run is compared with fp32 at every step from the same parameters: an fp32 copy of the model computes the
    # loss and gradients of the same global batch from the parameters the run holds before its update.
    compared = run == "fsdp-bf16" or accelerator.mixed_precision == "bf16"
    reference = build_model(name) if compared else None
    trained = accelerator.unwrap_model(model) if not run.startswith("fsdp") else model
    data = torch.Generator().manual_seed(1)
    rows = GLOBAL_BATCH // world
    losses, fp32_losses, grad_errors = [], [], []
    for _ in range(steps):
        global_batch = torch.randint(3, 96, (GLOBAL_BATCH, SEQ_LEN), generator=data)
        batch = global_batch[rank * rows : (rank + 1) * rows]
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()  # DDP and FSDP average the gradients over the processes here
        if compared:
            fp32_loss, grad_error = fp32_step(reference, trained, global_batch)
            fp32_losses.append(fp32_loss)
            grad_errors.append(grad_error)
        optimizer.step()
        optimizer.zero_grad()
        global_loss = loss.detach().float()
        if world > 1:
            dist.all_reduce(global_loss)
        losses.append(global_loss.item() / world)

    result = {
        "world_size": world,
        "precision": "bf16" if run == "fsdp-bf16" else accelerator.mixed_precision,
        "wrapper": type(model).__name__,  # DistributedDataParallel / FSDPAttnResForCausalLM
        "parameter": type(next(model.parameters())).__name__,  # DTensor when FSDP2 sharded the parameters
        "dtypes": dtypes,
        "losses": losses,
        "fp32_losses": fp32_losses,  # bf16 runs: the fp32 loss at the same parameters
        "grad_errors": grad_errors,  # bf16 runs: |g - g_fp32| / |g_fp32| over every parameter's gradient
    }
    # Every rank past its last collective before the DDP / FSDP wrappers (which hold the process group) go.
    if world > 1:
        dist.barrier()
    del model, optimizer
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", nargs="+", choices=RUNS, required=True)
    parser.add_argument("--output", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)  # its process group (gloo) is FSDP's too
    expected_world = 1 if args.runs == ["single"] else 2
    if accelerator.num_processes != expected_world or ("single" in args.runs and len(args.runs) > 1):
        runs = " ".join(args.runs)
        raise SystemExit(f"--runs {runs} expects {expected_world} processes, got {accelerator.num_processes}")
    if accelerator.mixed_precision != "no" and any(run.startswith("fsdp") for run in args.runs):
        raise SystemExit("--runs fsdp / fsdp-bf16 set their own precision: launch them without --mixed_precision")

    results = {run: {name: train(name, run, accelerator, args.steps) for name in MODELS} for run in args.runs}
    if accelerator.is_main_process:
        args.output.write_text(json.dumps(results))
    # Tear down in order: the wrappers are gone (`train`), then the group. Letting interpreter exit destroy them in
    # arbitrary order could leave one rank blocked in gloo's destructor after its peer had gone.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
