"""The decoder families an AttnRes model is built from: one table, a row per Transformers family.

Depth attention changes only what each sublayer reads (docs/design.md §10). Everything inside a sublayer (attention
with its q/k norms, soft-capping and windows; the MLP or MoE; the norms before and after it; residual dropout) is the
family's own Transformers module, built by the family's own decoder-layer class, so weights keep the family's names
and the standard mode equals the family's `*ForCausalLM`. What differs between families is the data below: which
modules make each sublayer, the scalars the family's model applies around them, and how its attention types and
rotary embedding are laid out. Adding a family is a row here and a test (tests/test_families.py).

A family is named by its Transformers `model_type`; its classes are found by their names in
`transformers.models.<module>.modeling_<module>`: `<prefix>DecoderLayer`, `<prefix>RotaryEmbedding`,
`<prefix>RMSNorm` (or the norm the row names), `<prefix>PreTrainedModel` and, for conversions, `<prefix>ForCausalLM`. A
family whose model is another's (InternLM3 runs Llama's) names that family's module and prefix.

This file is copied flat into remote-code checkpoints, so it imports only torch and transformers.
"""

import copy
import importlib
from dataclasses import dataclass

import torch
from torch import nn
import transformers
from packaging import version
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES


# How a decoder layer calls a sublayer's module, as the family's own decoder layer does (docs/design.md §10).
ATTENTION = "attention"  # hidden_states, position embeddings, mask, position ids and the cache; returns (output, weights)
# a linear attention (Gated DeltaNet, KDA) or a short convolution (LFM2): hidden_states, the cache and a 2D padding mask
RECURRENT = "recurrent"
FEED_FORWARD = "feed_forward"  # an MLP or MoE: hidden_states alone


@dataclass(frozen=True)
class Sublayer:
    """One sublayer of a decoder layer, by the names of the family's decoder-layer modules that make it.

    module: the module that computes the branch: the attention (`self_attn`), a linear attention (`linear_attn`), a
        short convolution (`conv`), the MLP or MoE (`mlp`).
    pre_norm: the norm its input goes through; `None` where it reads the residual stream itself (OLMo 2).
    post: the modules its output goes through, in order, before it joins the residual stream: a post-norm (Gemma 2,
        OLMo 2), a residual dropout (Phi-3), the rest of an MLP that the decoder layer computes from its own modules
        (OPT's activation and `fc2`, after `fc1`). They sit inside the branch, so the stream stays a plain sum of the
        branches' outputs and the exact retrofit holds (docs/design.md §5).
    call: how the family's decoder layer calls `module`: `ATTENTION`, `RECURRENT` or `FEED_FORWARD`.
    cache_argument: the keyword `module` takes the cache by where it is not Transformers' own (`cache`): GPT-Neo's
        and GPT-BigCode's attentions take it as `layer_past`; `None` for Transformers' own.
    summed: modules called the same way on the same input whose outputs the family's layer adds to `module`'s, in
        order, as one branch (Granite 4's and Granite MoE Shared's shared MLP beside the MoE). A module the family's
        layer leaves out for the config (Granite 4's MoE without experts) is skipped, as the layer skips it.
    """

    module: str
    pre_norm: str | None
    post: tuple[str, ...] = ()
    call: str = ATTENTION
    cache_argument: str | None = None
    summed: tuple[str, ...] = ()


