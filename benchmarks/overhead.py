"""What AttnRes costs on top of the family's own Transformers model (Llama, Mixtral, Qwen3), on the CPU, each model in
a process of its own.

For each shape, every model gets the same weights as the baseline (the shape's family: `LlamaForCausalLM`,
`MixtralForCausalLM` for the MoE rows, `Qwen3ForCausalLM` for the Qwen3 rows) and runs in a process of its own,
which times the samples it is asked for (the messages between the processes are not timed). The workloads are timed
in interleaved rounds, one process computing at a time: the baseline runs right before each AttnRes model, whose
order rotates from round to round (baseline, standard, baseline, block, baseline, full; then baseline, block,
baseline, full, baseline, standard; ...). The table reports
each model's median time and its ratio to the baseline: the median over its samples of its time divided by the mean
of the baseline's samples right before and right after it. The machine's speed drifts by more than the overheads
measured (on the shared 2-core VM of the committed results, the baseline's training step ranged from 0.58 to 0.92 s
within a minute and a half, and the SmolLM2 shape's by 17% from one step to the next): flanked by the baseline on
both sides, a sample's ratio cancels a drift that is linear over the three samples; a ratio to one neighbour carries
the drift between the two samples, and a ratio of whole-run medians all of it. In eager mode there is no separate
warm-up: a slow first sample of every model is absorbed by the median. Under `--compile` every model is compiled
alike (`torch.compile(model)`) and compiled before timing.

Why instances: a model's process has a speed of its own, which holds for the whole run. At the small shape, standard
mode, which runs exactly Llama's aten ops, measured 1.002x, 1.047x and 1.017x for prefill in three runs, each within
±0.005 of its own median; two identical models in one process differed by 5% in the time their matrix products took.
Where the model's memory lands, which no two processes share, is the likely cause (the small shape's weights and KV
cache just exceed the 32 MiB L3 cache of the committed runs' machine). `--instances N` builds every model N times,
each time in new processes, and shares the seconds among them: the ratios pool the instances, and each instance's own
median ratio is recorded (`*_ratio_instances`), whose spread is the uncertainty that one run cannot show.

Why a process per model: a user's process runs one model, and models that share a process share glibc's heap. The
models' allocations interleave in it, and when a free leaves more than glibc's trim threshold at the top of the heap,
glibc hands those pages back to the system, so that the next model touches them afresh. At the SmolLM2 shape, Block
AttnRes timed in one process with Llama took a median of 11,000 minor page faults per prefill (Llama none) and
measured 1.035x; with glibc told to keep 64 MiB at the top (`MALLOC_TOP_PAD_=67108864`), the same rounds took 3 page
faults and measured 1.009x. Run alone, one prefill after another, Block takes no page faults after its second. Each
model's process is set up alike (`build_with_baseline_weights`), so that glibc's thresholds start out the same.

Workloads (fp32 weights; in fp32, or under `--autocast bf16` / `fp16` in `torch.autocast`, as `Trainer(bf16=True)` trains):
- prefill: one forward of a 512-token prompt, batch 1, logits of the last position only (what `generate` does);
- decode: per-token time of 64 greedy steps with the KV cache after a 512-token prompt, interleaved token by token
  across the models in the same order (the baseline decodes one stream of its own before each AttnRes model's; eager:
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
    python -m benchmarks.overhead --shapes small small-qwen3 --workloads prefill decode --no-memory --seconds 240 \
        --instances 6 --output benchmarks/results/overhead_families_instances.json   # 6 sets of processes (20 min)
    python -m benchmarks.overhead --shapes small small-moe --no-memory --seconds 120 --train-seconds 900 \
        --output benchmarks/results/overhead_long.json     # the small shapes to a few tenths of a percent (40 min)
    python -m benchmarks.overhead --shapes smollm2-135m --workloads prefill --no-memory --seconds 600 \
        --output benchmarks/results/overhead_smollm2_prefill.json  # SmolLM2's prefill to about a percent (11 min)
    python -m benchmarks.overhead --shapes smollm2-135m --workloads train --no-memory --train-seconds 1200 \
        --output benchmarks/results/overhead_smollm2_train.json    # SmolLM2's training step to a few percent (21 min)
    python -m benchmarks.overhead --shapes small small-qwen3 --workloads train --autocast bf16 --train-seconds 240 \
        --output benchmarks/results/overhead_autocast.json   # the training step under bf16 autocast

Run from the repository root as a module (`python -m benchmarks.overhead`): run as a script, this folder would be
first on `sys.path` and `benchmarks/kernels.py` would shadow the `kernels` package that Transformers probes for.
Prints a markdown table and writes JSON to benchmarks/results/overhead.json.
"""

