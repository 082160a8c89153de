"""A few pipeline-parallel training steps of tiny AttnRes models, for `test_pipeline.py`.

    torchrun --nproc_per_node 2 tests/distributed_pipeline.py --cases standard-gpipe block-1f1b --output DIR
    torchrun --nproc_per_node 4 tests/distributed_pipeline.py --cases block-interleaved-4 fsdp-2x2 --output DIR

Each case (`CASES`) builds the model `build_model` builds in the test's process, splits it into stages
(`attnres.training.pipeline`) and trains it for `STEPS` steps of SGD under the case's schedule (the mixed-precision
cases under `torch.autocast(bfloat16)`); the cases run one after another in one process group. Every rank writes
`DIR/rank{R}.pt`: per case and step, the parameters it holds before the step and their gradients (by the model's
parameter names, FSDP shards gathered), the step's loss (the mean over every microbatch), and the bytes its stages sent;
for the cases that save, the logits of an evaluation batch (last stage) and a checkpoint folder `DIR/<case>`.
"""

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM


sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import (  # noqa: E402
    TINY_SHAPE,
    enable_activation_checkpointing,
    exact_retrofit,
    randomize_depth_parameters,
    tiny_config,
)
from family_cases import source_model  # noqa: E402

from attnres import AttnResForCausalLM  # noqa: E402
from attnres.conversion.architectures import attnres_config  # noqa: E402
from attnres.training.pipeline import (  # noqa: E402
    CachingPipelineStage,
    PipelineLayout,
    PipelineLoss,
    full_tensor,
    pipeline_schedule,
    save_pipeline_checkpoint,
    stage_modules,
)


STEPS, BATCH, SEQ_LEN, LEARNING_RATE = 3, 8, 16, 0.5
SHAPE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)
MOE = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)
# 4 layers of the families whose attention passes state from layer to layer (their cases in tests/family_cases.py).
# GLM-5: layers 1 and 2 reuse the top-k indices of layer 0's indexer, layer 3 runs its own.
GLM_LAYOUT = dict(indexer_types=["full", "shared", "shared", "full"], mlp_layer_types=["dense"] + ["sparse"] * 3)
# Kolibri 1.1: layers 2 and 3 reuse the keys and values of layer 0, on 2 ranks x 2 stages one on the other stage of
# its rank and one on the other rank; the key pool of layer 0's indexer reaches every layer.
KOLIBRI_LAYOUT = dict(
    layer_types=["indexed_attention", "sliding_attention", "indexed_attention", "indexed_attention"],
    kv_source_layers=[0, 1, 0, 0],
)
# A sliding layer before the first indexer, whose key pool starts at layer 1, and a layer that reuses the keys and
# values of the layer before it, which no layer after layer 2 reads.
KOLIBRI_SLIDING_FIRST = dict(
    layer_types=["sliding_attention", "indexed_attention", "indexed_attention", "sliding_attention"],
    index_layers=[1],
    kv_source_layers=[0, 1, 1, 3],
)


class Case(NamedTuple):
    """One pipelined run: the model, how it is split and scheduled, and what is checked besides losses and
    gradients."""

    model: dict
    ranks: int
    stages_per_rank: int
    schedule: str
    microbatches: int
    cross_stage_cache: bool = True
    data_parallel: int = 1  # FSDP2 shards of each stage
    save: bool = False  # evaluation logits and a checkpoint
    # The steps under `torch.autocast(bfloat16)`, from a freshly converted Llama (`converted_model`).
    mixed_precision: bool = False
    # A case of tests/family_cases.py whose family model, `model` overriding its config, is converted (`family_model`).
    family: str | None = None


