"""What Block AttnRes costs under pipeline parallelism, against the family's own model pipelined the same way, and
the bytes its cross-stage caching saves.

Two pipelines run in the same processes under `torchrun` (2 ranks on gloo by default, one CPU thread each), on
PyTorch's engine with the same split, schedule and microbatches: `LlamaForCausalLM` split into stages of its own
modules that hand on the hidden states (`LlamaStage`), and AttnRes Block with the same shape and weights, split by
`attnres.training.pipeline` with cross-stage caching, and again without it (the naive baseline: every boundary sends
the whole depth state). A sample is one training step of the whole pipeline (forward and backward of every
microbatch, no optimizer), from a barrier to a barrier, timed on rank 0. The steps run in interleaved rounds, the
baseline right before each AttnRes pipeline, whose order rotates from round to round; each AttnRes sample's ratio is
its time over the mean of the baseline's samples right before and after it (`benchmarks.overhead.flanked_ratios`),
and a run reports the median ratio. The whole run is repeated in fresh processes (`--runs`): the spread of the runs'
medians is the run-to-run spread. Glibc keeps 64 MiB at the top of each heap (`MALLOC_TOP_PAD_`): the pipelines share
their processes' heaps, and a model whose frees hand pages back to the system would take page faults in the next
model's step (see `benchmarks/overhead.py`).

Bytes per step are what each pipeline's stages handed to the engine's sends, activations and their gradients, summed
over the ranks (`CachingPipelineStage.traffic`; for Llama, the hidden states' size); they do not depend on timing.

Usage:
    python -m benchmarks.pipeline                    # 2 ranks x 2 stages, interleaved 1F1B, 3 runs
    python -m benchmarks.pipeline --runs 1 --rounds 2 --layers 4 --hidden-size 64 --seq-len 64 \\
        --output /tmp/pipeline.json                  # a quick look

Run from the repository root as a module (see benchmarks/overhead.py). Prints a markdown table and writes JSON to
benchmarks/results/pipeline.json.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from torch import nn
from torch.distributed.pipelining import PipelineStage
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.masking_utils import create_causal_mask

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.training.pipeline import (
    MULTI_STAGE_SCHEDULES,
    CachingPipelineStage,
    PipelineLayout,
    PipelineLoss,
    pipeline_schedule,
    stage_modules,
)
from benchmarks.overhead import cpu_instructions, cpu_model, flanked_ratios, round_order


BASELINE, CACHED, NAIVE = "llama", "block", "block (naive)"
HEAP_TOP_PAD = "67108864"


def shape(args: argparse.Namespace) -> dict:
    """The benchmark's model shape: the overhead benchmark's `small` shape by default, untied (the first and last
    stages sit on different ranks)."""
    return dict(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=3 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


class LlamaStage(nn.Module):
    """A stage of `LlamaForCausalLM`: Llama's own modules for a range of layers, under the model's names, handing on
    the hidden states, as `LlamaModel.forward` runs them (the embedding on the first stage, the final norm and the
    LM head on the last)."""

    def __init__(self, model: LlamaForCausalLM, layers: range, first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        self.model = nn.Module()
        if first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layers})
        self.model.rotary_emb = model.model.rotary_emb
        if last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        hidden_states = self.model.embed_tokens(inputs) if self.first else inputs
        position_ids = torch.arange(hidden_states.shape[1]).unsqueeze(0)
        mask = create_causal_mask(self.config, hidden_states, None, None, position_ids=position_ids)
        position_embeddings = self.model.rotary_emb(hidden_states, position_ids=position_ids)
        for layer in self.model.layers.values():
            hidden_states = layer(
                hidden_states, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings
            )
        return self.lm_head(self.model.norm(hidden_states)) if self.last else hidden_states


class Pipeline:
    """One model's stages on this rank and the schedule that runs them: Llama's (`LlamaStage`, the engine's own
    `PipelineStage`) or AttnRes's, with or without cross-stage caching, split alike (`layout`)."""

    def __init__(
        self, name: str, model: nn.Module, layout: PipelineLayout, loss: PipelineLoss, args: argparse.Namespace
    ):
        rank = dist.get_rank()
        if name == BASELINE:
            stages = range(rank, layout.num_stages, layout.num_ranks)
            last = layout.num_stages - 1
            modules = [LlamaStage(model, layout.stage_layers[s], s == 0, s == last) for s in stages]
            self.stages = [PipelineStage(m, s, layout.num_stages, torch.device("cpu")) for m, s in zip(modules, stages)]
        else:
            modules = stage_modules(model, layout, rank, cross_stage_cache=name == CACHED)
            self.stages = [CachingPipelineStage(module, torch.device("cpu")) for module in modules]
        self.modules, self.layout = modules, layout
        self.schedule = pipeline_schedule(args.schedule, self.stages, args.microbatches, loss)
        self.first = any(stage.is_first for stage in self.stages)
        self.last = any(stage.is_last for stage in self.stages)

    def step(self, batch: torch.Tensor) -> float:
        """Seconds one training step of the whole pipeline takes (on every rank, from a barrier to a barrier)."""
        dist.barrier()
        start = time.perf_counter()
        inputs, targets = ([batch] if self.first else []), (dict(target=batch) if self.last else {})
        self.schedule.step(*inputs, **targets, return_outputs=False)
        dist.barrier()
        seconds = time.perf_counter() - start
        for module in self.modules:
            module.zero_grad(set_to_none=True)
        return seconds

    def bytes_per_step(self, batch: torch.Tensor) -> dict[str, int]:
        """Bytes one step sends over every rank: activations and gradients. The engine's stages for Llama count
        nothing, so its hidden states are counted from the layout (one tensor per boundary and microbatch)."""
        if isinstance(self.stages[0], CachingPipelineStage):
            for stage in self.stages:
                stage.traffic.activations = stage.traffic.gradients = 0
            self.step(batch)
            sent = torch.tensor([[stage.traffic.activations, stage.traffic.gradients] for stage in self.stages]).sum(0)
            dist.all_reduce(sent)
            return {"activations": int(sent[0]), "gradients": int(sent[1])}
        per_boundary = batch.numel() * self.modules[0].config.hidden_size * 4
        total = per_boundary * (self.layout.num_stages - 1)
        return {"activations": total, "gradients": total}


