"""Speed of Block AttnRes aggregation: the Triton kernels against the PyTorch reference, eager and compiled.

What is timed is one block's depth mixing (docs/design.md §6) as the model runs it, up to the pre-norms that read it:
phase 1 for the block's S pseudo-queries over N completed blocks, the first sublayer's input taken from it and
normalised, and phase 2 merging a partial sum for each of the other S - 1 sublayers, fused with their pre-norms. Forward
(under
`no_grad`) and forward + backward (gradients for the blocks, their inverse RMS, the queries, the partial sums and
the norms' gains) are timed for:

- `triton`: `attnres.kernels`;
- `pytorch`: `attnres.two_phase_torch`, what the model runs without Triton (hand-written backward passes);
- `eager`: `attnres.two_phase`, the reference (the baseline every ratio is taken against);
- `compiled`: the reference block step under `torch.compile`;
- `flash-attn-res`: the PyPI package's Triton ops, when it is installed (it computes the blocks' RMS itself and
  keeps phase 1's output in the blocks' dtype; its outputs are checked against the reference like the others', its
  gradients are not, since it differentiates through the RMS it computes while the reference takes it as an input).

Repetitions are interleaved across implementations, and the median is reported. Bandwidth is the block step's
minimum memory traffic divided by the median time: every block and partial sum read once, every normalised sublayer
input written once (and, backward, every output gradient read once and every input gradient written once). Intermediates
such as phase 1's output are not counted, so the figure is comparable across implementations and its ratio to the
GPU's peak bandwidth bounds what any implementation could still gain.

    python -m benchmarks.kernels                     # GPU: paper-like shapes, about 4 minutes, JSON in results/
    python -m benchmarks.kernels --interpret --tiny  # CPU, Triton's interpreter: checks the script end to end
"""

import os
import sys


# Triton chooses its interpreter when it is first imported, and importing torch's compiler imports it.
if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402

from attnres import kernels  # noqa: E402
from attnres import two_phase as reference  # noqa: E402
from attnres import two_phase_torch  # noqa: E402


EPS = 1e-6
RESULTS_DIR = Path(__file__).resolve().parent / "results"

# Peak DRAM bandwidth in GB/s by device-name fragment, most specific first (vendor data sheets).
PEAK_BANDWIDTH_GBPS = [
    ("GH200", 4000.0),
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),
    ("H800", 3350.0),
    ("B200", 8000.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100-SXM4-80GB", 2039.0),
    ("A100", 1555.0),
    ("L40S", 864.0),
    ("A10G", 600.0),
    ("L4", 300.0),
    ("RTX 4090", 1008.0),
    ("RTX 3090", 936.0),
    ("V100", 900.0),
]


@dataclass(frozen=True)
class Shape:
    """One block step: `tokens` = batch x sequence, `hidden` = D, `blocks` = N completed blocks, `block_size` = S."""

    tokens: int
    hidden: int
    blocks: int
    block_size: int


# Paper-like: 8k-32k tokens, hidden 1024-7168, 8 blocks (the paper's N), S from 4 to 16.
GPU_SHAPES = [Shape(8192, 1024, 8, 4), Shape(32768, 2048, 8, 6), Shape(16384, 4096, 8, 8), Shape(8192, 7168, 8, 16)]
TINY_SHAPES = [Shape(8, 48, 3, 2), Shape(4, 100, 2, 3)]

Ops = tuple[Callable, Callable]


def block_step(ops: Ops, blocks, inv_rms, queries, partials, norm_weights) -> list[torch.Tensor]:
    """The normalised sublayer inputs of one block, computed with `ops` = (phase1, phase2_rms_norm) as the model does:
    the block's first sublayer reads phase 1's output through its pre-norm, every other one phase 2 fused with it."""
    phase1, phase2_rms_norm = ops
    obar, lse = phase1(blocks, inv_rms, queries)
    inputs = [reference.rms_norm(obar[0].to(blocks.dtype), norm_weights[0], EPS)]
    for i in range(1, queries.shape[0]):
        inputs.append(phase2_rms_norm(obar[i], lse[i], partials[i - 1], queries[i], EPS, norm_weights[i], EPS))
    return inputs


def unstacked_phase1(blocks: torch.Tensor, inv_rms: torch.Tensor, queries: torch.Tensor):
    """`two_phase_torch.phase1`, which takes the blocks as separate tensors, as the model holds them."""
    return two_phase_torch.phase1(blocks.unbind(0), inv_rms, queries)


