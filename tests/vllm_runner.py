"""Runs checkpoints in vLLM's offline `LLM` inside the vLLM environment (`.engines/vllm`, scripts/setup_engines.sh), for
tests/test_vllm.py: through vLLM's Transformers backend or, with attnres installed, its native model.

    .engines/vllm/bin/python tests/vllm_runner.py JOBS.json RESULTS.json

JOBS.json is a list of jobs, `{"model": DIR, "prompts": [[token ids], ...], "max_tokens": n, "engine": {keyword
arguments of LLM}, "env": {variables set while the job runs}, "warm_prompts": [[token ids], ...], "dummy_batch":
bool}` (`engine` and the rest optional). The engine's defaults here: fp32, `max_model_len=512`, as many sequences as
prompts, seed 0, the `uni` executor (the engine runs in this process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so this is
the process that ran the model) unless the job asks for pipeline or tensor parallelism. `warm_prompts` are generated
first, one at a time; `dummy_batch` runs vLLM's dummy batch on every worker first.

RESULTS.json gets, per job, the greedy token ids of each prompt (all prompts in one `generate` call, so vLLM
schedules them into shared flattened batches over its paged KV cache), per worker the model's class and its decoder
layers' range, the classes of the last decoder layer's modules, the batches one forward pass computed (as runs of
consecutive positions: a sequence's prefill chunk or decoded token) and the calls of its attention pre-norm module,
the prefix cache's hits, and what the process had imported: whether `attnres` (the installed package) was, and the
checkpoint's own modeling module.
"""

import gc
import json
import os
import sys


def position_runs(positions) -> list[list[int]]:
    """The flattened batch's sequences as `[first position, length]`: each but the first starts where the positions
    do not continue the previous token's."""
    positions = positions.reshape(-1).tolist()
    runs = []
    for index, position in enumerate(positions):
        if index and position == positions[index - 1] + 1:
            runs[-1][1] += 1
        else:
            runs.append([position, 1])
    return runs


def record_batch(module, args, kwargs) -> None:
    positions = kwargs["position_ids"] if "position_ids" in kwargs else args[0]
    module.batches = [*getattr(module, "batches", []), position_runs(positions)]


def count_call(module, args) -> None:
    module.calls = getattr(module, "calls", 0) + 1


def first_layer(model):
    """The first decoder layer this worker computes: the native model's stage starts at `start_layer`."""
    return model.model.layers[getattr(model.model, "start_layer", 0)]


def first_pre_norm(model):
    """The first layer's attention pre-norm module, or `None` (OLMo 2's layers have none)."""
    return getattr(first_layer(model), "input_layernorm", None)


def watch_batches(model) -> dict:
    """Run in each worker: records the positions of every forward pass at the first layer it computes (the base
    model's own call goes through vLLM's compile wrapper, which skips hooks; so does a compiled layer). Returns the
    model's class, its layers' range, and the classes of the last layer's modules by name, after the backend swapped
    in its own (fused projections, norms)."""
    first_layer(model).register_forward_pre_hook(record_batch, with_kwargs=True)
    pre_norm = first_pre_norm(model)
    if pre_norm is not None:
        pre_norm.register_forward_pre_hook(count_call)
    start, end = getattr(model.model, "start_layer", 0), getattr(model.model, "end_layer", len(model.model.layers))
    layer_modules = {name: type(module).__name__ for name, module in model.model.layers[end - 1].named_modules()}
    return {"model_class": type(model).__name__, "base_class": type(model.model).__name__, "layers": [start, end],
            "layer_modules": layer_modules}


def batches_seen(model) -> list:
    return getattr(first_layer(model), "batches", [])


def pre_norm_calls(model) -> int | None:
    """How many times the first layer's attention pre-norm module was called (eager only: hooks do not run in a
    compiled graph), `None` where the layer has none."""
    pre_norm = first_pre_norm(model)
    return None if pre_norm is None else getattr(pre_norm, "calls", 0)


def prefix_cache_hits(llm) -> int:
    return int(sum(metric.value for metric in llm.get_metrics() if metric.name == "vllm:prefix_cache_hits"))


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    saved = {name: os.environ.get(name) for name in job.get("env", {})}
    os.environ.update(job.get("env", {}))
    engine = dict(
        dtype="float32",
        max_model_len=512,
        max_num_seqs=len(job["prompts"]),
        distributed_executor_backend="uni",
        skip_tokenizer_init=job.get("skip_tokenizer_init", False),
        seed=0,
    )
    engine.update(job.get("engine", {}))
    llm = LLM(model=job["model"], **engine)
    if job.get("dummy_batch"):  # allocates a later pipeline stage's receive buffers (tests/test_vllm.py)
        llm.collective_rpc("execute_dummy_batch")
    workers = llm.apply_model(watch_batches)
    sampling = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    for prompt in job.get("warm_prompts", []):
        llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in job["prompts"]], sampling, use_tqdm=False)
    batches = llm.apply_model(batches_seen)
    norm_calls = llm.apply_model(pre_norm_calls)
    hits = prefix_cache_hits(llm) if engine.get("enable_prefix_caching") else None
    del llm
    gc.collect()
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name)
        else:
            os.environ[name] = value
    return {
        "token_ids": [list(output.outputs[0].token_ids) for output in outputs],
        "workers": workers,
        "batches": batches,
        "pre_norm_calls": norm_calls,
        "prefix_cache_hits": hits,
        "attnres_imported": "attnres" in sys.modules,
        "remote_modeling_imported": any(name.endswith(".modeling_attnres") for name in sys.modules),
    }


def main() -> None:
    jobs_path, results_path = sys.argv[1:3]
    with open(jobs_path) as jobs_file:
        jobs = json.load(jobs_file)
    results = [run_job(job) for job in jobs]
    with open(results_path, "w") as results_file:
        json.dump(results, results_file)


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # `apply_model` sends its function to the workers of a parallel engine, which pickles it.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    main()
