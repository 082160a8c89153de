"""Transformers' common model tests, run on AttnRes the way Transformers runs them on each decoder family.

`ModelTesterMixin` and `ConfigTester` come from the installed Transformers version's own test files
(`tests/transformers_common.py` says where and what stands in for the files its sdist lacks). Block AttnRes (two-phase
depth attention with blocks) runs on every row of the family table; Full AttnRes and the standard residual on Llama
and Qwen3, and Full AttnRes on Mixtral's MoE layers.
"""

import dataclasses
import unittest

import pytest
import torch
from transformers.models.auto import modeling_auto
from transformers.testing_utils import CaptureLogger
from transformers.utils import logging

from attnres import AttnResConfig, AttnResForCausalLM, AttnResForSequenceClassification, AttnResModel
from attnres.families import FAMILIES, Family

from transformers_common import GenerationTesterMixin, import_common_tests


test_modeling_common, test_configuration_common = import_common_tests()
ModelTesterMixin = test_modeling_common.ModelTesterMixin
ConfigTester = test_configuration_common.ConfigTester
ids_tensor = test_modeling_common.ids_tensor
random_attention_mask = test_modeling_common.random_attention_mask


@pytest.fixture(autouse=True)
def _attnres_in_auto_mapping_names(monkeypatch):
    """The common tests find each class's role (base model, causal LM, classifier) by its name in the Auto classes'
    name tables, which list only Transformers' own models; `AutoModel.register` does not add to them. Listed there
    for these tests only, AttnRes gets the checks Llama gets."""
    for table, class_name in (
        (modeling_auto.MODEL_MAPPING_NAMES, "AttnResModel"),
        (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, "AttnResForCausalLM"),
        (modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES, "AttnResForSequenceClassification"),
    ):
        monkeypatch.setitem(table, "attnres", class_name)


class AttnResModelTester:
    """Builds a tiny config and inputs, with the attribute names the common tests read."""

    def __init__(self, parent: unittest.TestCase, **config_overrides):
        self.parent = parent
        self.batch_size = 2
        self.seq_length = 7
        self.is_training = True
        self.vocab_size = 99
        self.hidden_size = 32
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.num_key_value_heads = 2
        # Mixtral's `grouped_mm` experts need 16-byte strides, which Llama's tester's 37 does not give.
        self.intermediate_size = 40
        self.max_position_embeddings = 512
        self.type_sequence_label_size = 2
        self.num_labels = 3
        self.pad_token_id = 0
        # A family's fields may replace the shape (StableLM's heads), which the tests then read from the tester too.
        vars(self).update({name: value for name, value in config_overrides.items() if name in vars(self)})
        self.config_overrides = config_overrides
        # The head size goes to the families whose config declares one, as Transformers' `CausalLMModelTester` passes
        # it (where it stays None, Mixtral's rotary scaling functions read None).
        family_config = FAMILIES[config_overrides.get("family", "llama")].config_class
        if "head_dim" in {field.name for field in dataclasses.fields(family_config)}:
            self.config_overrides = {"head_dim": self.hidden_size // self.num_attention_heads, **config_overrides}

    def get_config(self) -> AttnResConfig:
        shape = dict(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            intermediate_size=self.intermediate_size,
            max_position_embeddings=self.max_position_embeddings,
            initializer_range=0.02,
            pad_token_id=self.pad_token_id,
            num_labels=self.num_labels,
        )
        return AttnResConfig(**{**shape, **self.config_overrides})  # a family may replace the shape (DeepSeek's heads)

    def prepare_config_and_inputs_for_common(self) -> tuple[AttnResConfig, dict[str, torch.Tensor]]:
        input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
        attention_mask = torch.tril(torch.ones_like(input_ids))
        return self.get_config(), {"input_ids": input_ids, "attention_mask": attention_mask}


class AttnResCommonTests(ModelTesterMixin, GenerationTesterMixin):
    all_model_classes = (AttnResModel, AttnResForCausalLM, AttnResForSequenceClassification)
    # `_init_weights` initialises every parameter (the pseudo-queries to zero), so the missing-weights test applies.
    test_can_init_all_missing_weights_before_2023 = True
    config_overrides: dict = {}  # the family and the residual fields
    family_fields: dict = {}  # the family's fields that the tiny model needs (its MoE in small)

    def setUp(self):
        self.model_tester = AttnResModelTester(self, **self.config_overrides, **self.family_fields)
        # Llama's tester uses hidden_size=37 with Llama's 32 heads (head_dim 1); AttnResConfig refuses an odd head_dim
        # (rotary embeddings rotate pairs of channels), so the config tests get a shape it accepts.
        # Under the family's names for them, as its own test class passes them (GPT-2's `n_embd`, `n_head`): the saved
        # config holds those.
        aliases = FAMILIES[self.config_overrides.get("family", "llama")].config_class.attribute_map
        shape = dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=2)
        fields = {
            **{aliases.get(name, name): value for name, value in shape.items()},
            **self.config_overrides,
            **CONFIG_TESTER_FIELDS.get(self.config_overrides.get("family"), {}),
        }
        self.config_tester = ConfigTester(self, config_class=AttnResConfig, **fields)

    def test_config(self):
        self.config_tester.run_common_tests(can_init_without_params=self.family_config_inits_quietly)

    @property
    def family_config_inits_quietly(self) -> bool:
        """Whether the family's own config, built without arguments, logs nothing. Arcee's does not: its default bos and
        eos ids (128000, 128001) lie outside its default vocabulary (32000), and Transformers' config validation says
        so. The config test checks the same of AttnRes's only where the family's own config passes it."""
        logging.warning_once.cache_clear()
        with CaptureLogger(logging.get_logger("transformers.configuration_utils")) as captured:
            FAMILIES[self.config_overrides.get("family", "llama")].config_class()
        return captured.out == ""


