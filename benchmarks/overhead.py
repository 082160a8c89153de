"""What AttnRes costs on top of Transformers' own Llama / Mixtral, on the CPU, each AttnRes mode in its own process.

For each shape, every model gets the same weights as the baseline (`LlamaForCausalLM`, or `MixtralForCausalLM` for
the MoE rows). Each AttnRes mode (standard, Block, Full) is timed in a fresh process of its own, beside a baseline
built in that process, one process after the other. Within a process the workloads are timed in interleaved rounds,
the baseline right before the AttnRes model (baseline, block, baseline, block, ...). The table reports each model's
median time and its ratio to the baseline: the median over its samples of its time divided by the mean of the
baseline's samples right before and right after it. The machine's speed drifts by more than the overheads measured
(on the shared 2-core VM of the committed results, the baseline's training step ranged from 0.58 to 0.92 s within a
minute and a half, and the SmolLM2 shape's by 17% from one step to the next): flanked by the baseline on both sides,
a sample's ratio cancels a drift that is linear over the three samples; a ratio to one neighbour carries the drift
between the two samples, and a ratio of whole-run medians all of it. In eager mode there is no separate warm-up: a
slow first sample of every model is absorbed by the median. Under `--compile` every model is compiled alike
(`torch.compile(model)`) and compiled before timing.

Why a process per mode: a user's process runs one model, and models sharing a process share glibc's heap. Full
AttnRes keeps every sublayer's output alive (at the SmolLM2 shape its prefill takes some 100,000 minor page faults);
timed in the same process, Block's SmolLM2 prefill took a median of 20,000 page faults (the MLPs' intermediates land
at the top of the heap that Full grew, above Block's live blocks, and glibc hands that top back to the system when
they are freed) and measured 1.034x, against 4 page faults and 0.997x in the same rounds without Full. The baseline
and the AttnRes model still share their process, so that their samples interleave.

Workloads (fp32):
- prefill: one forward of a 512-token prompt, batch 1, logits of the last position only (what `generate` does);
- decode: per-token time of 64 greedy steps with the KV cache after a 512-token prompt, interleaved token by token
  with the baseline in the same order (the baseline decodes one stream of its own before the AttnRes model's; eager:
  a `DynamicCache`, as `generate` uses by default; compiled: a `StaticCache`), repeated from the prompt until as many
  seconds as prefill gets have passed;
- train: forward + backward of a batch of 4 x 256 tokens;
- memory: what one training step adds at its peak, in a fresh process per model (two at a time, one thread each):
  the bytes its tensors hold (the allocator-independent figure, as `torch.cuda.max_memory_allocated` on a GPU) and
  the resident memory (RSS), which also counts what glibc's allocator keeps in its heap: by default glibc serves
  freed sizes up to 32 MiB from the heap afterwards, so RSS depends on how the step's allocations interleave
  (`MALLOC_MMAP_THRESHOLD_=131072` turns that off: RSS then follows the tensors).

Usage:
    python -m benchmarks.overhead                  # eager, all shapes, ~10 minutes on 2 cores
    python -m benchmarks.overhead --compile --shapes small --no-memory \
        --output benchmarks/results/overhead_compile.json    # eager and torch.compile; compiling dominates
                                                   # (up to a few minutes per model and workload on 2 cores)
    python -m benchmarks.overhead --shapes small --repeats 3   # quick look
    python -m benchmarks.overhead --shapes small small-moe --no-memory --seconds 120 --train-seconds 900 \
        --output benchmarks/results/overhead_long.json     # the small shapes to a few tenths of a percent (40 min)
    python -m benchmarks.overhead --shapes smollm2-135m --workloads prefill --no-memory --seconds 600 \
        --output benchmarks/results/overhead_smollm2_prefill.json  # SmolLM2's prefill to about half a percent

Run from the repository root as a module (`python -m benchmarks.overhead`): run as a script, this folder would be
first on `sys.path` and `benchmarks/kernels.py` would shadow the `kernels` package that Transformers probes for.
Prints a markdown table and writes JSON to benchmarks/results/overhead.json.
"""