CASES = {
    # 2 ranks. 4 layers = 8 sublayers; one stage per rank holds 4 sublayers, two stages per rank hold 2.
    "standard-gpipe": Case(dict(residual_mode="standard", num_hidden_layers=4), 2, 1, "gpipe", 2),
    "block-1f1b": Case(dict(block_size=4, num_hidden_layers=4), 2, 1, "1f1b", 4, save=True),  # blocks = stages
    "block-spanning-1f1b": Case(dict(block_size=3, num_hidden_layers=4), 2, 1, "1f1b", 4),  # block 2 spans the cut
    "block-interleaved": Case(dict(block_size=3, num_hidden_layers=4), 2, 2, "interleaved-1f1b", 4, save=True),
    "block-interleaved-naive": Case(
        dict(block_size=3, num_hidden_layers=4), 2, 2, "interleaved-1f1b", 4, cross_stage_cache=False
    ),
    "full-looped-bfs": Case(dict(residual_mode="full", num_hidden_layers=4), 2, 2, "looped-bfs", 2),
    "moe-block-interleaved": Case(dict(block_size=4, num_hidden_layers=4, **MOE), 2, 2, "interleaved-1f1b", 4),
    "moe-standard-1f1b": Case(dict(residual_mode="standard", num_hidden_layers=4, **MOE), 2, 1, "1f1b", 2),
    # bf16 autocast, blocks of 3 spanning the cuts, cached; the family's own model (standard) the same way.
    "block-interleaved-bf16": Case(
        dict(block_size=3, num_hidden_layers=4), 2, 2, "interleaved-1f1b", 4, mixed_precision=True
    ),
    "standard-interleaved-bf16": Case(
        dict(residual_mode="standard", num_hidden_layers=4), 2, 2, "interleaved-1f1b", 4, mixed_precision=True
    ),
    # 4 ranks. 8 layers: two stages per rank hold one layer (2 sublayers) each, so blocks of 4 span two stages.
    "block-interleaved-4": Case(dict(block_size=4, num_hidden_layers=8), 4, 2, "interleaved-1f1b", 4),
    "block-interleaved-4-naive": Case(
        dict(block_size=4, num_hidden_layers=8), 4, 2, "interleaved-1f1b", 4, cross_stage_cache=False
    ),
    # What GLM-5's and Kolibri 1.1's attention passes from layer to layer crosses the boundaries.
    "glm-5-interleaved": Case(GLM_LAYOUT, 2, 2, "interleaved-1f1b", 4, family="glm_moe_dsa"),
    "kolibri-1.1-interleaved": Case(KOLIBRI_LAYOUT, 2, 2, "interleaved-1f1b", 4, family="kolibri1_1"),
    "kolibri-1.1-sliding-first-1f1b": Case(KOLIBRI_SLIDING_FIRST, 2, 1, "1f1b", 4, family="kolibri1_1"),
    # 4 processes: 2 stages, each sharded over 2 by FSDP2.
    "fsdp-2x2": Case(dict(block_size=3, num_hidden_layers=4, **MOE), 2, 1, "1f1b", 2, data_parallel=2, save=True),
}


def build_model(case: Case) -> AttnResForCausalLM:
    """The case's model, the same in every process: seeded, with random pseudo-queries (`converted_model` for the
    mixed-precision cases, `family_model` for a family's), activation checkpointing on (non-reentrant, the exact kind
    for MoE routers, docs/training.md)."""
    if case.mixed_precision:
        model = converted_model(case.model)
    elif case.family is not None:
        model = family_model(case.family, case.model)
    else:
        torch.manual_seed(0)
        model = AttnResForCausalLM(tiny_config(**SHAPE, **case.model))
        randomize_depth_parameters(model)
    enable_activation_checkpointing(model, use_reentrant=False)
    return model.train()


def converted_model(fields: dict) -> AttnResForCausalLM:
    """A seeded Llama of the tests' shape converted exactly (zero pseudo-queries: the function the Llama computes) to
    the residual mode of `fields`. Random pseudo-queries would make the function itself ill-conditioned in bf16
    (rounding the weights alone moves its gradients 15%, Llama's 0.8%), which is no measure of the pipeline."""
    torch.manual_seed(0)
    shape = {**TINY_SHAPE, **SHAPE, "num_hidden_layers": fields["num_hidden_layers"]}
    source = LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False, architectures=["LlamaForCausalLM"]))
    return exact_retrofit(source, fields.get("residual_mode", "block"), fields.get("block_size"))


def family_model(family_case: str, fields: dict) -> AttnResForCausalLM:
    """The seeded model of `family_case` (tests/family_cases.py), 4 layers with `fields` overriding its config,
    converted to Block AttnRes (blocks of 3 sublayers, spanning the cuts) with random pseudo-queries."""
    source = source_model(family_case, num_hidden_layers=4, **fields)
    config = attnres_config(source.config, mode="block", block_size=3, exact_retrofit=False)
    torch.manual_seed(0)
    model = AttnResForCausalLM(config)
    randomize_depth_parameters(model)
    return model


