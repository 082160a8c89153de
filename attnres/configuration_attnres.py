"""Configuration of AttnRes models: a Transformers decoder family (Llama by default) whose residual connections can
be replaced by softmax attention over depth (Kimi Team, "Attention Residuals", arXiv:2603.15031)."""

import dataclasses
import functools
import math
import operator

import transformers
from huggingface_hub.errors import StrictDataclassClassValidationError
from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig

from .families import FAMILIES, layer_types
from .transformers_compat import CACHE_NAME


RESIDUAL_MODES = ("standard", "full", "block")
# Residual connections from other papers, for ablations (docs/design.md §9); conversions target RESIDUAL_MODES only.
COMPARISON_MODES = ("denseformer", "hc", "mhc")
# The paper's Table 4 ablations of AttnRes (docs/design.md §9), applied to Full or Block AttnRes.
DEPTH_ABLATIONS = ("input_query", "sigmoid", "no_key_norm", "sliding_window", "multi_head")
# Written into every saved config so the folder loads with `trust_remote_code=True` through any of these Auto classes
# (saving one model class would otherwise only record that class).
AUTO_MAP = {
    "AutoConfig": "configuration_attnres.AttnResConfig",
    "AutoModel": "modeling_attnres.AttnResModel",
    "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM",
    "AutoModelForSequenceClassification": "modeling_attnres.AttnResForSequenceClassification",
}
# Fields with a domain that `AttnResConfig` checks, of those its family has, by kind.
_BOOL_FIELDS = (
    "use_cache",
    "tie_word_embeddings",
    "attention_bias",
    "qkv_bias",
    "mlp_bias",
    "output_router_logits",
    "exact_retrofit",
)
_POSITIVE_INT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "max_position_embeddings",
    "depth_window",
    "dwa_dilation",
    "dwa_period",
    "sinkhorn_iterations",
)
_NUMBER_FIELDS = (
    "initializer_range",
    "rms_norm_eps",
    "layer_norm_eps",
    "norm_epsilon",
    "router_aux_loss_coef",
    "router_jitter_noise",
)
TARGET_NUM_BLOCKS = 8  # the paper recommends about 8 blocks for Block AttnRes


def layers_per_block(num_hidden_layers: int) -> int:
    """The default block's size in decoder layers: the one whose number of blocks is nearest `TARGET_NUM_BLOCKS`,
    the larger on a tie (fewer blocks cost less). Whole layers, so that no block splits a layer's mixer from its MLP:
    such a checkpoint would have no FLA or Kimi equivalent."""
    return min(
        range(1, num_hidden_layers + 1),
        key=lambda n: (abs(math.ceil(num_hidden_layers / n) - TARGET_NUM_BLOCKS), -n),
    )


class FamilySubConfigs:
    """`AttnResConfig.sub_configs`: those of the config's family (MPT's `attn_config`), to which Transformers passes
    the attention and experts implementations on as it sets them; none on the class itself, which serves every
    family."""

    def __get__(self, instance: PreTrainedConfig | None, owner: type) -> dict[str, type[PreTrainedConfig]]:
        family = getattr(instance, "family", None)
        return dict(FAMILIES[family].config_class.sub_configs) if family in FAMILIES else {}