def skipping(cls: type, prefixes: tuple[str, ...], reason: str) -> type:
    """`cls` with the tests whose names start with one of `prefixes` skipped for `reason`. A parameterized test's
    cases are named `<test>_<case>`: its prefix ends in `_`, so that the function it was expanded from stays
    uncollected."""
    for name in dir(cls):
        if name.startswith(prefixes):
            setattr(cls, name, unittest.skip(reason)(getattr(cls, name)))
    return cls


# Common tests that the family's own model fails the same way in this Transformers, where its own test class does not
# run them on it (Llama 4's tests run its multimodal model alone; HunYuan's, LFM2-MoE's and OLMo Hybrid's declare no
# fp32 modules, so the test skips there; DeepSeek-V2's and Phi-3.5-MoE's replace the tests; RecurrentGemma's model
# returns no cache, so the test skips; Nemotron-H's skips the layer count, as its tester needs a layer of each of its
# three kinds).
FAMILY_OWN_FAILURES = {
    "llama4_text": {
        "test_model_rope_scaling_frequencies": (
            "Llama 4's rotary embedding returns complex frequencies, one tensor, where the test unpacks (cos, sin)"
        ),
    },
    "deepseek_v2": {
        "test_model_rope_scaling_frequencies": (
            "DeepSeek-V2's rotary embedding returns complex frequencies, one tensor, where the test unpacks (cos, sin) "
            "(its own test class replaces the test)"
        ),
    },
    "hunyuan_v1_moe": {
        "test_keep_in_fp32_modules": (
            "HunYuan's router builds its weight in fp32 whatever the dtype, which its model class does not declare "
            "(its own test skips this test: the class lists no fp32 modules)"
        ),
    },
    # Its own test class replaces the RoPE-scaling tests with LongRoPE ones.
    "phimoe": dict.fromkeys(
        (
            "test_model_rope_scaling_frequencies",
            "test_model_rope_scaling_from_config_0_linear",
            "test_model_rope_scaling_from_config_1_dynamic",
            "test_model_rope_scaling_from_config_2_yarn",
        ),
        "Phi-3.5-MoE's rotary embedding reads LongRoPE's `original_max_position_embeddings` and mscales from any "
        "RoPE type but the default, which the generic scalings do not set",
    ),
    "recurrent_gemma": {
        "test_bc_cache_name_forward": (
            "RecurrentGemma's recurrent blocks hold their states themselves, so its cache's length, which its first, "
            "recurrent layer gives, stays 0 (its own model returns no cache, so the test skips there)"
        ),
    },
    "nemotron_h": {
        "test_num_layers_is_small": "NemotronH needs at least 3 layers to test (mamba, moe, attention) (its own skip)",
    },
    "olmo_hybrid": {
        "test_keep_in_fp32_modules": (
            "OLMo Hybrid's Gated DeltaNet builds its A_log in fp32 whatever the dtype, which its model class does not "
            "declare (its own test skips this test: the class lists no fp32 modules)"
        ),
    },
    "dbrx": {
        "test_tied_weights_are_sharded_together": (
            "DBRX's causal LM declares its head tied to `transformer.wte` and shards the head alone (its config has no "
            "base plan), though its config refuses `tie_word_embeddings=True`"
        ),
    },
    "lfm2_moe": {
        "test_keep_in_fp32_modules": (
            "LFM2-MoE's routing bias is a buffer built in fp32 whatever the dtype, which its model class does not "
            "declare (its own test skips this test: the class lists no fp32 modules)"
        ),
    },
}


