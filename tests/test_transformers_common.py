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
        self.config_overrides = config_overrides
        # The head size goes to the families whose config declares one, as Transformers' `CausalLMModelTester` passes
        # it (where it stays None, Mixtral's rotary scaling functions read None).
        family_config = FAMILIES[config_overrides.get("family", "llama")].config_class
        if "head_dim" in {field.name for field in dataclasses.fields(family_config)}:
            self.config_overrides = {"head_dim": self.hidden_size // self.num_attention_heads, **config_overrides}

    def get_config(self) -> AttnResConfig:
        return AttnResConfig(
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
            **self.config_overrides,
        )

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
        self.config_tester = ConfigTester(
            self,
            config_class=AttnResConfig,
            hidden_size=40,
            num_attention_heads=4,
            num_key_value_heads=2,
            **self.config_overrides,
        )

    def test_config(self):
        self.config_tester.run_common_tests()


def skipping(cls: type, prefixes: tuple[str, ...], reason: str) -> type:
    """`cls` with the tests whose names start with one of `prefixes` skipped for `reason`. A parameterized test's
    cases are named `<test>_<case>`: its prefix ends in `_`, so that the function it was expanded from stays
    uncollected."""
    for name in dir(cls):
        if name.startswith(prefixes):
            setattr(cls, name, unittest.skip(reason)(getattr(cls, name)))
    return cls


def family_skips(cls: type, family: Family) -> type:
    """The common tests that read what the family's own model class or test class decides, where AttnRes holds it per
    config: the tests read these class attributes from AttnRes's classes, which serve every family."""
    if not family.moe:  # `_can_set_experts_implementation` is true for the model class; a dense config has no experts
        reason = "dense config: no experts or router (the MoE variants run this)"
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
    return cls


# The MoE families' experts, in small; the other families' defaults fit the tester's shape.
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
MOE_FIELDS = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=32, **MOE),
    "qwen3_moe": dict(num_experts=4, **MOE),
}
assert MOE_FIELDS.keys() == {name for name, family in FAMILIES.items() if family.moe}


def common_test_case(family: str, residual_mode: str) -> type:
    """The common tests on one family in one residual mode (Block with blocks of one decoder layer)."""
    config_overrides = dict(family=family, residual_mode=residual_mode)
    if residual_mode == "block":
        config_overrides["block_size"] = 2
    case = type(
        f"AttnRes{residual_mode.title()}{FAMILIES[family].prefix}ModelTest",
        (AttnResCommonTests, unittest.TestCase),
        {"config_overrides": config_overrides, "family_fields": MOE_FIELDS.get(family, {}), "__module__": __name__},
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