PRE_NORM = (
    Sublayer("self_attn", "input_layernorm"),
    Sublayer("mlp", "post_attention_layernorm", call=FEED_FORWARD),
)
SANDWICH_NORM = (
    Sublayer("self_attn", "input_layernorm", ("post_attention_layernorm",)),
    Sublayer("mlp", "pre_feedforward_layernorm", ("post_feedforward_layernorm",), call=FEED_FORWARD),
)
POST_BRANCH_NORM = (
    Sublayer("self_attn", None, ("post_attention_layernorm",)),
    Sublayer("mlp", None, ("post_feedforward_layernorm",), call=FEED_FORWARD),
)
RESIDUAL_DROPOUT = (
    Sublayer("self_attn", "input_layernorm", ("resid_attn_dropout",)),
    Sublayer("mlp", "post_attention_layernorm", ("resid_mlp_dropout",), call=FEED_FORWARD),
)
GLM4_NORMS = (
    Sublayer("self_attn", "input_layernorm", ("post_self_attn_layernorm",)),
    Sublayer("mlp", "post_attention_layernorm", ("post_mlp_layernorm",), call=FEED_FORWARD),
)
APERTUS_NORMS = (
    Sublayer("self_attn", "attention_layernorm"),
    Sublayer("mlp", "feedforward_layernorm", call=FEED_FORWARD),
)
STABLELM_DROPOUT = (
    Sublayer("self_attn", "input_layernorm"),
    Sublayer("mlp", "post_attention_layernorm", ("dropout",), call=FEED_FORWARD),
)
# One residual dropout after each sublayer, the same module for both (Emu3's text decoder).
SHARED_RESIDUAL_DROPOUT = (
    Sublayer("self_attn", "input_layernorm", ("dropout",)),
    Sublayer("mlp", "post_attention_layernorm", ("dropout",), call=FEED_FORWARD),
)
# Granite MoE Shared's and Granite 4's MLP branch: the experts and, beside them on the same input, a dense shared MLP.
GRANITE_SHARED_MOE = Sublayer("block_sparse_moe", "post_attention_layernorm", call=FEED_FORWARD, summed=("shared_mlp",))
# AFMoE's norms before and after each branch, under names of its own.
AFMOE_NORMS = (
    Sublayer("self_attn", "input_layernorm", ("post_attention_layernorm",)),
    Sublayer("mlp", "pre_mlp_layernorm", ("post_mlp_layernorm",), call=FEED_FORWARD),
)
# HyperCLOVA X's optional norms after each branch (`use_post_norm`; identities otherwise).
HYPERCLOVAX_NORMS = (
    Sublayer("self_attn", "input_layernorm", ("post_norm1",)),
    Sublayer("mlp", "post_attention_layernorm", ("post_norm2",), call=FEED_FORWARD),
)
# Gated DeltaNet layers between attention layers, each followed by the MLP or MoE (Qwen3-Next, Qwen3.5).
GATED_DELTANET = {
    "full_attention": PRE_NORM,
    "linear_attention": (Sublayer("linear_attn", "input_layernorm", call=RECURRENT), PRE_NORM[1]),
}
# Gated short convolutions between attention layers, each followed by the MLP or MoE (LFM2, LFM2-MoE); LFM3's
# attention is windowed or full, and its sandwich norms (`use_sandwich_norm`; `nn.Identity` without) sit inside the
# branches.
LFM2_FEED_FORWARD = Sublayer("feed_forward", "ffn_norm", call=FEED_FORWARD)
# Transformers 5.16 renames the `conv` layers of a config that is not its own (this one) `linear_attention`.
LFM2_CONVOLUTION = (Sublayer("conv", "operator_norm", call=RECURRENT), LFM2_FEED_FORWARD)
SHORT_CONVOLUTION = {
    "full_attention": (Sublayer("self_attn", "operator_norm"), LFM2_FEED_FORWARD),
    "conv": LFM2_CONVOLUTION,
    "linear_attention": LFM2_CONVOLUTION,
}
LFM3_FEED_FORWARD = Sublayer("feed_forward", "ffn_norm", ("post_ffn_norm",), call=FEED_FORWARD)
LFM3_ATTENTION = (Sublayer("self_attn", "operator_norm", ("post_operator_norm",)), LFM3_FEED_FORWARD)
SANDWICHED_SHORT_CONVOLUTION = {
    "full_attention": LFM3_ATTENTION,
    "sliding_attention": LFM3_ATTENTION,
    "conv": (Sublayer("conv", "operator_norm", ("post_operator_norm",), call=RECURRENT), LFM3_FEED_FORWARD),
}
# Mamba 2 layers between attention layers, each followed by the MoE and the shared MLP beside it (Granite 4).
GRANITE4_MAMBA = {
    "full_attention": (Sublayer("self_attn", "input_layernorm"), GRANITE_SHARED_MOE),
    "linear_attention": (Sublayer("mamba", "input_layernorm", call=RECURRENT), GRANITE_SHARED_MOE),
}
# Kimi Delta Attention between latent-attention layers, both built under `self_attn` (Kimi Linear).
KIMI_DELTA_ATTENTION = {
    "full_attention": PRE_NORM,
    "linear_attention": (Sublayer("self_attn", "input_layernorm", call=RECURRENT), PRE_NORM[1]),
}

# The `norm` of the families whose norms are torch's `nn.LayerNorm`, with its bias (StableLM, StarCoder2).
LAYER_NORM = "LayerNorm"

# Experts sharded the way `MixtralExperts` and its copies hold them (`gate_up_proj` [experts, 2 * intermediate, hidden],
# gate then up), under a family's MoE module, for the families whose own plan leaves them whole.
EXPERTS_TP_PLAN = {
    "experts.gate_up_proj": "packed_colwise",
    "experts.down_proj": "rowwise",
    "experts": "moe_tp_experts",
}


@dataclass(frozen=True)
class Moe:
    """How a family's sparse MoE layers are found and trained, as the family's `*ForCausalLM` does it, so that its
    router logits, its load-balancing loss and its parallel plans are the family's.

    experts: the config field the family's `*ForCausalLM` reads its number of experts from (`num_local_experts`,
        Qwen2-MoE's and OLMoE's `num_experts`).
    top_k: the config field of the number of experts each token is routed to (Aria's `moe_topk`).
    router: the router's module under a decoder layer (`mlp.gate`; GPT-OSS's `mlp.router`); its output
        `logits_index` holds the router logits the model records.
    load_balancing_loss: the family's `*ForCausalLM` adds `router_aux_loss_coef` times its
        `load_balancing_loss_func(router_logits, experts, num_experts_per_tok, attention_mask)` to the loss.
        DeepSeek-V3, GLM-4.5, HunYuan and Llama 4 return the router logits without one (DeepSeek-V3 and GLM-4.5
        balance their experts with a routing bias).
    mixtral_experts: the experts hold Mixtral's layout (`EXPERTS_TP_PLAN`); GPT-OSS interleaves gate and up.
    """

    experts: str = "num_local_experts"
    top_k: str = "num_experts_per_tok"
    router: str = "mlp.gate"
    logits_index: int = 0
    load_balancing_loss: bool = True
    mixtral_experts: bool = True

    @property
    def module(self) -> str:
        """The MoE module under a decoder layer, which holds the router and the experts."""
        return self.router.rpartition(".")[0]

    def router_of(self, layer: nn.Module) -> nn.Module | None:
        """The decoder layer's router, or `None` in a dense layer (DeepSeek-V3's first layers, Qwen's
        `mlp_only_layers`), whose MLP has no such module."""
        try:
            return layer.get_submodule(self.router)
        except AttributeError:
            return None