import argparse
import json
import multiprocessing
import platform
import re
import statistics
import sys
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, StaticCache

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.depth_mixing import two_phase_ops


SHAPES = {
    # SmolLM2-135M: 30 decoder layers (60 sublayers), default Block AttnRes S = 8 -> 8 blocks
    "smollm2-135m": dict(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    "small": dict(
        vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    "small-moe": dict(
        vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=2,
    ),
}
MODES = ("standard", "block", "full")
WORKLOADS = ("prefill", "decode", "train")
PREFILL_TOKENS, DECODE_PROMPT, DECODE_STEPS, TRAIN_BATCH, TRAIN_TOKENS = 512, 512, 64, 4, 256


def build_model(shape_name: str, name: str) -> torch.nn.Module:
    """One freshly initialised model of the shape: the baseline ("llama" / "mixtral") or an AttnRes mode."""
    shape = dict(SHAPES[shape_name], max_position_embeddings=1024)
    torch.manual_seed(0)
    if name == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**shape, rope_parameters={"rope_type": "default", "rope_theta": 1e4}))
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape))
    return AttnResForCausalLM(AttnResConfig(**shape, residual_mode=name))


def model_names(shape_name: str) -> list[str]:
    """The baseline first, then the AttnRes modes."""
    return ["mixtral" if SHAPES[shape_name].get("num_local_experts") else "llama", *MODES]


def build_models(shape_name: str, modes: Sequence[str] = MODES) -> dict[str, torch.nn.Module]:
    """The baseline and one AttnRes model per mode in `modes`, all holding the baseline's weights."""
    baseline_name = model_names(shape_name)[0]
    baseline = build_model(shape_name, baseline_name)
    models = {baseline_name: baseline}
    for mode in modes:
        model = build_model(shape_name, mode)
        missing, unexpected = model.load_state_dict(baseline.state_dict(), strict=False)
        assert not unexpected and all(k.endswith(("pseudo_query", "key_norm_weight")) for k in missing)
        models[mode] = model
    return models


def prefill(model, ids):
    with torch.inference_mode():
        model(ids, use_cache=False, logits_to_keep=1)


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    model(ids, labels=ids, use_cache=False).loss.backward()


def timed(function, model, ids) -> float:
    start = time.perf_counter()
    function(model, ids)
    return time.perf_counter() - start


def rotated(items: list, shift: int) -> list:
    """`items` starting at position `shift` (modulo their number): the order of the AttnRes models in round `shift`.
    Each model takes every position in turn, so an effect of the position within a round (a drift within the round,
    what the model before the baseline left in the caches and the allocator) falls on all models alike."""
    shift %= max(len(items), 1)
    return items[shift:] + items[:shift]


def round_order(baseline: str, others: list[str], index: int) -> list[str]:
    """The samples of round `index`: the baseline right before each of the `others`, which are `rotated`. Round after
    round, every other model's sample sits between two baseline samples (`flanked_ratios`)."""
    return [name for other in rotated(others, index) for name in (baseline, other)]


def flanked_ratios(sequence: list[tuple[str, float]], name: str, baseline: str) -> list[float]:
    """For each of `name`'s samples in `sequence` (`(model, seconds)` in the order they ran), its time divided by the
    mean of the baseline's samples right before and right after it (the one before, for the last sample). The
    baseline's own ratios are 1."""
    if name == baseline:
        return [1.0 for sample_name, _ in sequence if sample_name == baseline]
    ratios = []
    for i, (sample_name, seconds) in enumerate(sequence):
        if sample_name == name:
            neighbours = [sequence[j] for j in (i - 1, i + 1) if 0 <= j < len(sequence)]
            flanks = [flank_seconds for flank_name, flank_seconds in neighbours if flank_name == baseline]
            ratios.append(seconds / statistics.fmean(flanks))
    return ratios