def batches(seed: int = 1) -> list[torch.Tensor]:
    """The global batch of every step, then an evaluation batch."""
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (BATCH, SEQ_LEN), generator=generator) for _ in range(STEPS + 1)]


def reference_step(model: AttnResForCausalLM, case: Case, batch: torch.Tensor) -> tuple[float, dict]:
    """One step's mean loss and every parameter's gradient in one process, over the same microbatches as the
    pipeline (each data-parallel shard's, in order), gradients accumulated."""
    chunks = case.microbatches * case.data_parallel
    model.zero_grad()
    total = 0.0
    for microbatch in batch.chunk(chunks):
        loss = model(input_ids=microbatch, labels=microbatch).loss / chunks
        loss.backward()
        total += loss.item()
    return total, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def run_case(name: str, case: Case, output: Path) -> dict:
    world, rank = dist.get_world_size(), dist.get_rank()
    if world != case.ranks * case.data_parallel:
        raise SystemExit(f"case {name} needs {case.ranks * case.data_parallel} processes, got {world}")
    model = build_model(case)
    pipeline_rank, data_rank = rank % case.ranks, rank // case.ranks
    if case.data_parallel > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (case.data_parallel, case.ranks), mesh_dim_names=("dp", "pp"))
        group, shards = mesh["pp"].get_group(), mesh["dp"]
    else:
        group, shards = None, None
    layout = PipelineLayout.of(model, case.ranks, case.stages_per_rank)
    modules = stage_modules(model, layout, pipeline_rank, case.cross_stage_cache)
    del model
    if shards is not None:
        for module in modules:
            for layer in module.model.layers.values():
                fully_shard(layer, mesh=shards)
            fully_shard(module, mesh=shards)
    stages = [CachingPipelineStage(module, torch.device("cpu"), group=group) for module in modules]
    schedule = pipeline_schedule(case.schedule, stages, case.microbatches, PipelineLoss(modules[0].config))
    parameters = [p for module in modules for p in module.parameters()]
    optimizer = torch.optim.SGD(parameters, lr=LEARNING_RATE)
    first, last = any(m.is_first for m in modules), any(m.is_last for m in modules)

    sharded = all(isinstance(p, DTensor) for p in parameters)
    result = {"losses": [], "parameters": [], "grads": [], "traffic": [], "sharded": sharded}
    *steps, evaluation = batches()
    for batch in steps:
        result["parameters"].append({name: full_tensor(p).clone() for m in modules for name, p in m.named_parameters()})
        batch = batch.chunk(case.data_parallel)[data_rank]
        losses = []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case.mixed_precision):
            schedule.step(*([batch] if first else []), **(dict(target=batch, losses=losses) if last else {}))
        # The step's loss: the mean over the microbatches, and over the data-parallel shards of the last stage.
        loss = torch.stack(losses).mean() / case.data_parallel if last else torch.zeros(())
        dist.all_reduce(loss)
        result["losses"].append(loss.item())
        result["grads"].append(
            {name: full_tensor(p.grad) for m in modules for name, p in m.named_parameters() if p.grad is not None}
        )
        result["traffic"].append([(stage.traffic.activations, stage.traffic.gradients) for stage in stages])
        for stage in stages:
            stage.traffic.activations = stage.traffic.gradients = 0
        optimizer.step()
        optimizer.zero_grad()
    if case.save:
        for module in modules:
            module.eval()
        with torch.no_grad():
            evaluation = evaluation.chunk(case.data_parallel)[data_rank]
            logits = schedule.eval(*([evaluation] if first else []), **(dict(target=evaluation) if last else {}))
        if last:
            result["logits"] = logits[0] if isinstance(logits, tuple) else logits  # MoE: (logits, load-balancing loss)
        save_pipeline_checkpoint(modules, output / name, group=None)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", choices=list(CASES), required=True)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    results = {name: run_case(name, CASES[name], args.output) for name in args.cases}
    torch.save(results, args.output / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