MOE = Moe()


@dataclass(frozen=True)
class ModelParts:
    """The modules of a family's model around its decoder layers, where they are not Llama's (a token embedding, a
    rotary embedding, a final norm of the family's class): GPT-2's learned positions added to the token embeddings,
    OPT's offset ones, OPT's final LayerNorm without an eps field. The family's own model class, built without
    decoder layers, builds them, so they are the family's construction; the AttnRes model holds them under its own
    names (`embed_tokens`, `embed_positions`, `norm`), to which `Family.checkpoint_renamings` renames the family's.

    model: the suffix of the family's class that holds them (`GPT2Model`; OPT's `OPTDecoder`).
    tokens, positions, norm: their names in that class: the token embedding (`wte`), the position embedding whose
        output the family's model adds to the token embeddings (`wpe`), or `None`, and the final norm (`ln_f`).
    positions_from_mask: where no position ids are given, the family's model counts the positions over the attention
        mask, `cumsum(mask) - 1` and -1 at padding (OPT), instead of counting every token from the cache's length.
    positions_after_mask: the position embedding is called as `positions(attention_mask, position_ids=ids)`, which
        reads the ids where they are given (OPT's learned embedding), instead of `positions(ids)`.
    """

    model: str = "Model"
    tokens: str = "wte"
    positions: str | None = "wpe"
    norm: str = "ln_f"
    positions_from_mask: bool = False
    positions_after_mask: bool = False

    def position_embeddings(self, embed_positions: nn.Module, position_ids: torch.LongTensor) -> torch.Tensor:
        """The vectors `embed_positions` adds at `position_ids`, called as the family's model calls it."""
        if self.positions_after_mask:
            return embed_positions(None, position_ids=position_ids)
        return embed_positions(position_ids)


# The token embedding and the final norm of the family's own model, where the AttnRes model cannot build them itself:
# OLMo's and NanoChat's norms hold no weights (OLMo's no eps field either), MiniCPM3's embedding is scaled by
# `scale_emb`.
OWN_EMBEDDING_AND_NORM = ModelParts(tokens="embed_tokens", positions=None, norm="norm")
# The modules of GPT-2's model and of its descendants (GPT-Neo, GPT-BigCode), under `transformer`.
GPT2_PARTS = ModelParts()
GPT2_SUBLAYERS = (Sublayer("attn", "ln_1"), Sublayer("mlp", "ln_2", call=FEED_FORWARD))
LAYER_PAST_SUBLAYERS = (Sublayer("attn", "ln_1", cache_argument="layer_past"), GPT2_SUBLAYERS[1])
GPT2_RENAMINGS = (
    (r"^(transformer\.)?wte\.", "model.embed_tokens."),
    (r"^(transformer\.)?wpe\.", "model.embed_positions."),
    (r"^(transformer\.)?h\.", "model.layers."),
    (r"^(transformer\.)?ln_f\.", "model.norm."),
)


TRANSFORMERS_RELEASE = version.parse(transformers.__version__).release
# LFM2's final norm is its model's `embedding_norm`, applied after the last layer (LFM2, LFM2-MoE, LFM3).
LFM2 = dict(norm_eps="norm_eps", checkpoint_renamings=((r"^model\.embedding_norm\.", "model.norm."),))


