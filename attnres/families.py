"""The decoder families an AttnRes model is built from: one table, a row per Transformers family.

Depth attention changes only what each sublayer reads (docs/design.md §10). Everything inside a sublayer (attention
with its q/k norms, soft-capping and windows; the MLP or MoE; the norms before and after it; residual dropout) is the
family's own Transformers module, built by the family's own decoder-layer class, so weights keep the family's names
and the standard mode equals the family's `*ForCausalLM`. What differs between families is the data below: which
modules make each sublayer, the scalars the family's model applies around them, and how its attention types and
rotary embedding are laid out. Adding a family is a row here and a test (tests/test_families.py).

A family is named by its Transformers `model_type`; its classes are found by their names in
`transformers.models.<module>.modeling_<module>`: `<prefix>DecoderLayer`, `<prefix>RotaryEmbedding`,
`<prefix>RMSNorm`, `<prefix>PreTrainedModel` and, for conversions, `<prefix>ForCausalLM`.

This file is copied flat into remote-code checkpoints, so it imports only torch and transformers.
"""

import importlib
from dataclasses import dataclass

from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING


@dataclass(frozen=True)
class Sublayer:
    """One sublayer of a decoder layer (its attention, `self_attn`, or its MLP / MoE, `mlp`, in every family), by the
    names of the family's decoder-layer modules around it.

    pre_norm: the norm its input goes through; `None` where it reads the residual stream itself (OLMo 2).
    post: the modules its output goes through, in order, before it joins the residual stream: a post-norm (Gemma 2,
        OLMo 2), a residual dropout (Phi-3). They sit inside the branch, so the stream stays a plain sum of the
        branches' outputs and the exact retrofit holds (docs/design.md §5).
    """

    pre_norm: str | None
    post: tuple[str, ...] = ()


PRE_NORM = (Sublayer("input_layernorm"), Sublayer("post_attention_layernorm"))
SANDWICH_NORM = (
    Sublayer("input_layernorm", ("post_attention_layernorm",)),
    Sublayer("pre_feedforward_layernorm", ("post_feedforward_layernorm",)),
)
POST_BRANCH_NORM = (Sublayer(None, ("post_attention_layernorm",)), Sublayer(None, ("post_feedforward_layernorm",)))
RESIDUAL_DROPOUT = (
    Sublayer("input_layernorm", ("resid_attn_dropout",)),
    Sublayer("post_attention_layernorm", ("resid_mlp_dropout",)),
)

# Experts sharded the way `MixtralExperts` and its copies hold them, for the MoE families whose own plan leaves them
# whole.
MOE_TP_PLAN = {
    "layers.*.mlp.experts.gate_up_proj": "packed_colwise",
    "layers.*.mlp.experts.down_proj": "rowwise",
    "layers.*.mlp.experts": "moe_tp_experts",
}


