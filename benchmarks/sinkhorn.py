"""What mHC's Sinkhorn-Knopp that stays finite at any logit costs: an mHC model's training step with the model's
`sinkhorn_knopp` (its first iteration in the log domain, the rest in the linear domain) against the same step with
the linear-domain Eq. 9 it replaced (one maximum subtracted per matrix, then plain column and row sums), in the same
process, interleaved round by round.

    python -m benchmarks.sinkhorn                 # 2-core CPU: about 2 minutes
    python -m benchmarks.sinkhorn --rounds 40 --layers 12 --hidden-size 64 --seq-len 128 --batch-size 8

Prints a table and writes `benchmarks/results/sinkhorn.json` (settings, versions, every round's times).
"""

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import transformers

from attnres import AttnResConfig, AttnResForCausalLM
from attnres import residual_variants


RESULTS = Path(__file__).resolve().parent / "results" / "sinkhorn.json"


def linear_domain_sinkhorn(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """Eq. 9 in the linear domain, as the model computed it before: exact only while no column underflows."""
    matrix = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iterations):
        matrix = matrix / matrix.sum(dim=-2, keepdim=True)
        matrix = matrix / matrix.sum(dim=-1, keepdim=True)
    return matrix


def step_seconds(model: AttnResForCausalLM, ids: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
    started = time.perf_counter()
    loss = model(ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    config = AttnResConfig(
        vocab_size=256,
        hidden_size=args.hidden_size,
        intermediate_size=4 * args.hidden_size,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        residual_mode="mhc",
    )
    model = AttnResForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(256, (args.batch_size, args.seq_len), generator=torch.Generator().manual_seed(0))
    implementations = {
        "log-domain first iteration (model)": residual_variants.sinkhorn_knopp,
        "linear domain": linear_domain_sinkhorn,
    }
    times = {name: [] for name in implementations}
    for _ in range(3):  # warm-up, both
        for function in implementations.values():
            residual_variants.sinkhorn_knopp = function
            step_seconds(model, ids, optimizer)
    for _ in range(args.rounds):
        for name, function in implementations.items():
            residual_variants.sinkhorn_knopp = function
            times[name].append(step_seconds(model, ids, optimizer))
    residual_variants.sinkhorn_knopp = implementations["log-domain first iteration (model)"]

    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = [log / lin for log, lin in zip(times["log-domain first iteration (model)"], times["linear domain"])]
    quartiles = statistics.quantiles(ratios, n=4)
    print(
        f"mHC training step, {args.layers} layers, width {args.hidden_size}, {args.batch_size}x{args.seq_len} tokens,"
        f" {args.rounds} interleaved rounds, {torch.get_num_threads()} threads"
    )
    print("| Sinkhorn | median step (ms) |\n|---|---|")
    for name, median in medians.items():
        print(f"| {name} | {1e3 * median:.1f} |")
    low, high = quartiles[0], quartiles[2]
    print(f"model / linear per round: median {statistics.median(ratios):.3f} (quartiles {low:.3f}-{high:.3f})")
    report = {
        "settings": vars(args)
        | {"threads": torch.get_num_threads(), "sinkhorn_iterations": config.sinkhorn_iterations},
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "python": platform.python_version(),
        },
        "median_seconds": medians,
        "ratio_median": statistics.median(ratios),
        "ratio_quartiles": [quartiles[0], quartiles[2]],
        "rounds": times,
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