@dataclass(frozen=True)
class Family:
    """A Transformers decoder family whose residual stream is a plain sum of its sublayers' outputs.

    model_type, module, prefix: the family's `model_type`, the folder of its code under `transformers.models` and
        the prefix of its class names.
    model_prefix: the prefix of its `*PreTrainedModel` and `*ForCausalLM` where it differs from that of its decoder's
        modules (Llama 4's text decoder is `Llama4TextDecoderLayer`, its model `Llama4ForCausalLM`), or `None`.
    sublayers: the token-mixer sublayer and the MLP sublayer (`Sublayer`) of every decoder layer, in that order.
    layer_sublayers: for hybrid decoders, each layer's two sublayers by its type (the config's `layer_types`): the
        token mixer the family's decoder layer builds for that type (attention, a linear attention, a short
        convolution) and the MLP.
    norm, norm_eps: the family's norm, the class `<prefix><norm>` or torch's `nn.LayerNorm` (`LAYER_NORM`), and the
        config field of its eps, or `None` where the family's LayerNorms take torch's default (OPT). The model builds
        its final norm of that class (unless `parts` names the family's own); the depth steps' key norms take the eps
        too.
    llama_norm: the family's norm computes Llama's function (`LlamaRMSNorm`, which Transformers copies into each
        such family). The model then holds `AttnResRMSNorm` in its place, which computes a depth step's last phase
        fused with the normalisation (docs/design.md §6); other norms (Gemma's `1 + w`, OLMo 2's gain in fp32, a
        LayerNorm) are the family's own, and read the step's result computed.
    scaled_embedding: the family's embedding module multiplies by sqrt(hidden_size) (`<prefix>TextScaledWordEmbedding`).
    embedding_dropout: the config field of the dropout the family's model applies to the embedding in training
        (StarCoder2), or `None`.
    mup_embedding_scale: the config field that, when true, has the family's model multiply the embedding by
        sqrt(hidden_size) before the first layer (AFMoE's muP input scaling, `mup_enabled`), or `None`.
    embedding_norm: the family's model passes the embeddings through its final norm before the first layer
        (NanoChat, whose norms hold no weights, so that the first and last pipeline stages may both hold it).
    embedding_multiplier, residual_multiplier, logits_divisor, logits_multiplier, logit_softcap: the config fields of
        the scalars the family's model applies to the embedding, to each sublayer's output, and to the logits (divided
        by the value as Granite's, multiplied by it as HyperCLOVA X's, or soft-capped at it), or `None`.
    layer_residual_scale: the attribute of the family's decoder layer holding the scalar it multiplies each sublayer's
        output by, where the layer derives it from the config (MiniCPM3's `residual_scale`, scale_depth /
        sqrt(num_hidden_layers)), or `None`.
    head_input_divisor: the value of the family's config that its `*ForCausalLM` divides the hidden states by before
        its LM head (MiniCPM3's `logits_scaling`, a property of its config class: hidden_size / dim_model_base), or
        `None`.
    rotary_per_layer_type: the rotary embedding takes a layer type (Gemma 3, OLMo 3: bases per attention type).
    rotary_embedding: the suffix of the family's rotary-embedding class (Qwen3.5's text model has its own), or `None`
        where the family's model has none and its attention reads no position embeddings (GPT-2's learned positions are
        added to the embeddings; Kimi Linear's latent attention is NoPE).
    rope_switch: the config field that turns the family's rotary embedding on with the value `"rope"` (Granite 4's
        `position_embedding_type`), or `None` where the family's model always has it; off, its attention reads no
        position embeddings.
    moe: how the family's sparse MoE layers are found and trained (`Moe`), or `None` for a dense family.
    decoder_layer, causal_lm: the suffixes of the family's decoder-layer and causal-LM classes (GPT-2's `GPT2Block`
        and `GPT2LMHeadModel`).
    parts: the modules of the family's model around the layers that the AttnRes model takes from it (`ModelParts`),
        where they are not Llama's, or `None`.
    checkpoint_renamings: `(pattern, replacement)` regular expressions that rename the family's checkpoint names to
        the model's, in order, where its model holds the layers and the modules around them under other names than
        Llama's `model.layers`, `model.embed_tokens` and `model.norm` (GPT-2's `transformer.h`, `transformer.wte`,
        `transformer.ln_f`): the conversion applies them after Transformers' own renamings for the family.
    initializer_range: the config field of the standard deviation of the family's initialisation (OPT's `init_std`),
        which the comparison residuals initialise their parameters with too.
    output_vocab: the config field of the size of the family's LM head where it may be pruned below the vocabulary
        (Apertus 1.5 keeps the text-only prefix of the ids; the field's `None` keeps them all), or `None`.
    since: the first Transformers version the row holds for; with an older one the family has no row (AFMoE and Aria
        from 5.19: with 5.16 AFMoE's greedy generation differs from the family's own, and an Aria checkpoint saved
        there computes other logits in 5.19).
    """

    model_type: str
    module: str
    prefix: str
    sublayers: tuple[Sublayer, Sublayer] = PRE_NORM
    layer_sublayers: dict[str, tuple[Sublayer, Sublayer]] | None = None
    norm: str = "RMSNorm"
    norm_eps: str | None = "rms_norm_eps"
    llama_norm: bool = True
    scaled_embedding: bool = False
    embedding_dropout: str | None = None
    mup_embedding_scale: str | None = None
    embedding_norm: bool = False
    embedding_multiplier: str | None = None
    residual_multiplier: str | None = None
    logits_divisor: str | None = None
    logits_multiplier: str | None = None
    logit_softcap: str | None = None
    layer_residual_scale: str | None = None
    head_input_divisor: str | None = None
    rotary_per_layer_type: bool = False
    rotary_embedding: str | None = "RotaryEmbedding"
    rope_switch: str | None = None
    moe: Moe | None = None
    model_prefix: str | None = None
    decoder_layer: str = "DecoderLayer"
    causal_lm: str = "ForCausalLM"
    parts: ModelParts | None = None
    checkpoint_renamings: tuple[tuple[str, str], ...] = ()
    initializer_range: str = "initializer_range"
    output_vocab: str | None = None
    since: tuple[int, int] = (5, 16)

    # A plain property (the import is a lookup in `sys.modules` after the first): vLLM's server pickles the config's
    # remote-code classes by value, and Python 3.11's `functools.cached_property` holds a lock, which does not pickle.
    @property
    def modeling(self):
        return importlib.import_module(f"transformers.models.{self.module}.modeling_{self.module}")

    def cls(self, suffix: str) -> type:
        """The family's class `<prefix><suffix>`, e.g. `cls("DecoderLayer")`; `<model_prefix><suffix>` for its models
        (`cls("PreTrainedModel")`, `cls("ForCausalLM")`)."""
        if suffix in ("PreTrainedModel", "ForCausalLM") and self.model_prefix is not None:
            return getattr(self.modeling, self.model_prefix + suffix)
        return getattr(self.modeling, self.prefix + suffix)

    def config_value(self, config, name: str):
        """The family's config value `name` for `config`: a field, or a property of the family's config class
        (MiniCPM3's `logits_scaling`), which `config` does not have but holds the fields of."""
        attribute = getattr(self.config_class, name, None)
        return attribute.fget(config) if isinstance(attribute, property) else getattr(config, name)

    @property
    def norm_class(self) -> type[nn.Module]:
        """The class of the family's norms, built as `norm_class(hidden_size, eps=eps)`."""
        return nn.LayerNorm if self.norm == LAYER_NORM else self.cls(self.norm)

    @property
    def config_class(self) -> type:
        """Transformers' own config class of the family, by its name: a package imported on the way may have
        registered another under the family's model type (FLA registers a `bitnet` of its own with `AutoConfig`)."""
        return getattr(transformers, CONFIG_MAPPING_NAMES[self.model_type])

    @property
    def architecture(self) -> str:
        return (self.model_prefix or self.prefix) + self.causal_lm

    @property
    def causal_lm_class(self) -> type:
        """The family's own causal LM, `architecture` (`GPT2LMHeadModel` for GPT-2)."""
        return getattr(self.modeling, self.architecture)

    @property
    def tp_plan(self) -> dict[str, str] | None:
        """The family's own tensor-parallel plan, with Mixtral-layout experts sharded where that plan leaves them whole;
        `None` where the family has none (GPT-2, OPT). The depth-mixing modules stay replicated: they read the full
        hidden states that `o_proj` and `down_proj` all-reduce."""
        plan = dict(self.config_class.base_model_tp_plan or {})
        if self.moe and self.moe.mixtral_experts and not any(".experts" in pattern for pattern in plan):
            prefix = f"layers.*.{self.moe.module}."
            plan.update({prefix + pattern: style for pattern, style in EXPERTS_TP_PLAN.items()})
        return plan or None

    @property
    def ep_plan(self) -> dict[str, str] | None:
        return getattr(self.config_class, "base_model_ep_plan", None) if self.moe else None

    def rotary_embedding_of(self, config) -> nn.Module | None:
        """The family's rotary embedding for `config`, or `None` where its model has none (`rotary_embedding`,
        `rope_switch`)."""
        if self.rotary_embedding is None or self.rope_switch and getattr(config, self.rope_switch) != "rope":
            return None
        return self.cls(self.rotary_embedding)(config)

    def sublayers_of(self, config, layer_idx: int) -> tuple[Sublayer, Sublayer]:
        """The token mixer and the MLP of decoder layer `layer_idx`."""
        if self.layer_sublayers is None:
            return self.sublayers
        return self.layer_sublayers[config.layer_types[layer_idx]]

    def load_balancing_loss(self, config, router_logits: tuple, attention_mask) -> torch.Tensor | None:
        """The family's load-balancing loss over the recorded router logits, as its `*ForCausalLM` computes it, or
        `None` where the family has none."""
        if not (self.moe and self.moe.load_balancing_loss):
            return None
        experts = getattr(config, self.moe.experts)
        top_k = getattr(config, self.moe.top_k)
        return self.modeling.load_balancing_loss_func(router_logits, experts, top_k, attention_mask)

    def model_parts(self, config) -> nn.Module | None:
        """The family's model (`ModelParts.model`) built from `config` without decoder layers: the modules around
        them, made by the family's own code; `None` where `parts` is."""
        if self.parts is None:
            return None
        config = copy.deepcopy(config)
        config.num_hidden_layers = 0
        # The AttnRes model's experts implementation is for its layers' experts; this model has none to set it for.
        config._experts_implementation = None
        return self.cls(self.parts.model)(config)

    def output_vocab_size(self, config) -> int:
        """The number of logits the family's LM head computes (`output_vocab`), the vocabulary's size by default."""
        pruned = getattr(config, self.output_vocab) if self.output_vocab else None
        return pruned or config.vocab_size

    def embedding(self, config) -> nn.Embedding:
        if self.scaled_embedding:
            scaled = self.cls("TextScaledWordEmbedding")
            scale = config.hidden_size**0.5
            return scaled(config.vocab_size, config.hidden_size, config.pad_token_id, embed_scale=scale)
        return nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)


