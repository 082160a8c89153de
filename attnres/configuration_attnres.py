"""Configuration of AttnRes models: a Transformers decoder family (Llama by default) whose residual connections can
be replaced by softmax attention over depth (Kimi Team, "Attention Residuals", arXiv:2603.15031)."""

import dataclasses
import math

from transformers.activations import ACT2FN
from transformers.configuration_utils import PreTrainedConfig
from transformers.modeling_rope_utils import RopeParameters

from .families import FAMILIES, layer_types, legacy_family
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
TARGET_NUM_BLOCKS = 8  # the paper recommends about 8 blocks for Block AttnRes


def layers_per_block(num_hidden_layers: int) -> int:
    """The default block's size in decoder layers: the one whose number of blocks is nearest `TARGET_NUM_BLOCKS`,
    the larger on a tie (fewer blocks cost less). Whole layers, so that no block splits an attention from its MLP:
    such a checkpoint would have no FLA or Kimi equivalent."""
    return min(
        range(1, num_hidden_layers + 1),
        key=lambda n: (abs(math.ceil(num_hidden_layers / n) - TARGET_NUM_BLOCKS), -n),
    )


class AttnResConfig(PreTrainedConfig):
    r"""
    Configuration for [`AttnResModel`] and [`AttnResForCausalLM`]: a decoder family's own configuration plus the
    residual fields below.

    `family` names the Transformers decoder family whose modules the model is built from (`families.py`: `"llama"`,
    `"qwen3"`, `"gemma3_text"`, `"olmo2"`, `"phi3"`, `"granite"`, ...). Every field of that family's config is a field
    of this one, with its name, meaning and default derivation (Gemma 3's `layer_types`, Qwen2's window), so the
    family's modules read this config as their own and Transformers' caches and masks see the family's layout. The
    fields listed in the class are Llama's and Mixtral's, the default family: a dense model, or Mixtral's MoE when
    `num_local_experts > 0`. A config saved without `family` is read as the family its fields imply (Mixtral for
    experts, Qwen2 for `qkv_bias`, Mistral for a window, else Llama).

    `qkv_bias=True` (of configs saved before `family`) means Qwen2: a bias on the query, key and value projections
    only, where `attention_bias=True` puts one on all four attention projections (Llama's).

    Residual fields:
        residual_mode (`str`, defaults to `"block"`):
            `"standard"`: the family's own residual stream, bit-compatible with its `*ForCausalLM`.
            `"full"`: Full AttnRes, every sublayer attends over the embedding and every earlier sublayer output.
            `"block"`: Block AttnRes, sublayers are grouped into blocks of `block_size`; a sublayer attends over the
            completed block sums and the running sum of its own block.
        block_size (`int`, *optional*):
            Block size S in *sublayers* (an attention and an MLP are two sublayers, so a model with
            `num_hidden_layers` decoder layers has `2 * num_hidden_layers` sublayers). Defaults to blocks of whole
            decoder layers, as FLA, Kimi's released model and vLLM count them, as many layers per block as brings the
            number of blocks nearest 8, the paper's recommendation (ties: fewer blocks).
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
    attribute_map = {"num_experts": "num_local_experts"}

    # Pipeline stages split only at the embedding and the final norm: the decoder layers pass on the whole depth
    # state, not one `hidden_states` tensor.
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    # Llama fields
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_bias: bool = False
    qkv_bias: bool = False
    attention_dropout: float = 0.0
    mlp_bias: bool = False
    sliding_window: int | None = None
    # Mixtral fields (num_local_experts = 0 gives a dense MLP)
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    router_jitter_noise: float = 0.0
    # AttnRes fields
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
        # The defaults below are derived from these, so they are checked first.
        for field in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
            self._check_positive_int(field)
        self._check_int_range("num_local_experts", 0, math.inf, "0 (a dense MLP) or a positive number of experts")
        if self.family is None:  # saved before configs named their family: read as the Llama superset it was
            self.family = legacy_family(self)
            if self.family == "qwen2" and self.sliding_window is not None:  # the window was on in every layer
                kwargs = {"use_sliding_window": True, "max_window_layers": 0, **kwargs}
            if self.rope_parameters is None and not {"rope_theta", "rope_scaling"} & kwargs.keys():
                self.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}  # Llama's, not Mixtral's
        if self.head_dim is None:
            if self.hidden_size % (2 * self.num_attention_heads):
                self._fail(
                    "hidden_size",
                    f"a multiple of 2 * num_attention_heads = {2 * self.num_attention_heads} (head_dim = hidden_size / "
                    "num_attention_heads must be even: rotary embeddings rotate pairs of channels), or set head_dim",
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.block_size is None:
            self.block_size = 2 * layers_per_block(self.num_hidden_layers)
        self._check_own_fields()  # before the family's config, whose checks would not name this config's field
        kwargs = self._adopt_family_fields(kwargs)
        # An attribute, not a property: Transformers < 5.20 extends it for tied embeddings.
        self.base_model_tp_plan = dict(FAMILIES[self.family].tp_plan)
        super().__post_init__(**kwargs)
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}
        self._check_family_fields()

    def _adopt_family_fields(self, kwargs: dict) -> dict:
        """Build the family's own config from this one's values and the family's fields among `kwargs`, and take every
        field the family declares from it: what the family derives (Gemma 3's `layer_types` and per-type RoPE,
        Qwen2's window off unless `use_sliding_window`) is derived as the family does. Returns the other kwargs."""
        family_class = FAMILIES[self.family].config_class
        names = [name for name in _declared_fields(family_class) if name not in _GENERIC_FIELDS]
        given = {name: getattr(self, name) for name in names if name not in kwargs and hasattr(self, name)}
        source = family_class(**given, **{key: value for key, value in kwargs.items() if key not in _GENERIC_FIELDS})
        for name in names:
            setattr(self, name, getattr(source, name))
        return {key: value for key, value in kwargs.items() if key not in names}

    def to_diff_dict(self) -> dict:
        """What `save_pretrained` writes: the fields that differ from a default config, and every field the family
        declares, whose defaults differ from family to family (Mixtral's RoPE base is not Llama's), so that a reload
        never falls back on another family's default."""
        family_fields = set(_declared_fields(FAMILIES[self.family].config_class)) - _GENERIC_FIELDS
        everything = self.to_dict()
        return {**super().to_diff_dict(), **{name: everything[name] for name in family_fields if name in everything}}

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Transformers sets the keyword overrides of `from_pretrained` after `__init__`, so they are checked here."""
        loaded = super().from_dict(config_dict, **kwargs)
        (loaded[0] if isinstance(loaded, tuple) else loaded)._check_fields()
        return loaded

    def validate(self) -> None:
        """Transformers' checks, then AttnRes's; `save_pretrained` runs it, so a field set to a bad value after
        `__init__` is never saved."""
        super().validate()
        self._check_fields()

    @property
    def num_sublayers(self) -> int:
        """L: every attention and every MLP is its own sublayer."""
        return 2 * self.num_hidden_layers

    @property
    def depth_block_size(self) -> int:
        """The block size the depth mixing actually uses: 1 for Full AttnRes, `block_size` for Block AttnRes."""
        return 1 if self.residual_mode == "full" else self.block_size

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    @property
    def base_model_ep_plan(self) -> dict[str, str] | None:
        """The MoE family's expert-parallel plan; a dense config has no experts to place."""
        return FAMILIES[self.family].ep_plan if self.is_moe else None

    def _fail(self, field: str, allowed: str) -> None:
        raise ValueError(f"AttnResConfig.{field}={getattr(self, field)!r}: must be {allowed}")

    def _check_positive_int(self, field: str) -> None:
        if not _is_int(getattr(self, field)) or getattr(self, field) < 1:
            self._fail(field, "a positive integer")

    def _check_int_range(self, field: str, low: int, high: float, allowed: str) -> None:
        if not _is_int(getattr(self, field)) or not low <= getattr(self, field) <= high:
            self._fail(field, allowed)

    def _check_number(self, field: str, low: float, high: float = math.inf) -> None:
        value = getattr(self, field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
            self._fail(field, f"a number >= {low}" if high == math.inf else f"a probability in [{low}, {high}]")

    def _check_fields(self) -> None:
        """Every field with a domain; a bad one raises a one-line `ValueError` naming it, its value and what is
        allowed."""
        self._check_own_fields()
        self._check_family_fields()

    def _check_own_fields(self) -> None:
        if self.family not in FAMILIES:
            self._fail("family", "one of " + ", ".join(repr(name) for name in FAMILIES))
        for field in _BOOL_FIELDS:
            if not isinstance(getattr(self, field), bool):
                self._fail(field, "a bool (True or False)")
        for field in _POSITIVE_INT_FIELDS:
            self._check_positive_int(field)
        for field in ("initializer_range", "rms_norm_eps", "router_aux_loss_coef", "router_jitter_noise"):
            self._check_number(field, 0)
        self._check_number("attention_dropout", 0, 1)
        if self.residual_mode not in RESIDUAL_MODES + COMPARISON_MODES:
            self._fail("residual_mode", "one of " + " | ".join(repr(m) for m in RESIDUAL_MODES + COMPARISON_MODES))
        if self.depth_kernel not in ("auto", "reference"):
            self._fail("depth_kernel", "'auto' | 'reference'")
        if not isinstance(self.hidden_act, str) or self.hidden_act not in ACT2FN:
            self._fail("hidden_act", "the name of a Transformers activation, e.g. 'silu' or 'gelu'")
        sublayers = self.num_sublayers
        self._check_int_range("block_size", 1, sublayers, f"an integer from 1 to 2 * num_hidden_layers = {sublayers}")
        heads = self.num_attention_heads
        self._check_int_range("num_key_value_heads", 1, heads, f"a positive divisor of num_attention_heads = {heads}")
        if heads % self.num_key_value_heads:
            self._fail("num_key_value_heads", f"a positive divisor of num_attention_heads = {heads}")
        if not _is_int(self.head_dim) or self.head_dim < 2 or self.head_dim % 2:
            self._fail("head_dim", "a positive even integer (rotary embeddings rotate pairs of channels)")
        self._check_int_range("num_local_experts", 0, math.inf, "0 (a dense MLP) or a positive number of experts")
        if self.is_moe:
            experts = self.num_local_experts
            allowed = f"an integer from 1 to num_local_experts = {experts}"
            self._check_int_range("num_experts_per_tok", 1, experts, allowed)
        if self.depth_ablation is not None and (
            self.depth_ablation not in DEPTH_ABLATIONS or self.residual_mode not in ("full", "block")
        ):
            allowed = " | ".join(repr(a) for a in DEPTH_ABLATIONS)
            self._fail("depth_ablation", f"None, or with residual_mode 'full' or 'block' one of {allowed}")
        if not _is_int(self.depth_heads) or self.depth_heads < 1 or self.hidden_size % self.depth_heads:
            self._fail("depth_heads", f"a positive divisor of hidden_size = {self.hidden_size}")
        self._check_int_range("hc_streams", 2, math.inf, "an integer >= 2 (one stream is the plain residual)")

    def _check_family_fields(self) -> None:
        """The Llama-superset fields this class declares must mean something in the family: a value other than the
        default is refused where the family's config has no such field (an MoE in a dense family, a bias or a window
        its attention does not have)."""
        if "sliding_attention" in layer_types(self):
            self._check_int_range("sliding_window", 1, math.inf, "a positive integer: layer_types has windowed layers")
        declared = set(_declared_fields(FAMILIES[self.family].config_class))
        for field, default in (("attention_bias", False), ("mlp_bias", False), ("sliding_window", None)):
            if getattr(self, field) != default and field not in declared:
                self._fail(field, f"{default!r}: family {self.family!r} has no such field")
        if self.is_moe and not FAMILIES[self.family].moe:
            self._fail("num_local_experts", f"0: family {self.family!r} has no experts")
        if self.qkv_bias and self.family != "qwen2" and "qkv_bias" not in declared:
            self._fail("qkv_bias", f"False: it means family 'qwen2', and family is {self.family!r}")


def _declared_fields(config_class: type) -> list[str]:
    """The fields a config class declares, and the names its `attribute_map` gives them."""
    return [field.name for field in dataclasses.fields(config_class)] + list(config_class.attribute_map)


# Fields every config has, which no family defines differently.
_GENERIC_FIELDS = frozenset(field.name for field in dataclasses.fields(PreTrainedConfig))


def _is_int(value: object) -> bool:
    """An int that is not a bool: Python counts `True` as the int 1, never a size."""
    return isinstance(value, int) and not isinstance(value, bool)


AttnResConfig.register_for_auto_class()

__all__ = ["AttnResConfig"]