def flash_attn_res_ops() -> Ops | None:
    """`flash-attn-res`'s two ops behind the reference signatures (its phase 2 followed by the reference RMSNorm: it
    has no fused norm), or None when it is not installed."""
    try:
        import flash_attn_res
    except ImportError:
        return None

    def phase1(blocks, inv_rms, queries):
        return flash_attn_res.phase_1_batched_attention_triton_op(blocks, queries, EPS)

    def phase2_rms_norm(obar, lse, partial, query, eps, norm_weight, norm_eps):
        merged = flash_attn_res.phase_2_online_softmax_merge_triton_op(partial, query, obar, lse, eps)
        return reference.rms_norm(merged, norm_weight, norm_eps)

    return phase1, phase2_rms_norm


def peak_bandwidth(device: torch.device) -> tuple[str, float | None]:
    if device.type != "cuda":
        return "cpu (Triton interpreter)", None
    name = torch.cuda.get_device_name(device)
    return name, next((peak for fragment, peak in PEAK_BANDWIDTH_GBPS if fragment in name), None)


def minimum_bytes(shape: Shape, element_size: int, backward: bool) -> int:
    """The block step's compulsory traffic (module docstring), in bytes."""
    rows = shape.tokens * shape.hidden
    forward = (shape.blocks + (shape.block_size - 1) + shape.block_size) * rows * element_size
    forward += shape.blocks * shape.tokens * 4  # the blocks' inverse RMS
    if not backward:
        return forward
    # Read: blocks, partials, output gradients. Written: block and partial gradients (+ inverse-RMS gradients).
    grads = (2 * shape.blocks + 2 * (shape.block_size - 1) + shape.block_size) * rows * element_size
    return forward + grads + 2 * shape.blocks * shape.tokens * 4