# Class attributes the family's own test class sets. DeepSeek-V3.2's, A.X K2's, GLM-5's and MiniMax-M3's sparse
# attention picks its keys with an indexer whose top-k passes no gradient to the indexer's weights (the family's own
# model leaves them without one too; Dots 3 Note's, the same indexer, whose own tests do not train); the Mamba families
# and xLSTM have no attention.
FAMILY_TEST_ATTRIBUTES = {
    **dict.fromkeys(
        ("deepseek_v32", "dots3_note_text", "axk2", "glm_moe_dsa", "minimax_m3_vl_text"),
        dict(test_all_params_have_gradient=False),
    ),
    **dict.fromkeys(("mamba", "mamba2", "falcon_mamba", "xlstm"), dict(has_attentions=False)),
}


def skipping_family_own_failures(cls: type, family: Family) -> type:
    """`cls` with the tests `FAMILY_OWN_FAILURES` names for the family skipped, by their exact names."""
    for test, reason in FAMILY_OWN_FAILURES.get(family.model_type, {}).items():
        setattr(cls, test, unittest.skip(reason)(getattr(cls, test)))
    for name, value in FAMILY_TEST_ATTRIBUTES.get(family.model_type, {}).items():
        setattr(cls, name, value)
    return cls


def family_skips(cls: type, family: Family) -> type:
    """The common tests that read what the family's own model class or test class decides, where AttnRes holds it per
    config: the tests read these class attributes from AttnRes's classes, which serve every family."""
    if not family.moe:  # `_can_set_experts_implementation` is true for the model class; a dense config has no experts
        reason = "dense config: no experts or router (the MoE variants run this)"
        cls = skipping(cls, ("test_eager_matches_batched_and_grouped_inference_",), reason)
    elif not family.cls("PreTrainedModel")._can_set_experts_implementation():  # the test's own skip (Llama 4)
        reason = f"{family.cls('PreTrainedModel').__name__} does not support grouped_mm"
        cls = skipping(cls, ("test_eager_matches_batched_and_grouped_inference_",), reason)
    if not family.cls("PreTrainedModel")._supports_sdpa:  # the test's own skip, for the family's model (Gemma 2)
        reason = f"{family.prefix}Model does not support SDPA"
        cls = skipping(cls, ("test_sdpa_can_dispatch_non_composite_models",), reason)
    if family.rotary_per_layer_type:
        # The generic RoPE-scaling tests set one flat `rope_parameters`, which a rotary embedding with bases per
        # attention type (Gemma 3, OLMo 3) does not read: the family's own model fails them the same way, and its test
        # class replaces them with versions of its own.
        reason = f"{family.prefix}'s RoPE has bases per layer type, which the generic RoPE-scaling tests do not set"
        cls = skipping(cls, ("test_model_rope_scaling_frequencies", "test_model_rope_scaling_from_config_"), reason)
    declared = {field.name for field in dataclasses.fields(family.config_class)} | set(family.config_class.attribute_map)
    if "max_position_embeddings" not in declared:
        # The RoPE-scaling tests run where the config has a context length (`_config_supports_rope_scaling`), which the
        # tester gives every config; the family's own tests skip them on its config, which has none (RecurrentGemma's,
        # whose rotary embedding takes the default RoPE alone).
        reason = f"{family.prefix}'s config has no max_position_embeddings, so its own tests skip RoPE scaling"
        cls = skipping(cls, ("test_model_rope_scaling_frequencies", "test_model_rope_scaling_from_config_"), reason)
    plan = family.config_class.base_model_tp_plan or {}
    if "layers.*.self_attn.q_proj" in plan and "layers.*.self_attn.q_b_proj" in plan:
        # Multi-head latent attention's plan names both query projections, `q_proj` (no `q_lora_rank`) and the low-rank
        # `q_b_proj`; a config builds one of them, so the family's own model fails this test the same way.
        reason = f"{family.prefix}'s plan names q_proj and q_b_proj, alternatives of which a config builds one"
        cls = skipping(cls, ("test_tp_plan_matches_params",), reason)
    cls = skipping_family_own_failures(cls, family)
    if family.layer_sublayers is not None:
        # Only the attention layers return attention weights; the family's test class replaces the test with one that
        # counts them.
        reason = f"{family.prefix}'s test class counts the attentions of its attention layers alone in its own version"
        cls = skipping(cls, ("test_attention_outputs",), reason)
    return cls


