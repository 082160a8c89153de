"""Runs checkpoints in vLLM's offline `LLM` with its Transformers backend, inside the vLLM environment
(`.engines/vllm`, scripts/setup_engines.sh), for tests/test_vllm.py.

    .engines/vllm/bin/python tests/vllm_runner.py JOBS.json RESULTS.json

JOBS.json is a list of jobs, `{"model": DIR, "enforce_eager": bool, "skip_tokenizer_init": bool, "prompts": [[token
ids], ...], "max_tokens": n}`; RESULTS.json gets, per job, the greedy token ids of each prompt (all prompts in one
`generate` call, so vLLM schedules them into shared flattened batches over its paged KV cache), the most sequences
one forward pass computed, the classes of a decoder layer's modules as the backend left them, and what the process
had imported: whether `attnres` (the installed package) was, and the checkpoint's own modeling module. The engine
runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor) so that this is the process that ran
the model.
"""

import gc
import json
import os
import sys


def count_sequences(module, args, kwargs) -> None:
    """A flattened batch holds several sequences one after the other: each but the first starts where the
    positions do not continue the previous token's. The largest count is kept on the module."""
    positions = kwargs["position_ids"].reshape(-1)
    sequences = 1 + int((positions[1:] != positions[:-1] + 1).sum())
    module.max_sequences_per_forward = max(getattr(module, "max_sequences_per_forward", 0), sequences)


def watch_batches(model) -> tuple[str, dict[str, str]]:
    """Run in the worker: vLLM's backend holds the checkpoint's base model as `model.model`, whose first decoder
    layer gets the positions of every forward pass (the base model's own call goes through vLLM's compile wrapper,
    which skips hooks). Returns the base model's class and the classes of the last decoder layer's modules by name,
    after the backend swapped in its own (fused projections, norms)."""
    model.model.layers[0].register_forward_pre_hook(count_sequences, with_kwargs=True)
    layer_modules = {name: type(module).__name__ for name, module in model.model.layers[-1].named_modules()}
    return type(model.model).__name__, layer_modules


def sequences_seen(model) -> int:
    return getattr(model.model.layers[0], "max_sequences_per_forward", 0)


def run_job(job: dict) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=job["model"],
        trust_remote_code=True,
        model_impl="transformers",
        enforce_eager=job["enforce_eager"],
        dtype="float32",
        max_model_len=512,
        max_num_seqs=len(job["prompts"]),
        distributed_executor_backend="uni",
        skip_tokenizer_init=job["skip_tokenizer_init"],
        seed=0,
    )
    ((model_class, layer_modules),) = llm.apply_model(watch_batches)
    sampling = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": prompt} for prompt in job["prompts"]], sampling, use_tqdm=False)
    (max_sequences_per_forward,) = llm.apply_model(sequences_seen)
    del llm
    gc.collect()
    return {
        "token_ids": [list(output.outputs[0].token_ids) for output in outputs],
        "model_class": model_class,
        "layer_modules": layer_modules,
        "max_sequences_per_forward": max_sequences_per_forward,
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
    main()