class AttnResConfig(PreTrainedConfig):
    r"""
    Configuration for [`AttnResModel`] and [`AttnResForCausalLM`]: a decoder family's own configuration plus the
    residual fields below.

    `family` names the Transformers decoder family whose modules the model is built from (`families.py`: `"llama"`,
    `"qwen3"`, `"gemma3_text"`, `"olmo2"`, `"phi3"`, `"granite"`, ...; Llama by default). The config holds that
    family's config fields, under its names (and aliases: Mixtral's `num_experts`), with its defaults and default
    derivations (Gemma 3's `layer_types`, Qwen2's window), and no other family's: a Llama config has no
    `sliding_window`, a dense one no expert or router field. So the family's modules read it as their own, and
    tools that probe a config's attributes (Transformers' tests and caches, TRL, PEFT, vLLM) treat the model as one
    of the family. Only the fields below are this class's own; the family's are passed by name.

    A config saved without `family` is read as the family its fields imply (Mixtral for experts, Qwen2 for
    `qkv_bias`, Mistral for a window, else Llama): such configs hold every field of Llama's and Mixtral's, and the
    ones the family has not are dropped where they keep their defaults (`qkv_bias=True` means Qwen2: a bias on the
    query, key and value projections only, where `attention_bias=True` puts one on all four).

    Residual fields:
        residual_mode (`str`, defaults to `"block"`):
            `"standard"`: the family's own residual stream, bit-compatible with its `*ForCausalLM`.
            `"full"`: Full AttnRes, every sublayer attends over the embedding and every earlier sublayer output.
            `"block"`: Block AttnRes, sublayers are grouped into blocks of `block_size`; a sublayer attends over the
            completed block sums and the running sum of its own block.
        block_size (`int`, *optional*):
            Block size S in *sublayers* (`num_sublayers`: an attention and an MLP are two sublayers, so a model whose
            `num_hidden_layers` decoder layers hold both has `2 * num_hidden_layers` sublayers; a layer with one
            mixer and no MLP, Mamba's or Nemotron-H's, is one). Defaults to blocks of whole decoder layers, as FLA,
            Kimi's released model and vLLM count them, as many layers per block as brings the number of blocks
            nearest 8, the paper's recommendation (ties: fewer blocks).
            `block_size=1` is Full AttnRes. Only used when `residual_mode="block"`.
        exact_retrofit (`bool`, defaults to `False`):
            Divide the eps of each pre-norm (and of the final norm) by k**2, where k is the number of depth sources
            of the mixing step in front of it. With zero pseudo-queries a mixing step returns (sum of sources) / k
            and RMSNorm(x / k, eps) == RMSNorm(x, eps * k**2), so this makes a freshly converted checkpoint compute
            exactly what the PreNorm source computed. Conversions turn it on; models trained from scratch leave it
            off.
        depth_kernel (`str`, defaults to `"auto"`):
            `"auto"` uses the Triton kernels for block aggregation on CUDA when Triton is importable, the fused C++
            kernels on the CPU when they build (once per machine, on first use), and the PyTorch implementation
            otherwise; `"reference"` always uses the PyTorch implementation. The environment variable
            `ATTNRES_DEPTH_KERNEL=reference` forces it too.

    Comparison fields (docs/design.md §9; for ablation studies):
        residual_mode (`str`) also accepts `"denseformer"` (a depth-weighted average after decoder blocks), `"hc"`
            (Hyper-Connections) and `"mhc"` (Manifold-Constrained Hyper-Connections). DenseFormer and HC equal the
            `"standard"` model at initialisation.
        depth_ablation (`str`, *optional*):
            One of the paper's AttnRes ablations, with `residual_mode="full"` or `"block"`: `"input_query"` (a
            per-token query projected from the newest source), `"sigmoid"` (independent sigmoid weights instead of a
            softmax), `"no_key_norm"` (scores on raw sources), `"sliding_window"` (the embedding and the newest
            `depth_window` sources), `"multi_head"` (`depth_heads` heads over `hidden_size / depth_heads` channels).
        depth_window (`int`, defaults to 8): sources besides the embedding that `"sliding_window"` keeps.
        depth_heads (`int`, defaults to 4): heads of `"multi_head"`; must divide `hidden_size`.
        dwa_dilation (`int`, defaults to 1), dwa_period (`int`, defaults to 1):
            DenseFormer's k and p: the average after block i reads blocks i, i - k, i - 2k, ... (and the embedding
            when i is a multiple of k); averages follow every p-th block and the last.
        hc_streams (`int`, defaults to 4): the number n of residual streams of `"hc"` and `"mhc"` (at least 2).
        sinkhorn_iterations (`int`, defaults to 20): Sinkhorn-Knopp iterations that make mHC's stream mixing
            doubly stochastic.
    """

    model_type = "attnres"
    keys_to_ignore_at_inference = [CACHE_NAME]
    sub_configs = FamilySubConfigs()

    # Pipeline stages split only at the embedding and the final norm: the decoder layers pass on the whole depth
    # state, not one `hidden_states` tensor.
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    family: str | None = None
    residual_mode: str = "block"
    block_size: int | None = None
    exact_retrofit: bool = False
    depth_kernel: str = "auto"
    # Comparison residuals and AttnRes ablations (docs/design.md §9)
    depth_ablation: str | None = None
    depth_window: int = 8
    depth_heads: int = 4
    dwa_dilation: int = 1
    dwa_period: int = 1
    hc_streams: int = 4
    sinkhorn_iterations: int = 20

    def __post_init__(self, **kwargs):
        """Every argument but the residual fields is the family's: its own config is built from them (with this
        config's `PreTrainedConfig` fields), running its derivations and `PreTrainedConfig.__post_init__`, and this
        config takes its whole state. Given values are checked first, so that a bad one is named here, not by the
        family's config."""
        if self.family is None:  # saved before configs named their family
            self.family, kwargs = _legacy_reading(kwargs)
        if self.family not in FAMILIES:
            families = ", ".join(repr(name) for name in FAMILIES)
            installed = transformers.__version__
            self._fail("family", f"one of the families of the installed Transformers {installed}: {families}")
        family_config = FAMILIES[self.family].config_class
        # The family's aliases (Mixtral's `num_experts` for `num_local_experts`), which `PreTrainedConfig` resolves on
        # every attribute read and write through `attribute_map`, found on the instance before the class.
        vars(self)["attribute_map"] = dict(family_config.attribute_map)
        kwargs = self._without_other_families_fields(family_config, kwargs)
        given = {name: kwargs[name] for name in _declared_fields(family_config) & kwargs.keys()}
        for name, value in {**_field_defaults(family_config), **given}.items():
            setattr(self, name, value)  # through the family's aliases
        self._check_fields()
        shared = {field.name: getattr(self, field.name) for field in dataclasses.fields(PreTrainedConfig)}
        vars(self).update(vars(family_config(**shared, **kwargs)))
        vars(self)[_FAMILY_BUILT] = True  # the family's properties read complete fields from here on (`__getattr__`)
        for name, value in _class_settings(family_config).items():
            vars(self).setdefault(name, value)
        if self.block_size is None:  # the sublayers of the first n layers
            self.block_size = self.layer_offsets[layers_per_block(self.num_hidden_layers)]
        # An attribute, not a property: Transformers < 5.20 extends it for tied embeddings. `None` where the family has
        # no plan (GPT-2, StableLM), as its own config says.
        plan = FAMILIES[self.family].tp_plan
        self.base_model_tp_plan = None if plan is None else dict(plan)
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}
        self._check_fields()

    def __getattr__(self, name: str):
        """The family config's properties (Mamba's `layer_types`, Nemotron-H's `num_hidden_layers`, Jamba's
        `layers_block_type`, Bailing's `limit_after_act`, Kolibri 1.1's `kv_sharing_modes`), which its modules and
        Transformers' caches read, computed from this config's fields as the family's config computes them from its
        own, under the family's aliases too (Bamba's `layer_types`). Python calls this only for a name that the
        instance and its class lack."""
        # Read once: `vars(self)` goes through Transformers' `__getattribute__` hooks, and every forward pass probes a
        # few names that no config has (`merge_with_config_defaults`).
        fields = vars(self)
        family = FAMILIES.get(fields.get("family"))
        if family is not None and fields.get(_FAMILY_BUILT):
            config_class = family.config_class
            family_property = _properties(config_class).get(config_class.attribute_map.get(name, name))
            if family_property is not None:
                return family_property.fget(self)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def to_dict(self) -> dict:
        """Transformers' serialisation of the instance's attributes, less the family's aliases (`__post_init__`)."""
        output = super().to_dict()
        output.pop("attribute_map", None)
        output.pop(_FAMILY_BUILT, None)
        if getattr(self, "family", None) in FAMILIES:  # the family's class settings, which its config does not save
            for name, value in _class_settings(FAMILIES[self.family].config_class).items():
                if name in output and output[name] == value:
                    del output[name]
        return output

    def _without_other_families_fields(self, family_config: type[PreTrainedConfig], kwargs: dict) -> dict:
        """`kwargs` without the fields of Llama's and Mixtral's configs (which configs of every family held before
        each was its family's) that `family_config` does not have, where they keep their defaults or where the family's
        config derives them itself (ModernBERT decoder's `sliding_window`); another value is refused, for it would
        change the model in a family with no such field."""
        declared = _declared_fields(family_config)
        for name, default in _SUPERSET_DEFAULTS.items():
            if name in kwargs and name not in declared and kwargs[name] != default:
                if name in _derived_attributes(family_config):
                    continue
                raise ValueError(
                    f"AttnResConfig.{name}={kwargs[name]!r}: must be {default!r}: family {self.family!r} has no such "
                    "field"
                )
        return {name: value for name, value in kwargs.items() if name in declared or name not in _SUPERSET_DEFAULTS}

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Transformers sets the keyword overrides of `from_pretrained` after `__init__`, so they are checked here."""
        loaded = super().from_dict(config_dict, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded)._check_fields()
        return loaded

    def validate(self) -> None:
        """Transformers' checks, with the family config's own check of its layer types where it replaces Transformers'
        (Nemotron-H's include MLP and MoE layers), then AttnRes's; `save_pretrained` runs it, so a field set to a bad
        value after `__init__` is never saved."""
        for validator in self.__class_validators__:
            if validator.__name__ == "validate_layer_type":
                validator = FAMILIES[self.family].config_class.validate_layer_type
            try:
                validator(self)
            except (ValueError, TypeError) as error:  # as Transformers' `validate` reports them
                raise StrictDataclassClassValidationError(validator=validator.__name__, cause=error) from error
        self._check_fields()

    @property
    def _rope_type_labels(self) -> tuple[str, ...] | None:
        """The family config's names of its RoPE entries where they differ from its layer types (LFM3's attention
        types beside its convolutions), a class attribute there, which Transformers' RoPE validation and the family's
        rotary embedding read."""
        family = FAMILIES.get(self.family)
        return getattr(family.config_class, "_rope_type_labels", None) if family else None

    @property
    def num_sublayers(self) -> int:
        """L: every token mixer (attention, or a hybrid's linear attention) and every MLP is its own sublayer, so a
        layer holds two, or one where it has one mixer and no MLP (Mamba, Nemotron-H) (docs/design.md §1)."""
        return self.layer_offsets[-1]

    @property
    def layer_offsets(self) -> tuple[int, ...]:
        """Entry i is the number of sublayers in decoder layers 0 .. i - 1: layer i holds the sublayers at positions
        `layer_offsets[i] + 1 .. layer_offsets[i + 1]`, and the last entry is L (`Family.layer_offsets`)."""
        return FAMILIES[self.family].layer_offsets(self)

    @property
    def depth_block_size(self) -> int:
        """The block size the depth mixing actually uses: 1 for Full AttnRes, `block_size` for Block AttnRes."""
        return 1 if self.residual_mode == "full" else self.block_size

    @property
    def base_model_ep_plan(self) -> dict[str, str] | None:
        """The MoE family's expert-parallel plan; a dense family has no experts to place."""
        return FAMILIES[self.family].ep_plan

    def _value(self, field: str):
        """The value of `field`: a field, or a sub-config's by its dotted path (DBRX's `ffn_config.moe_num_experts`,
        `families.Moe`)."""
        return operator.attrgetter(field)(self)

    def _fail(self, field: str, allowed: str) -> None:
        raise ValueError(f"AttnResConfig.{field}={self._value(field)!r}: must be {allowed}")

    def _check_positive_int(self, field: str) -> None:
        if not _is_int(self._value(field)) or self._value(field) < 1:
            self._fail(field, "a positive integer")

    def _check_int_range(self, field: str, low: int, high: float, allowed: str) -> None:
        if not _is_int(self._value(field)) or not low <= self._value(field) <= high:
            self._fail(field, allowed)

    def _check_number(self, field: str, low: float, high: float = math.inf) -> None:
        value = getattr(self, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            self._fail(field, f"a number >= {low}" if high == math.inf else f"a probability in [{low}, {high}]")

    def _check_fields(self) -> None:
        """Every field with a domain, of those the family has; a bad one raises a one-line `ValueError` naming it, its
        value and what is allowed. Runs on the given values before the family's config derives the others (a
        `head_dim`, `num_key_value_heads`, `block_size` or a hybrid's `layer_types` still `None` is derived
        later), and on the result."""
        # A heterogeneous config's per-layer fields (Dots 3 Note's `per_layer_config`: attention shapes) are the family
        # config's to check, layer by layer; reading one that varies raises.
        per_layer = getattr(self, "per_layer_attributes", None) or set()
        fields = [name for name in _BOOL_FIELDS + _POSITIVE_INT_FIELDS + _NUMBER_FIELDS if name not in per_layer]
        present = [name for name in fields if hasattr(self, name)]
        # Sizes the family's modules derive where they are None (GPT-Neo's `intermediate_size`, 4 * hidden_size).
        defaults = _field_defaults(FAMILIES[self.family].config_class)
        derived = {name for name, default in defaults.items() if default is None}
        present = [name for name in present if not (name in derived and getattr(self, name) is None)]
        for field in present:
            if field in _BOOL_FIELDS and not isinstance(getattr(self, field), bool):
                self._fail(field, "a bool (True or False)")
            elif field in _POSITIVE_INT_FIELDS:
                self._check_positive_int(field)
            elif field in _NUMBER_FIELDS:
                self._check_number(field, 0)
        if hasattr(self, "attention_dropout"):  # Ernie 4.5's configs have none
            self._check_number("attention_dropout", 0, 1)
        if getattr(self, "word_embed_proj_dim", None) not in (None, self.hidden_size):  # OPT's narrower embedding
            allowed = f"hidden_size = {self.hidden_size}: OPT's projections in and out of the layers are not supported"
            self._fail("word_embed_proj_dim", allowed)
        if getattr(self, "use_parallel_residual", False):  # StableLM's variant: attention and MLP read one input
            self._fail("use_parallel_residual", "False: a parallel residual has no sublayer order to attend over")
        if getattr(self, "apply_residual_connection_post_layernorm", False):  # BLOOM's variant
            allowed = "False: a normed residual, norm(h) + f(norm(h)), is not a sum of the sublayers' outputs"
            self._fail("apply_residual_connection_post_layernorm", allowed)
        if self.residual_mode not in RESIDUAL_MODES + COMPARISON_MODES:
            self._fail("residual_mode", "one of " + " | ".join(repr(m) for m in RESIDUAL_MODES + COMPARISON_MODES))
        if self.depth_kernel not in ("auto", "reference"):
            self._fail("depth_kernel", "'auto' | 'reference'")
        for field in ("hidden_act", "hidden_activation"):  # Gemma 2 and 3 name it the second way
            activation = getattr(self, field, "silu")
            if not isinstance(activation, str) or activation not in ACT2FN:
                self._fail(field, "the name of a Transformers activation, e.g. 'silu' or 'gelu'")
        family = FAMILIES[self.family]
        kinds = getattr(self, "layer_types", None)
        if family.layer_sublayers and kinds is not None and not set(kinds) <= family.layer_sublayers.keys():
            self._fail("layer_types", "a list of " + " | ".join(repr(kind) for kind in family.layer_sublayers))
        # L, once the config holds the layers' count and, for a hybrid, their types (Nemotron-H's config derives both).
        sublayers_known = hasattr(self, "num_hidden_layers") and (
            family.layer_sublayers is None or getattr(self, "layer_types", None) is not None
        )
        if self.block_size is not None and sublayers_known:
            sublayers = self.num_sublayers
            allowed = f"an integer from 1 to {family.num_sublayers_formula} = {sublayers}"
            self._check_int_range("block_size", 1, sublayers, allowed)
        elif self.block_size is not None:
            self._check_positive_int("block_size")
        heterogeneous = per_layer & {"num_attention_heads", "num_key_value_heads", "head_dim"}
        heads = None if heterogeneous else getattr(self, "num_attention_heads", None)
        if heads is not None:  # the Mamba families have no attention
            if getattr(self, "num_key_value_heads", None) is not None:  # GPT-2's heads are all query and key heads
                allowed = f"a positive divisor of num_attention_heads = {heads}"
                self._check_int_range("num_key_value_heads", 1, heads, allowed)
                if heads % self.num_key_value_heads:
                    self._fail("num_key_value_heads", allowed)
            if getattr(self, "head_dim", None) is None:  # the family's modules take hidden_size / num_attention_heads
                if self.hidden_size % (2 * heads):
                    allowed = (
                        f"a multiple of 2 * num_attention_heads = {2 * heads} (head_dim = hidden_size / "
                        "num_attention_heads must be even: rotary embeddings rotate pairs of channels), or set head_dim"
                    )
                    self._fail("hidden_size", allowed)
            elif not _is_int(self.head_dim) or self.head_dim < 2 or self.head_dim % 2:
                self._fail("head_dim", "a positive even integer (rotary embeddings rotate pairs of channels)")
        # Fields of a sub-config (DBRX's `ffn_config`) once the family's config has built it from what was given.
        if family.moe and ("." not in family.moe.experts or vars(self).get(_FAMILY_BUILT)):
            experts = family.moe.experts
            self._check_positive_int(experts)
            allowed = f"an integer from 1 to {experts} = {self._value(experts)}"
            self._check_int_range(family.moe.top_k, 1, self._value(experts), allowed)
        # A window that the family's config derives (ModernBERT decoder's, from `local_attention`) is checked derived.
        windowed = "sliding_attention" in layer_types(self)
        if windowed and ("sliding_window" in vars(self) or vars(self).get(_FAMILY_BUILT)):
            self._check_int_range("sliding_window", 1, math.inf, "a positive integer: layer_types has windowed layers")
        if self.depth_ablation is not None and (
            self.depth_ablation not in DEPTH_ABLATIONS or self.residual_mode not in ("full", "block")
        ):
            allowed = " | ".join(repr(a) for a in DEPTH_ABLATIONS)
            self._fail("depth_ablation", f"None, or with residual_mode 'full' or 'block' one of {allowed}")
        if not _is_int(self.depth_heads) or self.depth_heads < 1 or self.hidden_size % self.depth_heads:
            self._fail("depth_heads", f"a positive divisor of hidden_size = {self.hidden_size}")
        self._check_int_range("hc_streams", 2, math.inf, "an integer >= 2 (one stream is the plain residual)")


# The fields of Llama's and Mixtral's configs, with their defaults, that every config held, whatever its family, before
# each was its family's: a family without one drops it at this default (`_without_other_families_fields`).
_SUPERSET_DEFAULTS = {
    "attention_bias": False,
    "mlp_bias": False,
    "qkv_bias": False,
    "sliding_window": None,
    "num_local_experts": 0,
    "num_experts": 0,  # the old class's alias of `num_local_experts`
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.001,
    "output_router_logits": False,
    "router_jitter_noise": 0.0,
}


def _legacy_reading(kwargs: dict) -> tuple[str, dict]:
    """The family of a config saved before configs named one, and its arguments as that family reads them: the
    Llama-superset fields it set decide (Mixtral for experts, Qwen2 for `qkv_bias`, Mistral for a window)."""
    if (kwargs.get("num_local_experts") or kwargs.get("num_experts") or 0) > 0:
        family = "mixtral"
    elif kwargs.get("qkv_bias"):
        family = "qwen2"
        kwargs = {name: value for name, value in kwargs.items() if name != "qkv_bias"}  # Qwen2's attention has it
        if kwargs.get("sliding_window") is not None:  # the window was on in every layer
            kwargs = {"use_sliding_window": True, "max_window_layers": 0, **kwargs}
    else:
        family = "mistral" if kwargs.get("sliding_window") is not None else "llama"
    if kwargs.get("rope_parameters") is None and not {"rope_theta", "rope_scaling"} & kwargs.keys():
        # Llama's, not Mixtral's
        kwargs = {**kwargs, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    return family, kwargs


def _declared_fields(config_class: type[PreTrainedConfig]) -> set[str]:
    """The fields a config class declares beside `PreTrainedConfig`'s, and both names of its aliases (Qwen3-MoE holds
    its `num_experts` field as `num_local_experts`)."""
    aliases = config_class.attribute_map
    fields = {field.name for field in dataclasses.fields(config_class)} - _SHARED_FIELDS
    return fields | set(aliases) | set(aliases.values())


def _derived_attributes(config_class: type[PreTrainedConfig]) -> set[str]:
    """The attributes a config class's `__post_init__` sets beside its fields, deriving them from its fields
    (ModernBERT decoder's `sliding_window`, half its `local_attention`): its saved configs hold them, and it derives
    them again, whatever is given, when it reads one."""
    return set(vars(config_class())) - {field.name for field in dataclasses.fields(config_class)}


def _field_defaults(config_class: type[PreTrainedConfig]) -> dict:
    """The defaults of the fields a config class declares beside `PreTrainedConfig`'s."""
    return {
        field.name: field.default if field.default is not dataclasses.MISSING else field.default_factory()
        for field in dataclasses.fields(config_class)
        if field.name not in _SHARED_FIELDS
    }


def _class_settings(config_class: type[PreTrainedConfig]) -> dict:
    """The settings a config class holds as plain class attributes rather than fields (Emu3's text config:
    `attention_bias = False`, `mlp_bias = False`): the family's modules read them from the config, and its
    serialisation leaves them out. Those that `AttnResConfig` has itself (`model_type`, the plans) are its own."""
    fields = {field.name for field in dataclasses.fields(config_class)}
    settings = {}
    for klass in config_class.__mro__:
        if not issubclass(klass, PreTrainedConfig) or klass is PreTrainedConfig:
            continue
        for name, value in vars(klass).items():
            own = name.startswith("_") or name in fields or hasattr(AttnResConfig, name)
            if not own and isinstance(value, (bool, int, float, str)):
                settings.setdefault(name, value)
    return settings


# Fields every config has, which no family defines differently.
_SHARED_FIELDS = frozenset(field.name for field in dataclasses.fields(PreTrainedConfig))
# Set once the family's config has derived its fields, from which its properties are then computed.
_FAMILY_BUILT = "_family_fields_derived"


# Each family config class's properties (`_properties`), by class.
_PROPERTIES: dict[type[PreTrainedConfig], dict[str, property]] = {}


def _properties(config_class: type[PreTrainedConfig]) -> dict[str, property]:
    """The properties a family's config class defines beside `PreTrainedConfig`'s (Mamba's `layer_types`). Kept in
    a plain dict, not a `functools.cache`: a compiled forward that reads a config attribute the config lacks calls
    `__getattr__` and so this, and torch.compile reads a dict where it would trace the cached function into the class
    dictionaries, which it refuses (a graph break, fatal under `fullgraph=True`)."""
    if config_class not in _PROPERTIES:
        found = {}
        for klass in config_class.__mro__:
            if issubclass(klass, PreTrainedConfig) and klass is not PreTrainedConfig:
                for name, value in vars(klass).items():
                    if isinstance(value, property):
                        found.setdefault(name, value)
        _PROPERTIES[config_class] = found
    return _PROPERTIES[config_class]


def _is_int(value: object) -> bool:
    """An int that is not a bool: Python counts `True` as the int 1, never a size."""
    return isinstance(value, int) and not isinstance(value, bool)


AttnResConfig.register_for_auto_class()

__all__ = ["AttnResConfig"]