# The MoE families' experts and the hybrids' layers, in small, and what else a family's defaults do not fit the tester
# with; the other families' defaults fit the tester's shape.
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
# A Gated DeltaNet layer, then an attention layer (Qwen3-Next, Qwen3.5), in small. Heads of 16 channels: the
# attention rotates a quarter of each (`partial_rotary_factor`), and the dynamic RoPE scaling divides by that number
# less 2.
GATED_DELTANET = dict(
    head_dim=16,
    layer_types=["linear_attention", "full_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
)
# Multi-head latent attention in small, whose keys and values have as many heads as its queries.
MLA = dict(
    q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, num_key_value_heads=4
)
# A dense first layer, a shared expert, the top-k within the best of 2 groups, with latent attention (DeepSeek-V2 and
# V3, GLM-4.7-Flash, A.X K1).
DEEPSEEK_MLA_MOE = dict(
    n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, **MLA, **MOE
)
# DeepSeek-V3.2's indexer, choosing fewer keys than the tester's prompts hold.
DSA = dict(index_topk=4, index_head_dim=8, index_n_heads=2)
# Kimi Delta Attention, then NoPE latent attention, then MoE after a dense first layer (Kimi Linear), in small.
KIMI_LINEAR = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_heads=2,
    linear_head_dim=16,
    num_local_experts=4,
    n_shared_experts=1,
    **MLA,
    **MOE,
)
FAMILY_FIELDS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=32, **MOE),
    "qwen3_moe": dict(num_experts=4, **MOE),
    "deepseek_v3": DEEPSEEK_MLA_MOE,
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),
    "glm4_moe": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, **MOE),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "granitemoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "minimax_m2": dict(num_local_experts=4, num_experts_per_tok=2),
    "ernie4_5_moe": dict(
        moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1
    ),
    "hunyuan_v1_moe": dict(num_experts=4, moe_topk=2, moe_intermediate_size=32),
    # A dense layer, then an MoE one, whose attention has no rotary embedding (NoPE) where the first's is chunked.
    "llama4_text": dict(
        num_local_experts=4,
        num_experts_per_tok=1,
        intermediate_size_mlp=40,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=2,
        attention_chunk_size=4,
    ),
    "hy_v3": dict(num_experts=4, num_shared_experts=1, mlp_layer_types=["dense", "sparse"], **MOE),
    # A windowed layer, the only kind that Flint rotates, before a full one.
    "flint": dict(
        num_experts=4,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[0],
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        **MOE,
    ),
    "aria_text": dict(moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1),
    "exaone_moe": dict(
        num_experts=4, num_shared_experts=1, mlp_layer_types=["dense", "sparse"], n_group=2, topk_group=1, **MOE
    ),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, **MOE),
    "deepseek_v2": dict(DEEPSEEK_MLA_MOE, topk_method="group_limited_greedy"),
    "glm4_moe_lite": dict(DEEPSEEK_MLA_MOE, mlp_layer_types=["dense", "sparse"]),
    "axk1": dict(DEEPSEEK_MLA_MOE, mlp_layer_types=["dense", "sparse"]),
    "flex_olmo": dict(num_experts=4, num_experts_per_tok=2),
    "deepseek_v32": dict(DEEPSEEK_MLA_MOE, mlp_layer_types=["dense", "sparse"], **DSA),
    # An indexed layer, then a windowed one of latent attention of another shape.
    "dots3_note_text": dict(
        DEEPSEEK_MLA_MOE,
        mlp_layer_types=["dense", "sparse"],
        layer_types=["indexed_attention", "sliding_attention"],
        sliding_window=4,
        shared_experts_intermediate_size=16,
        swa_num_attention_heads=4,
        swa_num_key_value_heads=4,
        swa_q_lora_rank=24,
        swa_kv_lora_rank=8,
        swa_head_dim=24,
        swa_qk_nope_head_dim=16,
        swa_v_head_dim=8,
        **DSA,
    ),
    "axk2": dict(DEEPSEEK_MLA_MOE, mlp_layer_types=["dense", "sparse"], gated_norm_rank=8, **DSA),
    # GLM-5's second layer reuses the keys its first layer's indexer chose.
    "glm_moe_dsa": dict(DEEPSEEK_MLA_MOE, mlp_layer_types=["dense", "sparse"], indexer_types=["full", "shared"], **DSA),
    "afmoe": dict(num_experts=4, num_shared_experts=1, num_dense_layers=1, mup_enabled=True, **MOE),
    "granitemoeshared": dict(num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=32),
    "qwen3_next": dict(num_experts=4, shared_expert_intermediate_size=32, **GATED_DELTANET, **MOE),
    "qwen3_5_text": GATED_DELTANET,
    "qwen3_5_moe_text": dict(num_experts=4, shared_expert_intermediate_size=32, **GATED_DELTANET, **MOE),
    # Transformers' own tester gives every family gelu. Apertus's default xIELU holds parameters that its own
    # `_init_weights` leaves to their construction, so its model fails the meta-device initialisation tests too.
    **dict.fromkeys(("apertus", "apertus1p5_text"), dict(hidden_act="gelu")),
    # Heads of 16 channels, as in Transformers' tester: StableLM rotates a quarter of each, and the dynamic RoPE
    # scaling divides by that number less 2.
    "stablelm": dict(num_attention_heads=2, num_key_value_heads=2),
    # A global and a windowed layer, as GPT-Neo's own tester has them: its default pattern is 24 layers long.
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]], window_size=3),
    "kimi_linear": KIMI_LINEAR,
    # A short convolution, then attention (LFM2; LFM3's windowed).
    "lfm2": dict(layer_types=["conv", "full_attention"]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_experts=4, num_dense_layers=1, **MOE),
    "lfm3": dict(layer_types=["conv", "sliding_attention"], sliding_window=4),
    # Mamba 2, then attention with RoPE; the MoE with a shared MLP beside it (Granite 4).
    "granitemoehybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        position_embedding_type="rope",
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_chunk_size=4,
    ),
    # A windowed layer, then a full one; a dense first layer, then MoE with a shared expert.
    "laguna": dict(
        num_experts=4,
        shared_expert_intermediate_size=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        **MOE,
    ),
    # A dense first layer, as in its checkpoints, whose MLP the tensor-parallel plan names.
    "mellum": dict(
        num_experts=4,
        layer_types=["sliding_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse"],
        sliding_window=4,
        **MOE,
    ),
    "phimoe": dict(num_local_experts=4, num_experts_per_tok=2),
    "minicpm5_moe": dict(n_routed_experts=4, n_shared_experts=1, mlp_layer_types=["dense", "sparse"], **MOE),
    # A full layer, then a sparse one whose indexer keeps 2 blocks of 2 keys; a dense first layer; partial RoPE.
    "minimax_m3_vl_text": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        dense_intermediate_size=40,
        mlp_layer_types=["dense", "sparse"],
        layer_types=["full_attention", "minimax_m3_sparse"],
        rotary_dim=4,
        index_n_heads=2,
        index_head_dim=8,
        index_block_size=2,
        index_topk_blocks=2,
    ),
    **dict.fromkeys(
        ("param2moe", "sarvam_moe"),
        dict(n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1, **MOE),
    ),
    "sarvam_mla": DEEPSEEK_MLA_MOE,
    # Linear attention, then latent attention; a dense first layer, then MoE with a shared expert.
    "bailing_hybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        num_local_experts=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        **MLA,
        **MOE,
    ),
    # Gated DeltaNet, then a windowed layer with RoPE.
    "lara_mini": dict(
        GATED_DELTANET,
        layer_types=["linear_attention", "sliding_attention"],
        sliding_window=4,
        num_experts=4,
        shared_expert_intermediate_size=32,
        **MOE,
    ),
    # Gated DeltaNet, then attention with norms after each branch.
    "olmo_hybrid": dict(
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    ),
    # A sparse layer whose indexer picks a pool of candidate keys, then a windowed one; a dense first layer.
    "kolibri1_1": dict(
        num_experts=4,
        shared_expert_intermediate_size=32,
        mlp_only_layers=[0],
        mlp_only_intermediate_size=40,
        head_dim=16,
        sliding_window=4,
        layer_types=["indexed_attention", "sliding_attention"],
        index_topk=4,
        index_pool_size=4,
        index_compression=2,
        index_num_heads=2,
        index_num_local_tokens=1,
        index_num_sink_tokens=1,
        **MOE,
    ),
    # A full NoPE layer, then a windowed one with RoPE; the MoE with a shared MLP beside it.
    "granitemoe_swa": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        layer_types=["full_attention", "sliding_attention"],
        sliding_window=4,
        layer_rope_theta=[0, 10000.0],
    ),
    # A full NoPE layer, then a windowed one with RoPE.
    "granite_swa": dict(
        layer_types=["full_attention", "sliding_attention"], sliding_window=4, layer_rope_theta=[0, 10000.0]
    ),
    # Mamba 2's heads fill hidden_size * expand, in groups that divide them.
    "mamba2": dict(num_heads=4, head_dim=16, n_groups=2, chunk_size=4),
    # Each layer type once: Mamba 2, an MoE, attention, an MLP (Nemotron-H).
    "nemotron_h": dict(
        num_hidden_layers=4,
        layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
        mamba_num_heads=4,
        mamba_head_dim=16,
        n_groups=2,
        ssm_state_size=16,
        chunk_size=4,
        n_routed_experts=4,
        moe_shared_expert_intermediate_size=32,
        **MOE,
    ),
    # Mamba with MoE, then NoPE attention with a dense MLP (Jamba).
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=0,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
    ),
    # Mamba 2, then attention (Bamba).
    "bamba": dict(attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=4),
    # Mamba 2 beside attention in both layers (Falcon-H1).
    "falcon_h1": dict(mamba_d_ssm=None, mamba_n_heads=4, mamba_d_state=16, mamba_chunk_size=4),
    # A recurrent block, then windowed attention (RecurrentGemma).
    "recurrent_gemma": dict(block_types=["recurrent", "attention"], attention_window_size=4),
    "solar_open": dict(n_routed_experts=4, n_shared_experts=1, n_group=2, topk_group=1, **MOE),
    # A full layer, then a windowed one with sinks; a dense MLP, then MoE.
    "mimo_v2_flash": dict(n_routed_experts=4, v_head_dim=8, sliding_window=4, **MOE),
    "kolibri1": dict(
        num_experts=4,
        shared_expert_intermediate_size=32,
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=4,
        **MOE,
    ),
    # Latent attention, whose keys and values have as many heads as its queries.
    **dict.fromkeys(("youtu", "minicpm3"), MLA),
    # CTRL's default MLP is 8192 wide.
    "ctrl": dict(dff=40),
    # Attention heads as experts, two per token over each key head: the tester's 4 heads of 8 channels.
    "jetmoe": dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=8),
    # A windowed layer, then a full one, each with the tester's heads; a dense MLP, then MoE with a shared expert.
    "inkling_text": dict(
        swa_num_attention_heads=4,
        swa_num_key_value_heads=2,
        swa_head_dim=8,
        sliding_window_size=4,
        layer_types=["hybrid_sliding", "hybrid"],
        d_rel=4,
        rel_extent=8,
        conv_kernel_size=3,
        mlp_layer_types=["dense", "sparse"],
        n_routed_experts=4,
        n_shared_experts=1,
        **MOE,
    ),
    # The tester's width under its own name too, which DBRX's config copies into `ffn_config` before it sets the
    # aliased `hidden_size`; the tester's key heads, the `rope_theta` that its attention reads from its attention
    # config, which does not declare one, and a clipping bound, without which its attention's clamp fails; MoE in small,
    # in its experts config.
    "dbrx": dict(
        d_model=32,
        attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2),
    ),
    # xLSTM's queries and values 64 wide: its cache sizes the states by widths rounded up to a multiple of 64, its
    # layers by the widths themselves, so that with other widths its own model fails with a cache; its embedding as
    # wide (its default is 4096), its heads.
    "xlstm": dict(hidden_size=64, embedding_dim=64, num_heads=4, qk_dim_factor=1.0),
}
assert FAMILY_FIELDS.keys() >= {name for name, family in FAMILIES.items() if family.moe or family.layer_sublayers}
# The family's fields that the config tests' shape (hidden 40) needs: Granite 4's and Bamba's Mamba heads divide
# 2 * hidden_size, and their size is the rest.
CONFIG_TESTER_FIELDS = {
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=20),
    "mamba2": dict(num_heads=4, head_dim=20, n_groups=2),
    "bamba": dict(mamba_n_heads=4, mamba_d_head=20),
    # Experts and top-k that dots1's and DeepSeek-V2's defaults leave unset, which AttnResConfig requires.
    "dots1": dict(n_routed_experts=4, num_experts_per_tok=2),
    "deepseek_v2": dict(num_experts_per_tok=2),
    # Kolibri 1.1's indexer heads, at most the query heads of a key head (2 in the shape above; its default is 12).
    "kolibri1_1": dict(index_num_heads=2),
    # Dots 3 Note's heads as its windowed layers have them by default (64 query and key heads, as many of each): with
    # other heads in its other layers the config holds no global head count, which the config tests read.
    "dots3_note_text": dict(num_attention_heads=64, num_key_value_heads=64),
}


def common_test_case(family: str, residual_mode: str) -> type:
    """The common tests on one family in one residual mode (Block with blocks of one decoder layer)."""
    config_overrides = dict(family=family, residual_mode=residual_mode)
    if residual_mode == "block":
        config_overrides["block_size"] = 2
    # Named by the model type: families that run another's modules share its class prefix (InternLM3 runs Llama's).
    name = "".join(part[:1].upper() + part[1:] for part in family.replace("-", "_").split("_"))
    case = type(
        f"AttnRes{residual_mode.title()}{name}ModelTest",
        (AttnResCommonTests, unittest.TestCase),
        {"config_overrides": config_overrides, "family_fields": FAMILY_FIELDS.get(family, {}), "__module__": __name__},
    )
    return family_skips(case, FAMILIES[family])


# Block AttnRes on every family; Full AttnRes and the standard residual on Llama and Qwen3 (q/k norms), and Full
# AttnRes on MoE layers (Mixtral).
VARIANTS = [(family, "block") for family in FAMILIES] + [
    (family, mode) for mode in ("full", "standard") for family in ("llama", "qwen3")
] + [("mixtral", "full")]
for family, residual_mode in VARIANTS:
    case = common_test_case(family, residual_mode)
    globals()[case.__name__] = case
del case
