"""What the models do per decoded token around the family's modules: the Python of the decoder loop, the depth mixing
and the norms, with the family's own token mixers, MLPs and output head replaced by stand-ins that return their input.
On the CPU at the small shapes a decoded token's matrix products take milliseconds, and the rest is this work: what
AttnRes adds at decode (`overhead.py`) is the difference of this work between the models, which this measures to a
few microseconds where whole tokens vary by percents.

Every model of a shape (the family's own model and the AttnRes modes, built as `overhead.py` builds them) runs in one
process on one thread, with a cache that holds a prompt of 4 tokens (run before the stand-ins replace the modules, so
that each model reads a cache as it does in decoding). The models decode one token each in turn, round after round,
so that a drift of the machine's speed falls on all alike; the first fifth of the rounds warms up. The table gives
each model's median time per token and its difference to the family's model. The stand-ins replace the modules that
the family's row names for each sublayer (`families.Sublayer`); a shape whose layers hold other mixers (recurrent,
stateful) is refused.

Usage:
    python -m benchmarks.decode_overhead --shapes small-deepseek-v3 small-qwen3 \
        --output benchmarks/results/decode_overhead.json   # 20,000 tokens per model (about 4 minutes)
"""

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn
from transformers import DynamicCache

from attnres import AttnResConfig
from attnres.families import ATTENTION, FAMILIES, FEED_FORWARD, Sublayer
from benchmarks.overhead import SHAPES, build_with_baseline_weights, cpu_instructions, cpu_model, model_names


PROMPT_TOKENS = 4


class AttentionStandIn(nn.Module):
    """An attention module that returns its input as its output, and no attention weights."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, None]:
        return hidden_states * 1.0, None


class FeedForwardStandIn(nn.Module):
    """An MLP or MoE that returns its input."""

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return hidden_states * 1.0


class HeadStandIn(nn.Module):
    """An output head whose logits are the first 8 features."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states[..., :8]


STAND_INS = {ATTENTION: AttentionStandIn, FEED_FORWARD: FeedForwardStandIn}


def replaced_modules(shape: str) -> list[list[Sublayer]]:
    """Per layer, the family's modules that the stand-ins replace (`Sublayer.summands`); a `ValueError` that names
    the first module of another kind, before any model is built."""
    config = AttnResConfig(**SHAPES[shape])
    family = FAMILIES[config.family]
    layers = []
    for layer_idx in range(config.num_hidden_layers):
        parts = [part for sublayer in family.sublayers_of(config, layer_idx) for part in sublayer.summands]
        for part in parts:
            if part.call not in STAND_INS or "." in part.module:
                raise ValueError(
                    f"argument --shapes: {shape!r} has the {part.call} module {part.module!r} in layer "
                    f"{layer_idx}; stand-ins replace attention and feed-forward modules only"
                )
        layers.append(parts)
    return layers


def with_stand_ins(shape: str, name: str, modules: list[list[Sublayer]]) -> tuple[nn.Module, DynamicCache]:
    """The model `name` of the shape with a cache that holds a prompt, then with `modules` and its output head
    replaced by stand-ins (the family's model holds its modules under the same names as the AttnRes layers)."""
    model = build_with_baseline_weights(shape, name).eval()
    cache = DynamicCache(config=model.config)
    prompt = torch.randint(0, model.config.vocab_size, (1, PROMPT_TOKENS), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model(prompt, cache=cache, use_cache=True)
    for layer, parts in zip(model.model.layers, modules, strict=True):
        for part in parts:
            setattr(layer, part.module, STAND_INS[part.call]())
    model.lm_head = HeadStandIn()
    return model, cache


def seconds_per_token(shape: str, modules: list[list[Sublayer]], rounds: int) -> dict[str, float]:
    """Each model's median seconds per decoded token with `modules` stood in for (`replaced_modules`), the models
    decoding in turn for `rounds` rounds."""
    models = {name: with_stand_ins(shape, name, modules) for name in model_names(shape)}
    token, position = torch.tensor([[1]]), torch.tensor([[PROMPT_TOKENS]])
    samples = {name: [] for name in models}
    with torch.inference_mode():
        for _ in range(rounds):
            for name, (model, cache) in models.items():
                start = time.perf_counter()
                model(token, cache=cache, position_ids=position, use_cache=True)
                samples[name].append(time.perf_counter() - start)
    warm = rounds // 5
    return {name: statistics.median(times[warm:]) for name, times in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["small-deepseek-v3"], choices=list(SHAPES))
    parser.add_argument("--rounds", type=int, default=20000, help="tokens each model decodes")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "decode_overhead.json")
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error(f"argument --rounds: {args.rounds} is fewer than 5 (the first fifth warms up)")
    try:
        modules = {shape: replaced_modules(shape) for shape in args.shapes}
    except ValueError as error:
        parser.error(str(error))
    torch.set_num_threads(1)
    rows = []
    for shape in args.shapes:
        print(f"{shape}: {args.rounds} rounds", file=sys.stderr)
        times = seconds_per_token(shape, modules[shape], args.rounds)
        baseline = times[SHAPES[shape]["family"]]
        rows += [{"shape": shape, "model": name, "token_us": s * 1e6, "added_us": (s - baseline) * 1e6}
                 for name, s in times.items()]
    print("| shape | model | per token, stand-ins | added to the family's |")
    print("|---|---|---|---|")
    for row in rows:
        print(f"| {row['shape']} | {row['model']} | {row['token_us']:.0f} µs | {row['added_us']:+.0f} µs |")
    machine = {"processor": cpu_model(), **cpu_instructions(), "threads": 1, "torch": torch.__version__,
               "python": platform.python_version()}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": machine, "rounds": args.rounds, "rows": rows}, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