@dataclass(frozen=True)
class Family:
    """A Transformers decoder family whose residual stream is a plain sum of its sublayers' outputs.

    model_type, module, prefix: the family's `model_type`, the folder of its code under `transformers.models` and
        the prefix of its class names.
    sublayers: the attention sublayer and the MLP sublayer (`Sublayer`), in that order.
    llama_norm: the family's RMSNorm computes Llama's function (`LlamaRMSNorm`, which Transformers copies into each
        such family). The model then holds `AttnResRMSNorm` in its place, which computes a depth step's last phase
        fused with the normalisation (docs/design.md §6); other norms (Gemma's `1 + w`, OLMo 2's gain in fp32) are
        the family's own, and read the step's result computed.
    scaled_embedding: the family's embedding module multiplies by sqrt(hidden_size) (`<prefix>TextScaledWordEmbedding`).
    embedding_multiplier, residual_multiplier, logits_divisor, logit_softcap: the config fields of the scalars the
        family's model applies to the embedding, to each sublayer's output, and to the logits (divided by, or
        soft-capped at, the value), or `None`.
    rotary_per_layer_type: the rotary embedding takes a layer type (Gemma 3, OLMo 3: bases per attention type).
    moe: some layers hold a sparse MoE (`mlp.gate` the router): router logits and the load-balancing loss of the
        family's `load_balancing_loss_func`.
    """

    model_type: str
    module: str
    prefix: str
    sublayers: tuple[Sublayer, Sublayer] = PRE_NORM
    llama_norm: bool = True
    scaled_embedding: bool = False
    embedding_multiplier: str | None = None
    residual_multiplier: str | None = None
    logits_divisor: str | None = None
    logit_softcap: str | None = None
    rotary_per_layer_type: bool = False
    moe: bool = False

    # A plain property (the import is a lookup in `sys.modules` after the first): vLLM's server pickles the config's
    # remote-code classes by value, and Python 3.11's `functools.cached_property` holds a lock, which does not pickle.
    @property
    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")

    def cls(self, suffix: str) -> type:
        """The family's class `<prefix><suffix>`, e.g. `cls("DecoderLayer")`."""
        return getattr(self.modeling, self.prefix + suffix)

    @property
    def config_class(self) -> type:
        return CONFIG_MAPPING[self.model_type]

    @property
    def architecture(self) -> str:
        return self.prefix + "ForCausalLM"

    @property
    def tp_plan(self) -> dict[str, str]:
        """The family's own tensor-parallel plan, with the experts sharded for an MoE family. The depth-mixing modules
        stay replicated: they read the full hidden states that `o_proj` and `down_proj` all-reduce."""
        return {**(self.config_class.base_model_tp_plan or {}), **(MOE_TP_PLAN if self.moe else {})}

    @property
    def ep_plan(self) -> dict[str, str] | None:
        return getattr(self.config_class, "base_model_ep_plan", None) if self.moe else None

    def embedding(self, config) -> nn.Embedding:
        if self.scaled_embedding:
            scaled = self.cls("TextScaledWordEmbedding")
            scale = config.hidden_size**0.5
            return scaled(config.vocab_size, config.hidden_size, config.pad_token_id, embed_scale=scale)
        return nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)


GEMMA = dict(llama_norm=False, scaled_embedding=True)
FAMILIES = {
    family.model_type: family
    for family in (
        Family("llama", "llama", "Llama"),
        Family("mistral", "mistral", "Mistral"),
        Family("mixtral", "mixtral", "Mixtral", moe=True),
        Family("qwen2", "qwen2", "Qwen2"),
        Family("qwen2_moe", "qwen2_moe", "Qwen2Moe", moe=True),
        Family("qwen3", "qwen3", "Qwen3"),
        Family("qwen3_moe", "qwen3_moe", "Qwen3Moe", moe=True),
        Family("smollm3", "smollm3", "SmolLM3"),
        Family("phi3", "phi3", "Phi3", RESIDUAL_DROPOUT),
        Family(
            "granite",
            "granite",
            "Granite",
            embedding_multiplier="embedding_multiplier",
            residual_multiplier="residual_multiplier",
            logits_divisor="logits_scaling",
        ),
        Family("gemma", "gemma", "Gemma", **GEMMA),
        Family("gemma2", "gemma2", "Gemma2", SANDWICH_NORM, logit_softcap="final_logit_softcapping", **GEMMA),
        Family(
            "gemma3_text",
            "gemma3",
            "Gemma3",
            SANDWICH_NORM,
            logit_softcap="final_logit_softcapping",
            rotary_per_layer_type=True,
            **GEMMA,
        ),
        Family("olmo2", "olmo2", "Olmo2", POST_BRANCH_NORM, llama_norm=False),
        Family("olmo3", "olmo3", "Olmo3", POST_BRANCH_NORM, llama_norm=False, rotary_per_layer_type=True),
    )
}


def layer_types(config) -> list[str]:
    """Each decoder layer's attention type, as the family's model picks its mask: the config's `layer_types` where the
    family has them, else every layer windowed when the config sets a window (Mistral, Mixtral, Phi-3), else none."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * config.num_hidden_layers