import argparse
import contextlib
import json
import multiprocessing
import platform
import re
import statistics
import sys
import time
import traceback
import weakref
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, StaticCache

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.families import FAMILIES
from attnres.kernel_dispatch import depth_kernels


# Each shape names its family (`attnres/families.py`): the baseline is that family's model.
SHAPES = {
    # SmolLM2-135M: 30 decoder layers (60 sublayers), default Block AttnRes S = 8 -> 8 blocks
    "smollm2-135m": dict(
        family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    "small": dict(
        family="llama", vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    "small-moe": dict(
        family="mixtral", vocab_size=8192, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rms_norm_eps=1e-5,
        num_local_experts=4, num_experts_per_tok=2,
    ),
    # SmolLM2-135M's shape as Qwen3 (q/k RMSNorms in every attention, head_dim 64 as SmolLM2's).
    "smollm2-135m-qwen3": dict(
        family="qwen3", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    # The small shape as Qwen3: q/k RMSNorms in every attention.
    "small-qwen3": dict(
        family="qwen3", vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5,
    ),
    # The small shape as Qwen3-Next: three Gated DeltaNet layers to one attention layer, an MoE with a shared expert in
    # every layer.
    "small-qwen3-next": dict(
        family="qwen3_next", vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True, rms_norm_eps=1e-5,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256,
    ),
    # The small shape as DeepSeek-V3: latent attention, a dense first layer, then MoE with a shared expert, the top-k
    # chosen within the best of 2 groups.
    "small-deepseek-v3": dict(
        family="deepseek_v3", vocab_size=8192, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=1e-5,
        q_lora_rank=128, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64, head_dim=32,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=256,
        first_k_dense_replace=1, n_group=2, topk_group=1,
    ),
}
MODES = ("standard", "block", "full")
WORKLOADS = ("prefill", "decode", "train")
PREFILL_TOKENS, DECODE_PROMPT, DECODE_STEPS, TRAIN_BATCH, TRAIN_TOKENS = 512, 512, 64, 4, 256


def build_model(shape_name: str, name: str) -> torch.nn.Module:
    """One freshly initialised model of the shape: the baseline (named by its family, "llama", "qwen3", ...) or an
    AttnRes mode of the same family."""
    shape = dict(SHAPES[shape_name], max_position_embeddings=1024)
    family = FAMILIES[shape.pop("family")]
    torch.manual_seed(0)
    if name == family.model_type:
        return family.cls("ForCausalLM")(family.config_class(**shape))
    return AttnResForCausalLM(AttnResConfig(**shape, family=family.model_type, residual_mode=name))


def model_names(shape_name: str) -> list[str]:
    """The baseline first, then the AttnRes modes."""
    return [SHAPES[shape_name]["family"], *MODES]


def build_with_baseline_weights(shape_name: str, name: str) -> torch.nn.Module:
    """The model `name` of the shape holding the baseline's weights; an AttnRes model's own parameters (pseudo-queries,
    key norms) keep their initial values. Every model, the baseline too, is built the same way, loading the weights
    of a baseline built for the purpose, which is then freed, as a user's process loads a checkpoint. glibc sets its
    thresholds for mapping fresh pages and for returning the heap's top (dynamically, up to 32 MiB) from the blocks
    it has freed: a SmolLM2 baseline built alone in its process took 70,000 minor page faults per prefill (the models
    built this way, 2) and ran 1.09x to 1.15x as long as the standard AttnRes model, which is Llama's computation."""
    baseline = build_model(shape_name, model_names(shape_name)[0])
    model = build_model(shape_name, name)
    missing, unexpected = model.load_state_dict(baseline.state_dict(), strict=False)
    assert not unexpected and all(k.endswith(("pseudo_query", "key_norm_weight")) for k in missing)
    return model


# `--autocast`: the workloads run under `torch.autocast` in this dtype, every model alike.
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def precision(autocast: str | None) -> contextlib.AbstractContextManager:
    """`torch.autocast` on the CPU in the `--autocast` dtype, or nothing (fp32)."""
    if autocast is None:
        return contextlib.nullcontext()
    return torch.autocast("cpu", dtype=AUTOCAST_DTYPES[autocast])


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


class ModelWorker:
    """One model inside the process that runs it: it times the samples it is asked for and holds its decode streams'
    KV caches. Compiled models decode with a `StaticCache` (fixed shapes: Transformers' way to compile generation; a
    growing `DynamicCache` recompiles at every length), eager ones with the `DynamicCache` that `generate` uses by
    default."""

    functions = {"prefill": prefill, "train": train_step}

    def __init__(self, shape: str, name: str, threads: int, compile_model: bool, autocast: str | None):
        torch.set_num_threads(threads)
        depth_kernels(torch.device("cpu"))  # loads the fused CPU kernels now, not inside the first timed sample
        self.model = build_with_baseline_weights(shape, name)
        self.compile_model = compile_model
        self.autocast = autocast
        self.runner = self.model
        self.streams: dict[str, tuple[DynamicCache | StaticCache, torch.Tensor]] = {}

    def start(self, workload: str, ids: torch.Tensor) -> None:
        """Sets the model up for `workload`, dropping the decode streams. Compiled, the model is compiled afresh and,
        for prefill and training, run once on `ids` outside the timed samples (decode compiles in a first,
        untimed `decode_sequence`)."""
        self.streams.clear()
        self.model.train(workload == "train")
        if self.compile_model:
            torch._dynamo.reset()
            self.runner = torch.compile(self.model)
            if workload in self.functions:
                with precision(self.autocast):
                    self.functions[workload](self.runner, ids)

    def time(self, workload: str, ids: torch.Tensor) -> float:
        """Seconds one prefill or training step on `ids` takes."""
        with precision(self.autocast):
            return timed(self.functions[workload], self.runner, ids)

    def start_stream(self, stream: str, prompt: torch.Tensor) -> None:
        """Runs `prompt` into a new KV cache (not timed), the start of the decode stream `stream`."""
        config = self.model.config
        max_length = prompt.shape[1] + DECODE_STEPS
        cache = StaticCache(config, max_cache_len=max_length) if self.compile_model else DynamicCache(config=config)
        positions = torch.arange(prompt.shape[1]).unsqueeze(0)
        with torch.inference_mode(), precision(self.autocast):
            logits = self.runner(prompt, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1).logits
        self.streams[stream] = (cache, logits[:, -1:].argmax(-1))

    def decode_step(self, stream: str, position: int) -> float:
        """Seconds one greedy step of the decode stream `stream` takes, the token at `position`."""
        cache, token = self.streams[stream]
        positions = torch.tensor([[position]])
        with torch.inference_mode(), precision(self.autocast):
            start = time.perf_counter()
            logits = self.runner(token, cache=cache, position_ids=positions, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            seconds = time.perf_counter() - start
        self.streams[stream] = (cache, token)
        return seconds


def serve(connection, *worker_arguments) -> None:
    """A model process's loop: builds its `ModelWorker`, then runs each `(method, arguments)` it receives and sends
    back `(True, result)`, or `(False, traceback)` where it raised, until it receives None."""
    try:
        worker = ModelWorker(*worker_arguments)
    except Exception:
        worker = None
        connection.send((False, traceback.format_exc()))
    while worker is not None and (call := connection.recv()) is not None:
        method, arguments = call
        try:
            connection.send((True, getattr(worker, method)(*arguments)))
        except Exception:
            connection.send((False, traceback.format_exc()))


class ModelProcess:
    """A `ModelWorker` in a process of its own: `call("time", "prefill", ids)` runs the worker's method there and
    returns its result. The process is forked from a server that has imported torch, Transformers and attnres
    (`fresh_context`), and builds its model as it starts: the first call waits for that."""

    def __init__(self, shape: str, name: str, threads: int, compile_model: bool, autocast: str | None):
        self.name = name
        context = fresh_context()
        self.connection, child = context.Pipe()
        arguments = (child, shape, name, threads, compile_model, autocast)
        self.process = context.Process(target=serve, args=arguments, daemon=True)
        self.process.start()
        child.close()

    def call(self, method: str, *arguments):
        self.connection.send((method, arguments))
        succeeded, result = self.connection.recv()
        if not succeeded:
            raise RuntimeError(f"in the process of the model {self.name!r}:\n{result}")
        return result

    def close(self) -> None:
        try:
            self.connection.send(None)
        except (BrokenPipeError, OSError):
            pass  # it has already ended (its model failed to build)
        self.process.join()


@contextlib.contextmanager
def model_processes(
    shape: str, threads: int, compile_models: bool, autocast: str | None
) -> Iterator[dict[str, ModelProcess]]:
    """A `ModelProcess` for every model of the shape (`model_names`: the baseline first), ended on exit."""
    processes = {}
    try:
        for name in model_names(shape):
            processes[name] = ModelProcess(shape, name, threads, compile_models, autocast)
        yield processes
    finally:
        for process in processes.values():
            process.close()


def rotated(items: list, shift: int) -> list:
    """`items` starting at position `shift` (modulo their number): the order of the AttnRes models in round `shift`.
    Each model takes every position in turn, so an effect of the position within a round (a drift within the round,
    what the model before the baseline left in the CPU's caches) falls on all models alike."""
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


def decode_sequence(processes: dict[str, ModelProcess], baseline: str, prompt: torch.Tensor) -> list[tuple[str, float]]:
    """Per-token times of `DECODE_STEPS` greedy steps after `prompt` (not timed), token by token in `round_order`
    (one round per step): the baseline decodes one stream of its own before each other model's, so that every other
    model's step sits between two baseline steps at the same length, and machine noise hits all models alike."""
    others = [name for name in processes if name != baseline]
    for other in others:
        for name in (baseline, other):  # each of the baseline's streams is named for the model it runs beside
            processes[name].call("start_stream", other, prompt)
    sequence = []
    for step in range(DECODE_STEPS):
        for other in rotated(others, step):
            for name in (baseline, other):
                sequence.append((name, processes[name].call("decode_step", other, prompt.shape[1] + step)))
    return sequence


def measure_times(
    shape: str, processes: dict[str, ModelProcess], repeats: int, seconds: dict[str, float], compile_models: bool,
    workloads: Sequence[str] = WORKLOADS,
) -> dict[str, list[list[tuple[str, float]]]]:
    """Samples per workload: sequences of `(model, seconds)` in the order they ran. Prefill and the training step
    run in rounds (`round_order`; at least `repeats`, more until `seconds[workload]` have passed: small shapes get
    many), one sequence each; decode gives one sequence per repetition of `decode_sequence` from the prompt, repeated
    until `seconds["decode"]` have passed. Progress goes to stderr."""
    baseline, *others = processes
    vocab = SHAPES[shape]["vocab_size"]
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "prefill": torch.randint(0, vocab, (1, PREFILL_TOKENS), generator=generator),
        "decode": torch.randint(0, vocab, (1, DECODE_PROMPT), generator=generator),
        "train": torch.randint(0, vocab, (TRAIN_BATCH, TRAIN_TOKENS), generator=generator),
    }
    results = {}
    for workload in workloads:
        ids = inputs[workload]
        for process in processes.values():
            process.call("start", workload, ids)
        start = time.perf_counter()
        if workload == "decode":
            if compile_models:  # compiles the prompt's and the one-token graphs, outside the timed samples
                decode_sequence(processes, baseline, ids)
            sequences = []
            start = time.perf_counter()
            while not sequences or time.perf_counter() - start < seconds[workload]:
                sequences.append(decode_sequence(processes, baseline, ids))
        else:
            sequence = []
            rounds = 0
            while rounds < repeats or time.perf_counter() - start < seconds[workload]:
                for name in round_order(baseline, others, rounds):
                    sequence.append((name, processes[name].call("time", workload, ids)))
                rounds += 1
            sequences = [sequence]
        samples = sum(len(sequence) for sequence in sequences)
        print(f"  {workload}: {samples} samples in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        results[workload] = sequences
    return results


def fresh_context() -> multiprocessing.context.ForkServerContext:
    """Processes forked from a server that has imported torch, Transformers and attnres (and run nothing), so each
    skips those imports; this module itself is not preloaded, as each child imports it afresh when run as
    `python -m benchmarks.overhead`."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "transformers", "attnres"])
    return context


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


def train_memory_in_this_process(shape: str, name: str, autocast: str | None = None) -> dict[str, float]:
    """MiB one training step adds on top of the built model at its peak: its tensors' (`TensorMemoryPeak`) and the
    resident memory's. Linux's high-water mark (VmHWM) is reset to the current RSS right before the step
    (`/proc/self/clear_refs`), so the transient peaks of building the model do not hide the step's own peak."""

    def status_kib(field: str) -> int:
        return int(re.search(field + r":\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1))

    model = build_model(shape, name).train()
    ids = torch.randint(0, model.config.vocab_size, (TRAIN_BATCH, TRAIN_TOKENS))
    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")
    with TensorMemoryPeak() as tensors, precision(autocast):
        train_step(model, ids)
    resident = (status_kib("VmHWM") - before) / 1024
    return {"train_peak_mib": resident, "train_tensor_peak_mib": tensors.peak / 2**20}


def train_memory_on_one_thread(shape: str, name: str, autocast: str | None) -> dict[str, float]:
    """`train_memory_in_this_process` on one thread: two of these run side by side."""
    torch.set_num_threads(1)
    return train_memory_in_this_process(shape, name, autocast)


def peak_train_memories(shape: str, autocast: str | None) -> dict[str, dict[str, float]]:
    """`train_memory_in_this_process` of every model of the shape, each in a fresh process, so that models measured
    earlier leave nothing behind. Two run at a time, one thread each: memory does not depend on timing, and this
    halves the part of the benchmark's run time that builds and steps each model once more."""
    names = model_names(shape)
    with ProcessPoolExecutor(max_workers=2, mp_context=fresh_context(), max_tasks_per_child=1) as pool:
        memories = pool.map(train_memory_on_one_thread, [shape] * len(names), names, [autocast] * len(names))
        return dict(zip(names, memories, strict=True))


def cpuinfo_field(name: str) -> str | None:
    """The first processor's `name` field in /proc/cpuinfo, `None` where there is none (not Linux)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    return None


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


# The CPU instructions that compute bf16 / fp16 matrix products natively (/proc/cpuinfo's flags).
LOW_PRECISION_INSTRUCTIONS = {"bf16": ("avx512_bf16", "amx_bf16"), "fp16": ("avx512_fp16", "amx_fp16")}


def cpu_instructions() -> dict:
    """What the machine's name does not say: the vector instructions torch's CPU kernels use (`AVX2`, `AVX512`) and
    which of bf16 / fp16 it computes natively. The same processor name ("AMD EPYC") has come with and without
    AVX-512, and without native bf16 a bf16 matrix product takes many times its fp32 time (benchmarks/README.md), which
    no ratio under autocast survives."""
    flags = set((cpuinfo_field("flags") or "").split())
    native = [dtype for dtype, names in LOW_PRECISION_INSTRUCTIONS.items() if flags & set(names)]
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "native_low_precision": native}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["smollm2-135m", "small", "small-moe"], choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=3, help="least runs per model of prefill and training step")
    parser.add_argument("--seconds", type=float, default=12, help="keep running prefills (and decodes) this long")
    # A training step takes about 6x a prefill: the time it gets buys a few more of its noisier samples.
    parser.add_argument("--train-seconds", type=float, default=50, help="keep running training steps this long")
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--compile", action="store_true", help="also measure with torch.compile")
    parser.add_argument(
        "--instances", type=int, default=1,
        help="build every model this many times, each time in new processes, sharing the seconds among them",
    )
    parser.add_argument(
        "--autocast", choices=list(AUTOCAST_DTYPES), default=None,
        help="run every workload under torch.autocast in this dtype (fp32 weights), every model alike",
    )
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--output", type=Path, default=Path(__file__).parent / "results" / "overhead.json")
    args = parser.parse_args()
    if args.instances < 1:
        parser.error(f"argument --instances: {args.instances} is not a positive number of instances")
    instructions = cpu_instructions()
    if args.autocast is not None and args.autocast not in instructions["native_low_precision"]:
        print(
            f"warning: this CPU ({instructions['cpu_capability']}) has no {args.autocast} matrix instructions: torch "
            f"may compute {args.autocast} matrix products on a slow path here, where the ratios say little "
            "(benchmarks/README.md, 'Under bf16 autocast')",
            file=sys.stderr,
        )
    torch.set_num_threads(torch.get_num_threads())
    # What the models' depth attention runs on here; the fused CPU kernels are built now (once per machine), before
    # the models' processes load them.
    kernels_module = depth_kernels(torch.device("cpu")).phase1.__module__

    seconds = {"prefill": args.seconds, "decode": args.seconds, "train": args.train_seconds}
    rows = []
    for shape in args.shapes:
        # Memory first, in fresh processes, then the times, in a process per model.
        memory = {} if args.no_memory else peak_train_memories(shape, args.autocast)
        baseline = model_names(shape)[0]
        for execution in ["eager"] + (["compile"] if args.compile else []):
            print(f"{shape}, {execution}:", file=sys.stderr)
            compile_models = execution == "compile"
            # Each instance builds every model afresh in new processes and gets an equal share of the time.
            instance_seconds = {workload: budget / args.instances for workload, budget in seconds.items()}
            instances = []
            for instance in range(args.instances):
                if args.instances > 1:
                    print(f" instance {instance + 1} of {args.instances}:", file=sys.stderr)
                with model_processes(shape, torch.get_num_threads(), compile_models, args.autocast) as processes:
                    instances.append(
                        measure_times(shape, processes, args.repeats, instance_seconds, compile_models, args.workloads)
                    )
            for name in model_names(shape):
                mode = execution if args.autocast is None else f"{execution}, {args.autocast} autocast"
                row = {"shape": shape, "mode": mode, "model": name}
                for workload in args.workloads:
                    sequences = [sequence for times in instances for sequence in times[workload]]
                    samples = [time_ for sequence in sequences for model, time_ in sequence if model == name]
                    instance_ratios = [
                        [ratio for sequence in times[workload] for ratio in flanked_ratios(sequence, name, baseline)]
                        for times in instances
                    ]
                    ratios = [ratio for ratios_of_instance in instance_ratios for ratio in ratios_of_instance]
                    row[f"{workload}_s"] = statistics.median(samples)
                    row[f"{workload}_ratio"] = statistics.median(ratios)
                    # The spread of the ratios (their quartiles): how far one sample's ratio can be from the median.
                    quartiles = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else ratios * 3
                    row[f"{workload}_ratio_quartiles"] = [quartiles[0], quartiles[2]]
                    row[f"{workload}_samples"] = len(samples)
                    # Each instance's own median ratio: how far one set of processes can be from another.
                    row[f"{workload}_ratio_instances"] = list(map(statistics.median, instance_ratios))
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
        **instructions,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "depth_kernels": kernels_module,
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    settings = {"repeats": args.repeats, "seconds": seconds, "instances": args.instances, "autocast": args.autocast}
    args.output.write_text(json.dumps({"machine": machine, **settings, "rows": rows}, indent=2))
    print(f"\nwrote {args.output}")


if __name__ == "__main__":
    main()