def make_inputs(shape: Shape, dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    # Tokens as [1, T]: a batch axis, which flash-attn-res requires.
    tokens = (1, shape.tokens)
    blocks = torch.randn(shape.blocks, *tokens, shape.hidden, device=device, dtype=dtype)
    return {
        "blocks": blocks,
        "inv_rms": reference.inverse_rms(blocks, EPS),
        "queries": torch.randn(shape.block_size, shape.hidden, device=device) / shape.hidden**0.5,
        "partials": torch.randn(max(shape.block_size - 1, 1), *tokens, shape.hidden, device=device, dtype=dtype),
        "norm_weights": 1 + torch.randn(shape.block_size, shape.hidden, device=device, dtype=dtype) / 4,
    }


class Case:
    """One implementation's forward or forward + backward call on one shape's inputs."""

    def __init__(self, ops_fn: Callable, inputs: dict[str, torch.Tensor], backward: bool):
        self.fn, self.backward = ops_fn, backward
        self.leaves = [x.detach().requires_grad_(backward) for x in inputs.values()]
        self.out_grads = None

    def __call__(self) -> list[torch.Tensor]:
        if not self.backward:
            with torch.no_grad():
                return self.fn(*self.leaves)
        outputs = self.fn(*self.leaves)
        if self.out_grads is None:
            generator = torch.Generator(outputs[0].device).manual_seed(0)
            self.out_grads = [
                torch.randn(o.shape, generator=generator, device=o.device, dtype=o.dtype) for o in outputs
            ]
        return list(
            torch.autograd.grad(outputs, self.leaves, self.out_grads, allow_unused=True, materialize_grads=True)
        )


def time_once(case: Case, device: torch.device) -> float:
    """Milliseconds for one call: CUDA events on a GPU, the wall clock in the interpreter."""
    if device.type != "cuda":
        start = time.perf_counter()
        case()
        return 1e3 * (time.perf_counter() - start)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    case()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def max_error(results: list[torch.Tensor], expected: list[torch.Tensor]) -> float:
    """Largest difference relative to the largest expected magnitude, over every output (or gradient)."""
    return max(
        ((r.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-30)).item()
        for r, e in zip(results, expected, strict=True)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--interpret", action="store_true", help="run on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (for the interpreter)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per implementation and shape")
    parser.add_argument("--budget-s", type=float, default=270.0, help="stop starting new shapes after this long")
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend for the reference (default: inductor; aot_eager under --interpret, where "
        "inductor's C++ builds would dominate a run that only checks the script)",
    )
    parser.add_argument("--output", type=Path, default=None, help="JSON path (GPU default: results/kernels_<gpu>.json)")
    args = parser.parse_args()

    device = torch.device("cpu" if args.interpret else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: run on a GPU, or pass --interpret --tiny")
    dtype = getattr(torch, args.dtype)
    shapes = TINY_SHAPES if args.tiny else GPU_SHAPES
    reps = args.reps or (2 if args.interpret else 20)
    compile_backend = args.compile_backend or ("aot_eager" if args.interpret else "inductor")
    device_name, peak = peak_bandwidth(device)
    started = time.perf_counter()

    rows = []
    for shape in shapes:
        if time.perf_counter() - started > args.budget_s:
            print(f"time budget spent: skipping {shape}")
            continue
        torch.manual_seed(0)
        torch._dynamo.reset()
        inputs = make_inputs(shape, dtype, device)
        implementations = {
            "eager": lambda *xs: block_step((reference.phase1, reference.phase2_rms_norm), *xs),
            "triton": lambda *xs: block_step((kernels.phase1, kernels.phase2_rms_norm), *xs),
            "pytorch": lambda *xs: block_step((unstacked_phase1, two_phase_torch.phase2_rms_norm), *xs),
            "compiled": torch.compile(
                lambda *xs: block_step((reference.phase1, reference.phase2_rms_norm), *xs), backend=compile_backend
            ),
        }
        if (far_ops := flash_attn_res_ops()) is not None:
            implementations["flash-attn-res"] = lambda *xs, ops=far_ops: block_step(ops, *xs)
        for backward in (False, True):
            mode = "fwd+bwd" if backward else "fwd"
            cases, errors, failures = {}, {}, {}
            for name, fn in implementations.items():
                try:
                    case = Case(fn, inputs, backward)
                    result = case()  # warm-up: compiles, autotunes, allocates
                    if name == "eager":
                        expected = result
                    elif not (backward and name == "flash-attn-res"):
                        errors[name] = max_error(result, expected)
                    case()
                    cases[name] = case
                except Exception as error:  # an implementation that fails (OOM, unsupported shape) is reported
                    failures[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
            times = {name: [] for name in cases}
            for _ in range(reps):
                for name, case in cases.items():
                    times[name].append(time_once(case, device))
            traffic = minimum_bytes(shape, inputs["blocks"].element_size(), backward)
            baseline = statistics.median(times["eager"]) if "eager" in times else None
            for name in implementations:
                row = {**asdict(shape), "mode": mode, "implementation": name}
                if name in failures:
                    row["error"] = failures[name]
                else:
                    median = statistics.median(times[name])
                    gbps = traffic / median / 1e6
                    row.update(
                        median_ms=median,
                        times_ms=times[name],
                        gbps=gbps,
                        peak_fraction=gbps / peak if peak else None,
                        speedup_vs_eager=baseline / median if baseline else None,
                        max_rel_error_vs_eager=0.0 if name == "eager" else errors.get(name),
                    )
                rows.append(row)
            cases.clear()
        del inputs, implementations
        if device.type == "cuda":
            torch.cuda.empty_cache()

    print(
        f"\nBlock AttnRes aggregation, {args.dtype}, {device_name}, peak {peak or 'unknown'} GB/s, {reps} reps, "
        f"compiled = torch.compile(backend={compile_backend!r})\n"
    )
    print("| tokens | hidden | N | S | mode | implementation | median ms | GB/s | % peak | vs eager | max rel err |")
    print("|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|")
    for row in rows:
        head = f"| {row['tokens']} | {row['hidden']} | {row['blocks']} | {row['block_size']} | {row['mode']} | "
        if "error" in row:
            print(head + f"{row['implementation']} | failed: {row['error']} | | | | |")
            continue
        percent = f"{100 * row['peak_fraction']:.1f}" if row["peak_fraction"] else "n/a"
        error = row["max_rel_error_vs_eager"]
        print(
            head + f"{row['implementation']} | {row['median_ms']:.3f} | {row['gbps']:.1f} | {percent} | "
            f"{row['speedup_vs_eager']:.2f}x | {'n/a' if error is None else f'{error:.1e}'} |"
        )

    output = args.output
    if output is None and device.type == "cuda":
        output = RESULTS_DIR / f"kernels_{device_name.replace(' ', '_').replace('/', '_')}.json"
    if output is not None:
        output.parent.mkdir(parents=True, exist_ok=True)
        metadata = {
            "device": device_name,
            "peak_gbps": peak,
            "dtype": args.dtype,
            "reps": reps,
            "compile_backend": compile_backend,
            "interpreted": args.interpret,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        }
        output.write_text(json.dumps({"metadata": metadata, "results": rows}, indent=1))
        print(f"\nwrote {output}")
    print(f"total {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
