"""One vLLM engine for benchmarks/vllm.py, run in the vLLM environment (`.engines/vllm`, scripts/setup_engines.sh):

    .engines/vllm/bin/python -m benchmarks.vllm_engine --model DIR --impl transformers --mode compiled

`--impl` is vLLM's `model_impl`: `vllm` (its native model of the architecture), `transformers` (its Transformers
backend) or `auto` (its default: for AttnRes with attnres installed, attnres's native model).

It builds the offline `LLM` (timing its start-up, which includes torch.compile in compiled mode), prints one result
line with the start-up time and dynamo's counters, then answers each JSON line on stdin, `{"batch": B,
"max_tokens": T}`, with one result line: the seconds one `generate` call over B prompts of T greedy tokens each took.
A result line is `RESULT_PREFIX` and JSON (vLLM logs to stdout too).
An empty line ends it. The engine runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, the `uni` executor), so
that dynamo's counters are this process's.
"""

import argparse
import json
import os
import sys
import time


PROMPT_LENGTH = 32
MAX_BATCH = 8
RESULT_PREFIX = "attnres-benchmark-result "


def prompts(batch: int, vocab_size: int) -> list[dict]:
    """`batch` different prompts of PROMPT_LENGTH token ids, the same in every engine."""
    return [
        {"prompt_token_ids": [(7919 * (i + 1) + 104729 * j) % (vocab_size - 3) + 3 for j in range(PROMPT_LENGTH)]}
        for i in range(batch)
    ]


def dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    return {group: dict(values) for group, values in counters.items() if group in ("stats", "frames", "recompiles")}


def report(result: dict) -> None:
    print(RESULT_PREFIX + json.dumps(result), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--impl", choices=("transformers", "vllm", "auto"), required=True)
    parser.add_argument("--mode", choices=("eager", "compiled"), required=True)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=args.model,
        trust_remote_code=True,
        model_impl=args.impl,
        enforce_eager=args.mode == "eager",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=MAX_BATCH,
        distributed_executor_backend="uni",
        seed=0,
    )
    startup = time.perf_counter() - start
    vocab_size = llm.llm_engine.model_config.get_vocab_size()
    from torch._dynamo.utils import compile_times

    # Seconds per compile phase (dynamo's tracing, AOT autograd, inductor's code generation, ...), summed.
    names, seconds = compile_times(repr="csv", aggregate=True)
    phases = dict(zip(names, map(float, seconds)))
    report({"startup_seconds": startup, "dynamo": dynamo_counters(), "compile_phase_seconds": phases})

    for line in sys.stdin:
        if not line.strip():
            break
        request = json.loads(line)
        sampling = SamplingParams(temperature=0.0, max_tokens=request["max_tokens"], ignore_eos=True)
        batch = prompts(request["batch"], vocab_size)
        start = time.perf_counter()
        outputs = llm.generate(batch, sampling, use_tqdm=False)
        seconds = time.perf_counter() - start
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        report({"seconds": seconds, "tokens": tokens, "dynamo": dynamo_counters()})


if __name__ == "__main__":
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    main()