GEMMA = dict(llama_norm=False, scaled_embedding=True)
GRANITE_MULTIPLIERS = dict(
    embedding_multiplier="embedding_multiplier",
    residual_multiplier="residual_multiplier",
    logits_divisor="logits_scaling",
)
# GPT-2 and its descendants: LayerNorms, learned positions added to the embeddings and a dropout after them, the
# layers under `transformer.h`.
GPT2 = dict(
    norm=LAYER_NORM,
    norm_eps="layer_norm_epsilon",
    llama_norm=False,
    embedding_dropout="embd_pdrop",
    rotary_embedding=None,
    decoder_layer="Block",
    parts=GPT2_PARTS,
    checkpoint_renamings=GPT2_RENAMINGS,
)
# OPT: its MLP is the decoder layer's own `fc1`, activation and `fc2`; positions counted over the attention mask, offset
# by 2 in its learned embedding; the layers under `model.decoder.layers`.
OPT = dict(
    sublayers=(
        Sublayer("self_attn", "self_attn_layer_norm"),
        Sublayer("fc1", "final_layer_norm", ("activation_fn", "fc2"), call=FEED_FORWARD),
    ),
    norm=LAYER_NORM,
    norm_eps=None,
    llama_norm=False,
    rotary_embedding=None,
    initializer_range="init_std",
    parts=ModelParts(
        "Decoder",
        "embed_tokens",
        "embed_positions",
        "final_layer_norm",
        positions_from_mask=True,
        positions_after_mask=True,
    ),
    checkpoint_renamings=(
        (r"^model\.decoder\.layers\.", "model.layers."),
        (r"^model\.decoder\.final_layer_norm\.", "model.norm."),
        (r"^model\.decoder\.", "model."),
    ),
)
# BioGPT: OPT's layer and positions (counted from the cache's length), an embedding scaled by sqrt(hidden_size) where
# `scale_embedding`, a dropout after the positions, the layers under `biogpt.layers`, the head `output_projection`.
BIOGPT = dict(
    OPT,
    embedding_dropout="hidden_dropout_prob",
    initializer_range="initializer_range",
    parts=ModelParts("Model", "embed_tokens", "embed_positions", "layer_norm", positions_after_mask=True),
    checkpoint_renamings=(
        (r"^(biogpt\.)?layers\.", "model.layers."),
        (r"^(biogpt\.)?layer_norm\.", "model.norm."),
        (r"^(biogpt\.)?embed_", "model.embed_"),
        (r"^output_projection\.", "lm_head."),
    ),
)
# XGLM: OPT's layer, sinusoidal positions (offset by 2, from the cache's length) on an embedding scaled by
# sqrt(d_model) where `scale_embedding`, a dropout after them, the final norm `layer_norm`.
XGLM = dict(
    OPT,
    embedding_dropout="dropout",
    parts=ModelParts("Model", "embed_tokens", "embed_positions", "layer_norm"),
    checkpoint_renamings=((r"^model\.layer_norm\.", "model.norm."),),
)
# DeepSeek-V3, GLM-4.5: a routing bias balances the experts, and their `*ForCausalLM` adds no loss.
NO_LOAD_BALANCING_LOSS = Moe(load_balancing_loss=False)
# Families whose config is in the installed Transformers: InternLM3's is absent from the lowest supported, 5.16.1.
FAMILIES = {
    family.model_type: family
    for family in (
        Family("llama", "llama", "Llama"),
        Family("mistral", "mistral", "Mistral"),
        Family("mixtral", "mixtral", "Mixtral", moe=MOE),
        Family("qwen2", "qwen2", "Qwen2"),
        Family("qwen2_moe", "qwen2_moe", "Qwen2Moe", moe=Moe("num_experts")),
        Family("qwen3", "qwen3", "Qwen3"),
        Family("qwen3_moe", "qwen3_moe", "Qwen3Moe", moe=Moe("num_experts")),
        Family("smollm3", "smollm3", "SmolLM3"),
        Family("phi3", "phi3", "Phi3", RESIDUAL_DROPOUT),
        Family("granite", "granite", "Granite", **GRANITE_MULTIPLIERS),
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
        Family("ministral", "ministral", "Ministral"),
        Family("glm4", "glm4", "Glm4", GLM4_NORMS),
        Family("ernie4_5", "ernie4_5", "Ernie4_5"),
        Family("seed_oss", "seed_oss", "SeedOss"),
        Family("helium", "helium", "Helium", llama_norm=False),
        Family("arcee", "arcee", "Arcee"),
        Family("hunyuan_v1_dense", "hunyuan_v1_dense", "HunYuanDenseV1"),
        Family("exaone4", "exaone4", "Exaone4", POST_BRANCH_NORM),
        Family("apertus", "apertus", "Apertus", APERTUS_NORMS),
        Family("internlm3", "llama", "Llama"),
        # Emu3's text decoder, which Emu3ForCausalLM runs alone (Emu3ForConditionalGeneration adds a VQ-VAE).
        Family("emu3_text_model", "emu3", "Emu3", SHARED_RESIDUAL_DROPOUT),
        # EXAONE 3 and IQuest-Coder run Llama's model on configs of their own.
        Family("exaone", "llama", "Llama"),
        Family("iquestcoder", "llama", "Llama"),
        Family("glm", "glm", "Glm"),
        Family("cwm", "cwm", "Cwm"),
        Family("bitnet", "bitnet", "BitNet"),
        Family("diffllama", "diffllama", "DiffLlama"),
        Family("apertus1p5_text", "apertus1p5", "Apertus1p5Text", APERTUS_NORMS, output_vocab="output_vocab_size"),
        Family(
            "stablelm",
            "stablelm",
            "StableLm",
            STABLELM_DROPOUT,
            norm=LAYER_NORM,
            norm_eps="layer_norm_eps",
            llama_norm=False,
        ),
        Family(
            "starcoder2",
            "starcoder2",
            "Starcoder2",
            norm=LAYER_NORM,
            norm_eps="norm_epsilon",
            llama_norm=False,
            embedding_dropout="embedding_dropout",
        ),
        Family("deepseek_v3", "deepseek_v3", "DeepseekV3", moe=NO_LOAD_BALANCING_LOSS),
        Family("gpt_oss", "gpt_oss", "GptOss", llama_norm=False, moe=Moe(router="mlp.router", mixtral_experts=False)),
        Family("glm4_moe", "glm4_moe", "Glm4Moe", moe=NO_LOAD_BALANCING_LOSS),
        Family("olmoe", "olmoe", "Olmoe", moe=Moe("num_experts")),
        Family(
            "granitemoe",
            "granitemoe",
            "GraniteMoe",
            (
                Sublayer("self_attn", "input_layernorm"),
                Sublayer("block_sparse_moe", "post_attention_layernorm", call=FEED_FORWARD),
            ),
            moe=Moe(router="block_sparse_moe.router"),
            **GRANITE_MULTIPLIERS,
        ),
        Family("minimax_m2", "minimax_m2", "MiniMaxM2", moe=MOE),
        Family("ernie4_5_moe", "ernie4_5_moe", "Ernie4_5_Moe", moe=Moe("num_experts")),
        Family("hunyuan_v1_moe", "hunyuan_v1_moe", "HunYuanMoEV1", moe=Moe("num_experts", load_balancing_loss=False)),
        Family(
            "llama4_text",
            "llama4",
            "Llama4Text",
            (
                Sublayer("self_attn", "input_layernorm"),
                Sublayer("feed_forward", "post_attention_layernorm", call=FEED_FORWARD),
            ),
            llama_norm=False,
            moe=Moe(router="feed_forward.router", logits_index=1, load_balancing_loss=False, mixtral_experts=False),
            model_prefix="Llama4",
        ),
        Family("hy_v3", "hy_v3", "HYV3", moe=Moe(load_balancing_loss=False)),
        Family("flint", "flint", "Flint", llama_norm=False, moe=Moe("num_experts")),
        Family(
            "aria_text",
            "aria",
            "AriaText",
            # experts held as (in, out), the layout `grouped_mm` reads, which its own expert-parallel plan places
            moe=Moe(
                "moe_num_experts",
                top_k="moe_topk",
                router="mlp.router",
                load_balancing_loss=False,
                mixtral_experts=False,
            ),
            since=(5, 19),
        ),
        Family("exaone_moe", "exaone_moe", "ExaoneMoe", moe=Moe("num_experts", load_balancing_loss=False)),
        Family("dots1", "dots1", "Dots1", moe=NO_LOAD_BALANCING_LOSS),
        Family("deepseek_v2", "deepseek_v2", "DeepseekV2", moe=Moe("num_experts", load_balancing_loss=False)),
        Family("glm4_moe_lite", "glm4_moe_lite", "Glm4MoeLite", moe=NO_LOAD_BALANCING_LOSS),
        Family("axk1", "axk1", "AXK1", moe=NO_LOAD_BALANCING_LOSS),
        Family("deepseek_v32", "deepseek_v32", "DeepseekV32", moe=NO_LOAD_BALANCING_LOSS),
        # The norms before attention, and before the MoE in MoE layers, gate their output (`AXK2GatedRMSNorm`).
        Family("axk2", "axk2", "AXK2", moe=NO_LOAD_BALANCING_LOSS),
        Family("flex_olmo", "flex_olmo", "FlexOlmo", POST_BRANCH_NORM, llama_norm=False, moe=Moe("num_experts")),
        Family(
            "granitemoeshared",
            "granitemoeshared",
            "GraniteMoeShared",
            (PRE_NORM[0], GRANITE_SHARED_MOE),
            moe=Moe(router="block_sparse_moe.router"),
            **GRANITE_MULTIPLIERS,
        ),
        Family(
            "hyperclovax",
            "hyperclovax",
            "HyperCLOVAX",
            HYPERCLOVAX_NORMS,
            embedding_multiplier="embedding_multiplier",
            residual_multiplier="residual_multiplier",
            logits_multiplier="logits_scaling",
        ),
        Family(
            "afmoe",
            "afmoe",
            "Afmoe",
            AFMOE_NORMS,
            llama_norm=False,
            mup_embedding_scale="mup_enabled",
            moe=Moe("num_experts", router="mlp.router", load_balancing_loss=False),
            since=(5, 19),
        ),
        Family(
            "qwen3_next",
            "qwen3_next",
            "Qwen3Next",
            layer_sublayers=GATED_DELTANET,
            llama_norm=False,
            moe=Moe("num_experts"),
        ),
        # Qwen3.5's text decoders: multimodal rotary sections over text positions.
        Family(
            "qwen3_5_text",
            "qwen3_5",
            "Qwen3_5",
            layer_sublayers=GATED_DELTANET,
            llama_norm=False,
            rotary_embedding="TextRotaryEmbedding",
        ),
        Family(
            "qwen3_5_moe_text",
            "qwen3_5_moe",
            "Qwen3_5Moe",
            layer_sublayers=GATED_DELTANET,
            llama_norm=False,
            rotary_embedding="TextRotaryEmbedding",
            moe=Moe("num_experts"),
        ),
        Family("gpt2", "gpt2", "GPT2", GPT2_SUBLAYERS, causal_lm="LMHeadModel", **GPT2),
        Family("gpt_neo", "gpt_neo", "GPTNeo", LAYER_PAST_SUBLAYERS, **{**GPT2, "embedding_dropout": "embed_dropout"}),
        Family("gpt_bigcode", "gpt_bigcode", "GPTBigCode", LAYER_PAST_SUBLAYERS, **GPT2),
        Family("opt", "opt", "OPT", **OPT),
        Family("biogpt", "biogpt", "BioGpt", **BIOGPT),
        Family("xglm", "xglm", "XGLM", **XGLM),
        # The paper's own backbone: KDA layers and NoPE latent-attention layers, a dense first MLP, then MoE with a
        # shared expert, balanced by a routing bias (its `*ForCausalLM` adds no loss).
        Family(
            "kimi_linear",
            "kimi_linear",
            "KimiLinear",
            layer_sublayers=KIMI_DELTA_ATTENTION,
            rotary_embedding=None,
            moe=NO_LOAD_BALANCING_LOSS,
        ),
        Family("lfm2", "lfm2", "Lfm2", layer_sublayers=SHORT_CONVOLUTION, **LFM2),
        # LFM2-MoE: dense first layers (`num_dense_layers`), then sigmoid routing with an expert bias and no loss.
        Family(
            "lfm2_moe",
            "lfm2_moe",
            "Lfm2Moe",
            layer_sublayers=SHORT_CONVOLUTION,
            moe=Moe("num_experts", router="feed_forward.gate", load_balancing_loss=False),
            **LFM2,
        ),
        Family(
            "lfm3",
            "lfm3",
            "Lfm3",
            layer_sublayers=SANDWICHED_SHORT_CONVOLUTION,
            rotary_per_layer_type=True,
            **LFM2,
        ),
        Family(
            "granitemoehybrid",
            "granitemoehybrid",
            "GraniteMoeHybrid",
            layer_sublayers=GRANITE4_MAMBA,
            rope_switch="position_embedding_type",
            moe=Moe(router="block_sparse_moe.router"),
            **GRANITE_MULTIPLIERS,
        ),
        # Llama 4's attention scaling of the queries with the position (`llama_4_scaling_beta`), inside the attention.
        Family("ministral3", "ministral3", "Ministral3"),
        # Gemma's embedding scale, norms and soft-capping, without Gemma 2's norms after the branches.
        Family(
            "vaultgemma",
            "vaultgemma",
            "VaultGemma",
            (PRE_NORM[0], Sublayer("mlp", "pre_feedforward_layernorm", call=FEED_FORWARD)),
            logit_softcap="final_logit_softcapping",
            **GEMMA,
        ),
        # A routing bias balances the experts beside a shared one, in every layer.
        Family("solar_open", "solar_open", "SolarOpen", moe=NO_LOAD_BALANCING_LOSS),
        Family("youtu", "youtu", "Youtu"),  # multi-head latent attention in a dense decoder
        Family("jais2", "jais2", "Jais2", norm=LAYER_NORM, norm_eps="layer_norm_eps", llama_norm=False),
        # Weightless norms, the final one applied to the embeddings too; relu^2 MLP, soft-capped logits.
        Family(
            "nanochat",
            "nanochat",
            "NanoChat",
            llama_norm=False,
            embedding_norm=True,
            logit_softcap="final_logit_softcapping",
            parts=OWN_EMBEDDING_AND_NORM,
        ),
        # LayerNorms with a gain of 1 + w, partial rotary.
        Family("nemotron", "nemotron", "Nemotron", norm="LayerNorm1P", norm_eps="norm_eps", llama_norm=False),
        # LayerNorms without weights, at torch's default eps.
        Family("olmo", "olmo", "Olmo", norm="LayerNorm", norm_eps=None, llama_norm=False, parts=OWN_EMBEDDING_AND_NORM),
        # StableLM's layout (LayerNorms, q/k LayerNorms, partial rotary, a dropout after the MLP); the final norm is its
        # model's `final_layernorm`.
        Family(
            "persimmon",
            "persimmon",
            "Persimmon",
            STABLELM_DROPOUT,
            norm=LAYER_NORM,
            norm_eps="layer_norm_eps",
            llama_norm=False,
            checkpoint_renamings=((r"^model\.final_layernorm\.", "model.norm."),),
        ),
        # Windowed and full layers with RoPE bases per type and attention sinks, a dense first layer, then MoE
        # balanced by a routing bias.
        Family(
            "mimo_v2_flash",
            "mimo_v2_flash",
            "MiMoV2Flash",
            rotary_per_layer_type=True,
            moe=NO_LOAD_BALANCING_LOSS,
        ),
        # GLM-4's norms after each branch, windowed and full layers, MoE with a shared expert and a routing bias.
        Family(
            "kolibri1",
            "kolibri1",
            "Kolibri1",
            GLM4_NORMS,
            moe=NO_LOAD_BALANCING_LOSS,
        ),
        # Multi-head latent attention; the embedding, each branch and the LM head's input scaled (muP).
        Family(
            "minicpm3",
            "minicpm3",
            "MiniCPM3",
            layer_residual_scale="residual_scale",
            head_input_divisor="logits_scaling",
            parts=OWN_EMBEDDING_AND_NORM,
        ),
    )
    if family.model_type in CONFIG_MAPPING and TRANSFORMERS_RELEASE >= family.since
}


# The eps of torch's `nn.LayerNorm` where a family's config has no field for it (OPT).
LAYER_NORM_EPS = 1e-5


def norm_eps(config) -> float:
    """The eps of the norms of `config`'s family (`Family.norm_eps`)."""
    field = FAMILIES[config.family].norm_eps
    return LAYER_NORM_EPS if field is None else getattr(config, field)


def layer_types(config) -> list[str]:
    """Each decoder layer's attention type, as the family's model picks its mask: the config's `layer_types` where the
    family has them, else every layer windowed when the config sets a window (Mistral, Mixtral, Phi-3), else none."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * config.num_hidden_layers