def worker(args: argparse.Namespace) -> None:
    """One run: both pipelines built in this process group, warmed up, then timed in interleaved rounds."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    llama = LlamaForCausalLM(LlamaConfig(**shape(args)))
    # AttnRes with Llama's weights (its own parameters keep their initial values); the cached and naive pipelines
    # run the same modules.
    block = AttnResForCausalLM(AttnResConfig(**shape(args), residual_mode="block", block_size=args.block_size))
    missing, unexpected = block.load_state_dict(llama.state_dict(), strict=False)
    assert not unexpected and all(key.endswith(("pseudo_query", "key_norm_weight")) for key in missing)
    layout = PipelineLayout.of(block, dist.get_world_size(), args.stages_per_rank)
    models = {BASELINE: llama, CACHED: block, NAIVE: block}
    loss = PipelineLoss(block.config)  # the causal-LM loss, the same function for every pipeline
    pipelines = {name: Pipeline(name, model, layout, loss, args) for name, model in models.items()}
    generator = torch.Generator().manual_seed(0)
    batch = torch.randint(0, args.vocab_size, (args.batch_size, args.seq_len), generator=generator)
    traffic = {name: pipeline.bytes_per_step(batch) for name, pipeline in pipelines.items()}  # also warms up
    for pipeline in pipelines.values():
        pipeline.step(batch)
    sequence = []
    for index in range(args.rounds):
        for name in round_order(BASELINE, [CACHED, NAIVE], index):
            sequence.append((name, pipelines[name].step(batch)))
    sequence.append((BASELINE, pipelines[BASELINE].step(batch)))  # the last sample's right flank
    if dist.get_rank() == 0:
        args.worker_output.write_text(json.dumps({"sequence": sequence, "traffic": traffic}))
    dist.barrier()
    dist.destroy_process_group()


def run_once(args: argparse.Namespace, folder: Path, index: int) -> dict:
    """One run of `worker` under torchrun, in fresh processes."""
    output = folder / f"run{index}.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.ranks)]
    command += ["-m", "benchmarks.pipeline", "--worker-output", str(output), *sys.argv[1:]]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_TOP_PAD_": HEAP_TOP_PAD}
    subprocess.run(command, check=True, env=env)
    return json.loads(output.read_text())


def summary(run: dict) -> dict:
    """A run's step times and ratios to the baseline: medians and quartiles."""
    sequence = [(name, seconds) for name, seconds in run["sequence"]]
    rows = {}
    for name in (BASELINE, CACHED, NAIVE):
        ratios = flanked_ratios(sequence, name, BASELINE)
        quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
        rows[name] = {
            "step_s": statistics.median(seconds for sample, seconds in sequence if sample == name),
            "ratio": statistics.median(ratios),
            "ratio_quartiles": [quartiles[0], quartiles[2]],
            "samples": len(ratios),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--stages-per-rank", type=int, default=2)
    parser.add_argument("--schedule", choices=list(MULTI_STAGE_SCHEDULES), default="interleaved-1f1b")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=2, help="sublayers per block (2: one block per layer)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=40, help="timed rounds per run")
    parser.add_argument("--runs", type=int, default=3, help="runs in fresh processes: the run-to-run spread")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "pipeline.json")
    parser.add_argument("--worker-output", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_output is not None:
        return worker(args)
    if args.batch_size % args.microbatches:
        parser.error(f"--microbatches={args.microbatches}: must divide --batch-size={args.batch_size}")

    with tempfile.TemporaryDirectory() as folder:
        runs = [run_once(args, Path(folder), index) for index in range(args.runs)]
    summaries = [summary(run) for run in runs]
    traffic = runs[0]["traffic"]
    rows = []
    for name in (BASELINE, CACHED, NAIVE):
        medians = [run[name]["ratio"] for run in summaries]
        rows.append(
            {
                "model": name,
                "step_s": statistics.median(run[name]["step_s"] for run in summaries),
                "ratio": statistics.median(medians),
                "ratio_runs": medians,
                "ratio_spread": [min(medians), max(medians)],
                "bytes_per_step": traffic[name],
            }
        )
    print(
        f"| model | step ({args.ranks} ranks x {args.stages_per_rank} stages, {args.schedule}, {args.microbatches} "
        "microbatches) | ratio to Llama (median of runs) | runs' medians: min - max | bytes sent per step "
        "(activations + gradients) |"
    )
    print("|" + "---|" * 5)
    for row in rows:
        sent = row["bytes_per_step"]
        print(
            f"| {row['model']} | {row['step_s'] * 1e3:.0f} ms | {row['ratio']:.3f}x | {row['ratio_spread'][0]:.3f}x - "
            f"{row['ratio_spread'][1]:.3f}x | {sent['activations'] / 2**20:.2f} + {sent['gradients'] / 2**20:.2f} MiB |"
        )
    settings = {key: value for key, value in vars(args).items() if key not in ("output", "worker_output")}
    machine = {
        "processor": cpu_model(),
        **cpu_instructions(),
        "threads_per_rank": 1,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "MALLOC_TOP_PAD_": HEAP_TOP_PAD,
    }
    result = {"machine": machine, "settings": settings, "rows": rows, "runs": summaries}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.output.name}")


if __name__ == "__main__":
    main()