def decode_sequence(
    runners: dict, models: dict, baseline: str, prompt: torch.Tensor, static_cache: bool
) -> list[tuple[str, float]]:
    """Per-token times of `DECODE_STEPS` greedy steps after `prompt` (not timed), token by token in `round_order`
    (one round per step): the baseline decodes one stream of its own before each other model's, so that every other
    model's step sits between two baseline steps at the same length, and machine noise hits all models alike.

    Compiled models decode with a `StaticCache` (fixed shapes: Transformers' way to compile generation; a growing
    `DynamicCache` recompiles at every length), eager ones with the `DynamicCache` that `generate` uses by default.
    """
    others = [name for name in runners if name != baseline]
    max_length = DECODE_PROMPT + DECODE_STEPS
    states = {}  # (model, the other model whose stream it is) -> (cache, next input token)
    with torch.inference_mode():
        for other in others:
            for name in (baseline, other):
                config = models[name].config
                cache = StaticCache(config, max_cache_len=max_length) if static_cache else DynamicCache(config=config)
                positions = torch.arange(DECODE_PROMPT).unsqueeze(0)
                logits = runners[name](prompt, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
                states[name, other] = (cache, logits.logits[:, -1:].argmax(-1))
        sequence = []
        for step in range(DECODE_STEPS):
            positions = torch.tensor([[DECODE_PROMPT + step]])
            for other in rotated(others, step):
                for name in (baseline, other):
                    cache, token = states[name, other]
                    start = time.perf_counter()
                    logits = runners[name](token, cache=cache, position_ids=positions, use_cache=True).logits
                    token = logits[:, -1:].argmax(-1)
                    sequence.append((name, time.perf_counter() - start))
                    states[name, other] = (cache, token)
    return sequence


def measure_times(
    models: dict, repeats: int, seconds: dict[str, float], compile_models: bool, workloads: Sequence[str] = WORKLOADS
) -> dict[str, list[list[tuple[str, float]]]]:
    """Samples per workload: sequences of `(model, seconds)` in the order they ran. Prefill and the training step
    run in rounds (`round_order`; at least `repeats`, more until `seconds[workload]` have passed: small shapes get
    many), one sequence each; decode gives one sequence per repetition of `decode_sequence` from the prompt, repeated
    until `seconds["decode"]` have passed. Progress goes to stderr."""
    baseline, *others = models
    vocab = models[baseline].config.vocab_size
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "prefill": torch.randint(0, vocab, (1, PREFILL_TOKENS), generator=generator),
        "decode": torch.randint(0, vocab, (1, DECODE_PROMPT), generator=generator),
        "train": torch.randint(0, vocab, (TRAIN_BATCH, TRAIN_TOKENS), generator=generator),
    }
    results = {}
    for workload in workloads:
        for model in models.values():
            model.train(workload == "train")
        if compile_models:
            # Every model's forward runs through the same Transformers decorators, whose compiled variants dynamo
            # counts together: start each workload afresh, and allow a variant per model and input shape.
            torch._dynamo.reset()
            torch._dynamo.config.recompile_limit = 8 * len(models)
        runners = {name: torch.compile(model) if compile_models else model for name, model in models.items()}
        if workload == "decode":
            if compile_models:  # compiles the prompt's and the one-token graphs, outside the timed samples
                decode_sequence(runners, models, baseline, inputs["decode"], static_cache=True)
            sequences = []
            start = time.perf_counter()
            while not sequences or time.perf_counter() - start < seconds[workload]:
                sequences.append(decode_sequence(runners, models, baseline, inputs["decode"], compile_models))
        else:
            function = prefill if workload == "prefill" else train_step
            if compile_models:  # compilation happens on the first call, outside the timed samples
                for runner in runners.values():
                    function(runner, inputs[workload])
            sequence = []
            start = time.perf_counter()
            rounds = 0
            while rounds < repeats or time.perf_counter() - start < seconds[workload]:
                for name in round_order(baseline, others, rounds):
                    sequence.append((name, timed(function, runners[name], inputs[workload])))
                rounds += 1
            sequences = [sequence]
        samples = sum(len(sequence) for sequence in sequences)
        print(f"  {workload}: {samples} samples in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        results[workload] = sequences
    return results


def times_beside_the_baseline(
    shape: str, mode: str, threads: int, repeats: int, seconds: dict[str, float], compile_models: bool,
    workloads: Sequence[str],
) -> dict[str, list[list[tuple[str, float]]]]:
    """`measure_times` of the shape's baseline and the AttnRes model of `mode`, built here: run in a fresh process
    (`fresh_processes`), so that no other AttnRes model has run in it before."""
    torch.set_num_threads(threads)
    two_phase_ops(torch.device("cpu"))  # loads the fused CPU kernels here, not inside the first timed sample
    print(f"{shape}, {'compiled' if compile_models else 'eager'}, {mode}:", file=sys.stderr)
    return measure_times(build_models(shape, [mode]), repeats, seconds, compile_models, workloads)


def fresh_processes(max_workers: int) -> ProcessPoolExecutor:
    """A pool that runs each task in a new process. The processes fork from a server that has imported torch,
    Transformers and attnres (and run nothing), so each skips those imports; this module itself is not preloaded, as
    each child imports it afresh when run as `python -m benchmarks.overhead`."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers", "attnres"])
    return ProcessPoolExecutor(max_workers=max_workers, mp_context=context, max_tasks_per_child=1)


class TensorMemoryPeak(TorchDispatchMode):
    """The peak of the bytes held by tensor storages allocated while active: what the step's tensors need, whatever
    the allocator (the CPU's counterpart of `torch.cuda.max_memory_allocated`). Each new storage is counted when an
    operation returns it and released when it is freed."""

    def __init__(self):
        super().__init__()
        self.held = self.peak = 0
        self.sizes: dict[int, int] = {}

    def _release(self, address: int) -> None:
        self.held -= self.sizes.pop(address)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                address = storage.data_ptr()
                if address and address not in self.sizes:
                    self.sizes[address] = storage.nbytes()
                    self.held += storage.nbytes()
                    self.peak = max(self.peak, self.held)
                    weakref.finalize(storage, self._release, address)
        return out


def train_memory_in_this_process(shape: str, name: str) -> dict[str, float]:
    """MiB one training step adds on top of the built model at its peak: its tensors' (`TensorMemoryPeak`) and the
    resident memory's. Linux's high-water mark (VmHWM) is reset to the current RSS right before the step
    (`/proc/self/clear_refs`), so the transient peaks of building the model do not hide the step's own peak."""

    def status_kib(field: str) -> int:
        return int(re.search(field + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))

    model = build_model(shape, name).train()
    ids = torch.randint(0, model.config.vocab_size, (TRAIN_BATCH, TRAIN_TOKENS))
    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    with TensorMemoryPeak() as tensors:
        train_step(model, ids)
    resident = (status_kib("VmHWM") - before) / 1024
    return {"train_peak_mib": resident, "train_tensor_peak_mib": tensors.peak / 2**20}


def train_memory_on_one_thread(shape: str, name: str) -> dict[str, float]:
    """`train_memory_in_this_process` on one thread: two of these run side by side."""
    torch.set_num_threads(1)
    return train_memory_in_this_process(shape, name)


def peak_train_memories(shape: str) -> dict[str, dict[str, float]]:
    """`train_memory_in_this_process` of every model of the shape, each in a fresh process, so that models measured
    earlier leave nothing behind. Two run at a time, one thread each: memory does not depend on timing, and this
    halves the part of the benchmark's run time that builds and steps each model once more."""
    names = model_names(shape)
    with fresh_processes(max_workers=2) as pool:
        memories = pool.map(train_memory_on_one_thread, [shape] * len(names), names)
        return dict(zip(names, memories, strict=True))


def cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "small", "small-moe"], choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3, help="least runs per model of prefill and training step")
    # The seconds are per shape, all AttnRes modes together: each mode's process gets its share.
    parser.add_argument("--seconds", type=float, default=12, help="keep running prefills (and decodes) this long")
    # A training step takes about 6x a prefill: the time it gets buys a few more of its noisier samples.
    parser.add_argument("--train-seconds", type=float, default=50, help="keep running training steps this long")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--compile", action="store_true", help="also measure with torch.compile")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "overhead.json")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    # What the models' depth attention runs on here; the fused CPU kernels are built now (once per machine), before
    # the processes that time the models load them.
    depth_kernels = two_phase_ops(torch.device("cpu")).phase1.__module__

    seconds = {"prefill": args.seconds, "decode": args.seconds, "train": args.train_seconds}
    per_mode_seconds = {workload: total / len(MODES) for workload, total in seconds.items()}
    rows = []
    for shape in args.shapes:
        # Memory first, in fresh processes, then the times, one fresh process per AttnRes mode.
        memory = {} if args.no_memory else peak_train_memories(shape)
        baseline = model_names(shape)[0]
        for execution in ["eager"] + (["compile"] if args.compile else []):
            settings = (torch.get_num_threads(), args.repeats, per_mode_seconds, execution == "compile", args.workloads)
            with fresh_processes(max_workers=1) as pool:  # one after the other
                futures = {mode: pool.submit(times_beside_the_baseline, shape, mode, *settings) for mode in MODES}
                times = {mode: future.result() for mode, future in futures.items()}
            for name in model_names(shape):
                # The baseline's samples come from every process, each AttnRes model's from its own.
                runs = list(times.values()) if name == baseline else [times[name]]
                row = {"shape": shape, "mode": execution, "model": name}
                for workload in args.workloads:
                    sequences = [sequence for run in runs for sequence in run[workload]]
                    samples = [time_ for sequence in sequences for model, time_ in sequence if model == name]
                    ratios = [ratio for sequence in sequences for ratio in flanked_ratios(sequence, name, baseline)]
                    row[f"{workload}_s"] = statistics.median(samples)
                    row[f"{workload}_ratio"] = statistics.median(ratios)
                    # The spread of the ratios (their quartiles): how far one sample's ratio can be from the median.
                    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
                    row[f"{workload}_ratio_quartiles"] = [quartiles[0], quartiles[2]]
                    row[f"{workload}_samples"] = len(samples)
                for key, mib in memory.get(name, {}).items():
                    row[key] = mib
                    row[key.replace("_mib", "_ratio")] = mib / memory[baseline][key]
                rows.append(row)

    print("| shape | mode | model | prefill | decode / token | train step | train peak: tensors | train peak: RSS |")
    print("|" + "---|" * 8)
    for row in rows:
        times = [
            f"{row[key + '_ratio']:.3f}x ({row[key + '_s'] * 1e3:.{digits}f} ms)" if key + "_s" in row else "-"
            for key, digits in zip(WORKLOADS, (0, 1, 0), strict=True)
        ]
        memory = [
            f"{row[key + '_ratio']:.3f}x ({row[key + '_mib']:.0f} MiB)" if key + "_mib" in row else "-"
            for key in ("train_tensor_peak", "train_peak")
        ]
        print(f"| {row['shape']} | {row['mode']} | {row['model']} | {' | '.join(times + memory)} |")
    machine = {
        "processor": cpu_model(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "depth_kernels": depth_kernels,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"machine": machine, "repeats": args.repeats, "seconds": seconds, "rows": rows}, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
