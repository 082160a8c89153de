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
import operator
from dataclasses import dataclass, replace

import torch
from torch import nn
import transformers
from packaging import version
from transformers.initialization import no_init_weights
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES


@dataclass(frozen=True)
class SharedStates:
    """An object the family's model makes once per forward pass and gives the attention of every layer, where some
    layers leave tensors for later ones to read: Kolibri 1.1's `KVSharingDict`, in which a layer whose keys and values
    others reuse stores them under its index as a string, and those read them there. A pipeline stage boundary carries
    the entries that the layers after it read (docs/design.md §11).

    keyword: the keyword by which the attention takes it (`shared_kv_states`).
    cls: its class in the family's modeling module (`KVSharingDict`).
    sources: the config field that gives, per layer, the layer whose entry its attention reads, or its own index
        where it reads none (`kv_source_layers`).
    entry_size: the tensors of an entry (2: the keys and the values).
    """

    keyword: str
    cls: str
    sources: str
    entry_size: int


# How a decoder layer calls a sublayer's module, as the family's own decoder layer does (docs/design.md §10).
ATTENTION = "attention"  # hidden_states, position embeddings, mask, position ids and the cache; returns (output, weights)
# a linear attention (Gated DeltaNet, KDA) or a short convolution (LFM2): hidden_states, the cache and a 2D padding mask
RECURRENT = "recurrent"
FEED_FORWARD = "feed_forward"  # an MLP or MoE: hidden_states alone
# a recurrent mixer called as `module(hidden_states, state)` that returns `(output, state)`, its state held by layer in
# the family's own cache object, not a Transformers `Cache` (xLSTM's mLSTM layer; `OwnCache`)
STATEFUL = "stateful"


@dataclass(frozen=True)
class Sublayer:
    """One sublayer of a decoder layer, by the names of the family's decoder-layer modules that make it: each a name,
    or a dotted path where the family's layer holds the module inside one of its own that also computes a residual
    add (DBRX's `norm_attn_norm`, which holds the attention between the norms before each branch and adds the
    attention's output to its input), so that the model calls the modules inside one by one instead.

    module: the module that computes the branch: the attention (`self_attn`), a linear attention (`linear_attn`), a
        short convolution (`conv`), the MLP or MoE (`mlp`).
    pre_norm: the norm its input goes through; `None` where it reads the residual stream itself (OLMo 2).
    post: the modules its output goes through, in order, before it joins the residual stream: a post-norm (Gemma 2,
        OLMo 2), a residual dropout (Phi-3), the rest of an MLP that the decoder layer computes from its own modules
        (OPT's activation and `fc2`, after `fc1`). They sit inside the branch, so the stream stays a plain sum of the
        branches' outputs and the exact retrofit holds (docs/design.md §5).
    call: how the family's decoder layer calls `module`: `ATTENTION`, `RECURRENT`, `STATEFUL` or `FEED_FORWARD`.
    cache_argument: the keyword `module` takes the cache by where it is not Transformers' own (`cache`): GPT-Neo's
        and GPT-BigCode's attentions take it as `layer_past`; `None` for Transformers' own.
    summed: modules on the same input whose outputs the family's layer adds to `module`'s, in order, as one branch:
        by name, called the same way (Granite 4's and Granite MoE Shared's shared MLP beside the MoE), or as a
        `Sublayer` of its own call, mask and multipliers, without a norm or modules of its own (Falcon-H1's attention
        beside its Mamba). A module the family's layer leaves out for the config (Granite 4's MoE without experts) is
        skipped, as the layer skips it.
    mask: in a layer whose type has masks of several kinds (`HYBRID_MASKS`, `HYBRID_SLIDING_MASKS`), the kind `module`
        reads: the causal mask (`"full_attention"`), the windowed one (`"sliding_attention"`) or the padding mask
        (`"linear_attention"`); `None` where the layer has one mask.
    input_multiplier, output_multiplier: the config fields of the scalars the family's layer multiplies the module's
        input and output by (Falcon-H1's `attention_in_multiplier` and `attention_out_multiplier`), or `None`.
    residual_argument: the keyword by which `module` takes the residual that it adds to its own output itself (MPT's
        MLP, BLOOM's attention and MLP), or `None`. The model passes a zero, so the module returns its branch alone
        (`x + 0 == x`) and the stream stays the model's.
    output_bias: the index, among the attention's outputs, of a bias that the family's layer adds to its first output
        (GPT-NeoX Japanese's attention returns its output projection's bias apart, `None` but in the last layer), or
        `None`.
    dropout: the config field of the probability of the dropout that the family's layer applies to the branch as a
        function, after `post` (GPT-NeoX Japanese's `hidden_dropout`), or `None`.
    threaded: the keyword by which the attention `module` takes what the previous layer's returned after its output
        and attention weights, which it returns in turn (GLM-5's `prev_topk_indices`, the keys its `shared` layers
        reuse from the last layer that ran its indexer; Kolibri 1.1's `index_pool`, the candidate keys of its last
        indexer), or `None`. The family's model threads it from layer to layer
        beside the residual stream, which it does not touch; the first layer is given `None`.
    threaded_from: the config field of the layers whose attention starts what `threaded` passes on (Kolibri 1.1's
        indexers, `index_layers`), where the layers before the first return `None`, so that a pipeline stage boundary
        there carries nothing of it; `None` where every layer's returns a tensor (GLM-5's first layer runs its
        indexer).
    shared: the object the family's model makes once per forward pass and gives the attention `module` of every
        layer (`SharedStates`), or `None`.
    input_argument: the keyword by which the attention `module` takes its input, as the family's layer passes it, or
        the keywords where it passes the input as several arguments (CTRL's attention, as `v`, `k` and `q`); `None`
        where it passes the input by position (RecurrentGemma's temporal blocks, whose recurrent and attention blocks
        name it differently).
    convolution: a short convolution the family's layer runs on the branch's output before it joins the residual
        stream, called with the cache and the padding mask (`padding_mask`), or `None`: Inkling's `attn_sconv` and
        `mlp_sconv`, each returning `y + conv(y)` for its input `y`, inside the branch, so the stream stays a plain sum.
    padding_mask: the keyword by which the family's layer gives `convolution`, and an attention `module`, the padding
        mask (the `"linear_attention"` kind among the layer's masks, `HYBRID_MASKS`) beside the attention mask:
        Inkling's `conv_mask`, which its short convolutions read (its attention's of keys and values too); or `None`.
    """

    module: str
    pre_norm: str | None
    post: tuple[str, ...] = ()
    call: str = ATTENTION
    cache_argument: str | None = None
    summed: tuple["str | Sublayer", ...] = ()
    mask: str | None = None
    input_multiplier: str | None = None
    output_multiplier: str | None = None
    residual_argument: str | None = None
    output_bias: int | None = None
    dropout: str | None = None
    threaded: str | None = None
    threaded_from: str | None = None
    shared: SharedStates | None = None
    input_argument: str | tuple[str, ...] | None = "hidden_states"
    convolution: str | None = None
    padding_mask: str | None = None

    @property
    def summands(self) -> tuple["Sublayer", ...]:
        """The modules whose outputs the branch sums, each as the `Sublayer` that says how it is called: `module`,
        then those `summed` beside it (one named alone is called as `module` is)."""
        summed = (part if isinstance(part, Sublayer) else replace(self, module=part, summed=()) for part in self.summed)
        return (replace(self, summed=()), *summed)

    @property
    def multipliers(self) -> set[str]:
        """The config fields of the scalars the family's layer applies to the branch's modules."""
        summands = self.summands
        return ({part.input_multiplier for part in summands} | {part.output_multiplier for part in summands}) - {None}


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
# Mamba's layers: one mixer behind one residual add, `residual + mixer(norm(residual))`, no MLP (Mamba, Mamba 2, Falcon
# Mamba; Nemotron-H's Mamba 2 layers).
MAMBA_MIXER = (Sublayer("mixer", "norm", call=RECURRENT),)
# Nemotron-H: each layer one mixer under `mixer`, by the config's pattern a Mamba 2, a NoPE attention, an MLP or an MoE
# with its shared experts inside.
NEMOTRON_H_MIXERS = {
    "linear_attention": MAMBA_MIXER,
    "full_attention": (Sublayer("mixer", "norm"),),
    "mlp": (Sublayer("mixer", "norm", call=FEED_FORWARD),),
    "moe": (Sublayer("mixer", "norm", call=FEED_FORWARD),),
}
# Mamba layers between attention layers, each followed by the MLP or MoE behind its own norm (Jamba's Mamba, Bamba's
# Mamba 2).
MAMBA_FEED_FORWARD = Sublayer("feed_forward", "pre_ff_layernorm", call=FEED_FORWARD)
MAMBA_HYBRID = {
    "full_attention": (Sublayer("self_attn", "input_layernorm"), MAMBA_FEED_FORWARD),
    "linear_attention": (Sublayer("mamba", "input_layernorm", call=RECURRENT), MAMBA_FEED_FORWARD),
}
# Mamba 2 and attention side by side on one input in every layer, each output and the attention's input scaled, then
# the MLP (Falcon-H1); the layer's masks by kind (`HYBRID_MASKS`).
HYBRID_MASKS = "hybrid"
FALCON_H1_LAYER = {
    HYBRID_MASKS: (
        Sublayer(
            "mamba",
            "input_layernorm",
            call=RECURRENT,
            mask="linear_attention",
            output_multiplier="ssm_out_multiplier",
            summed=(
                Sublayer(
                    "self_attn",
                    None,
                    mask="full_attention",
                    input_multiplier="attention_in_multiplier",
                    output_multiplier="attention_out_multiplier",
                ),
            ),
        ),
        MAMBA_FEED_FORWARD,
    ),
}
# Inkling: full or windowed attention, then the MLP or MoE, each followed by a short convolution of its output; the
# layer's causal mask by its attention's kind, and the padding mask for the convolutions.
HYBRID_SLIDING_MASKS = "hybrid_sliding"
INKLING_MLP = Sublayer(
    "mlp", "post_attention_layernorm", call=FEED_FORWARD, convolution="mlp_sconv", padding_mask="conv_mask"
)
INKLING_LAYER = {
    kind: (
        Sublayer("self_attn", "input_layernorm", mask=mask, convolution="attn_sconv", padding_mask="conv_mask"),
        INKLING_MLP,
    )
    for kind, mask in ((HYBRID_MASKS, "full_attention"), (HYBRID_SLIDING_MASKS, "sliding_attention"))
}
# Griffin's recurrent blocks between windowed attention layers, both under `temporal_block` and called alike
# (RecurrentGemma).
GRIFFIN = dict.fromkeys(
    ("linear_attention", "sliding_attention"),
    (
        Sublayer("temporal_block", "temporal_pre_norm", input_argument=None),
        Sublayer("mlp_block", "channel_pre_norm", call=FEED_FORWARD),
    ),
)
# A linear attention between attention layers, both built under `self_attn` (Kimi Linear's Kimi Delta Attention between
# latent-attention layers, Bailing's Lightning-style linear attention between its attention layers).
KIMI_DELTA_ATTENTION = {
    "full_attention": PRE_NORM,
    "linear_attention": (Sublayer("self_attn", "input_layernorm", call=RECURRENT), PRE_NORM[1]),
}

class PositionTable(nn.Module):
    """The table of position vectors that a family's model computes with a function of its own and holds in a buffer,
    not saved, adding its rows at the position ids to the embeddings (CTRL's sinusoidal `pos_encoding`, by
    `positional_encoding`); computed again as the model is initialised, as the family's `_init_weights` does."""

    def __init__(self, function, positions: int, hidden_size: int):
        super().__init__()
        self.function = function
        self.positions = positions
        self.hidden_size = hidden_size
        self.register_buffer("table", self.computed(), persistent=False)

    def computed(self) -> torch.Tensor:
        return self.function(self.positions, self.hidden_size, torch.float)

    def forward(self, position_ids: torch.LongTensor) -> torch.Tensor:
        return self.table[position_ids]


class RotaryEmbeddingPerBase(nn.Module):
    """A family's rotary embedding built once per RoPE base of its layers (Granite MoE SWA's `layer_rope_theta`), each
    from the config with that base, as the family's model builds them; called with a base where a rotary embedding with
    bases per attention type is called with a layer type. A base of `0` marks a layer without one."""

    def __init__(self, rotary_embedding: type[nn.Module], config, bases: list[float]):
        super().__init__()
        self.layer_types = sorted(set(filter(None, bases)))
        embeddings = []
        for base in self.layer_types:
            base_config = copy.deepcopy(config)
            base_config.rope_parameters = {**config.rope_parameters, "rope_theta": base}
            embeddings.append(rotary_embedding(base_config))
        self.embeddings = nn.ModuleList(embeddings)

    def forward(self, x: torch.Tensor, position_ids: torch.LongTensor, base: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self.embeddings[self.layer_types.index(base)](x, position_ids)


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
        Qwen2-MoE's and OLMoE's `num_experts`). This field, `top_k` and `loss_coefficient` may be dotted paths into a
        sub-config, where the family's config keeps its MoE settings in one (DBRX's `ffn_config.moe_num_experts`); they
        are read with `Family.config_value`.
    top_k: the config field of the number of experts each token is routed to (Aria's `moe_topk`).
    router: the router's module under a decoder layer (`mlp.gate`; GPT-OSS's `mlp.router`); its output
        `logits_index` holds the router logits the model records.
    load_balancing_loss: the family's `*ForCausalLM` adds `router_aux_loss_coef` times its
        `load_balancing_loss_func(router_logits, experts, num_experts_per_tok, attention_mask)` to the loss.
        DeepSeek-V3, GLM-4.5, HunYuan and Llama 4 return the router logits without one (DeepSeek-V3 and GLM-4.5
        balance their experts with a routing bias).
    mixtral_experts: the experts hold Mixtral's layout (`EXPERTS_TP_PLAN`); GPT-OSS interleaves gate and up.
    gated_experts: each expert is a gated MLP, its gate and up projections stacked in `experts.gate_up_proj`; without
        a gate (Nemotron-H's), the experts hold `experts.up_proj` and `experts.down_proj` alone. Checkpoints that
        store one expert at a time are stacked into them as the family's conversion mapping does.
    router_class: the router's class in the family's modeling module, by which the model records its logits (those
        of each router of that class, as the family's own model records them), where another family's router has the
        same name with its logits at another index (Llama 4's and Jamba's `feed_forward.router`; the `mlp.router` of
        GPT-OSS, Phi-3.5-MoE, Aria and AFMoE, and JetMoE's, whose logits are its fifth output); `None` records them by
        the router's name.
    attention_router: the router of a mixture of attention heads under a decoder layer, which runs before `router`
        and whose logits the family's load-balancing loss reads too (JetMoE's `self_attention.experts.router`), or
        `None`.
    loss_coefficient: the config field of the coefficient of the load-balancing loss (JetMoE's `aux_loss_coef`).
    """

    experts: str = "num_local_experts"
    top_k: str = "num_experts_per_tok"
    router: str = "mlp.gate"
    logits_index: int = 0
    load_balancing_loss: bool = True
    mixtral_experts: bool = True
    gated_experts: bool = True
    router_class: str | None = None
    attention_router: str | None = None
    loss_coefficient: str = "router_aux_loss_coef"

    @property
    def module(self) -> str:
        """The MoE module under a decoder layer, which holds the router and the experts."""
        return self.router.rpartition(".")[0]

    def routers_of(self, layer: nn.Module) -> list[nn.Module]:
        """The decoder layer's routers in the order they run: none in a dense layer (DeepSeek-V3's first layers, Qwen's
        `mlp_only_layers`), whose MLP has no such module; JetMoE's attention router before its MoE's."""
        names = (self.router,) if self.attention_router is None else (self.attention_router, self.router)
        routers = []
        for name in names:
            try:
                routers.append(layer.get_submodule(name))
            except AttributeError:
                pass
        return routers


MOE = Moe()


@dataclass(frozen=True)
class ModelParts:
    """The modules of a family's model around its decoder layers, where they are not Llama's (a token embedding, a
    rotary embedding, a final norm of the family's class): GPT-2's learned positions added to the token embeddings,
    OPT's offset ones, OPT's final LayerNorm without an eps field, the Mamba families' embedding without a padding
    row, Inkling's embedding with a norm inside. The family's own model class, built without decoder layers, builds them, so they are the family's
    construction; the AttnRes model holds them under its own names (`embed_tokens`, `embed_positions`, `norm`), to
    which `Family.checkpoint_renamings` renames the family's.

    model: the suffix of the family's class that holds them (`GPT2Model`; OPT's `OPTDecoder`).
    tokens, positions, norm: their names in that class (paths where they sit deeper: ModernBERT decoder's
        `embeddings.tok_embeddings`): the token embedding (`wte`), the position embedding whose output the family's
        model adds to the token embeddings (`wpe`), or `None`, and the final norm (`ln_f`).
    positions_from_mask: where no position ids are given, the family's model counts the positions over the attention
        mask, `cumsum(mask) - 1` and -1 at padding (OPT), instead of counting every token from the cache's length.
    positions_after_mask: the position embedding is called as `positions(attention_mask, position_ids=ids)`, which
        reads the ids where they are given (OPT's learned embedding), instead of `positions(ids)`.
    embedding_norm: the norm the family's model applies to the embeddings before the first layer (BLOOM's
        `word_embeddings_layernorm`, ModernBERT decoder's `embeddings.norm`), or `None`; the AttnRes model holds it as
        `embedding_norm`.
    position_table: where the family's model adds position vectors from a buffer instead of a module (`positions` is
        `None`), the function of its modeling module that computes them, as `function(max_position_embeddings,
        hidden_size, torch.float)` (CTRL's `positional_encoding`), or `None`; the AttnRes model holds them as
        `embed_positions`, a `PositionTable`.
    layer_counts: the config fields by which the family's model counts the decoder layers it builds, all set to 0 so
        that it builds none: `num_hidden_layers`, and xLSTM's `num_blocks` beside it.
    """

    model: str = "Model"
    tokens: str = "wte"
    positions: str | None = "wpe"
    norm: str = "ln_f"
    positions_from_mask: bool = False
    positions_after_mask: bool = False
    embedding_norm: str | None = None
    position_table: str | None = None
    layer_counts: tuple[str, ...] = ("num_hidden_layers",)

    def position_embeddings(self, embed_positions: nn.Module, position_ids: torch.LongTensor) -> torch.Tensor:
        """The vectors `embed_positions` adds at `position_ids`, called as the family's model calls it."""
        if self.positions_after_mask:
            return embed_positions(None, position_ids=position_ids)
        return embed_positions(position_ids)


@dataclass(frozen=True)
class AttentionBias:
    """A bias on the attention scores that the family's model builds once per forward pass, with the family's own
    function, and hands to every layer's attention: ALiBi's linear penalty on distance (MPT, BLOOM).

    keyword: the keyword by which the family's attention takes it (MPT's `position_bias`, BLOOM's `alibi`).
    function: the name of the function in the family's modeling module that builds it.
    max_positions: the config field of the longest sequence, where the family builds the bias over that many
        positions once, as `function(num_heads, max_positions, device=device)`, and its attention keeps the last ones
        it needs (MPT's `max_seq_len`); `None` where the family counts the positions over the padding mask of the past
        and present tokens, as `function(mask, num_heads, dtype)`, an all-ones mask as long as the cache's keys where
        none is given (BLOOM).
    """

    keyword: str
    function: str
    max_positions: str | None = None

    def build(self, modeling, config, inputs_embeds: torch.Tensor, attention_mask, cache) -> torch.Tensor:
        """The bias for a forward pass over `inputs_embeds`, as the family's model builds it."""
        function = getattr(modeling, self.function)
        heads = config.num_attention_heads
        if self.max_positions is not None:
            return function(heads, getattr(config, self.max_positions), device=inputs_embeds.device)
        if not (isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2):
            batch_size, length = inputs_embeds.shape[:2]
            keys = cache.get_mask_sizes(length, 0)[0] if cache is not None else length
            attention_mask = torch.ones(batch_size, keys, dtype=torch.long, device=inputs_embeds.device)
        return function(attention_mask.to(inputs_embeds.device), heads, inputs_embeds.dtype)


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


@dataclass(frozen=True)
class OwnCache:
    """The cache object of a family whose model keeps its layers' recurrent state in one of its own, not a Transformers
    `Cache` (xLSTM's `xLSTMCache`): the model makes it as the family's model does where `use_cache` is set and none is
    given, `generate` leaves it to the model (as it does for the family's, which has no `Cache` for it to make), and
    its `STATEFUL` sublayers read and update their state in it.

    cache: the suffix of its class in the family's modeling module, built as `cls(config, batch_size, dtype=...,
        device=...)`.
    states: its attribute holding each layer's state by layer index, a tuple of tensors that the family's model
        overwrites in place (`copy_`) with the state the layer returns.
    length: its attribute counting the tokens it has seen, a tensor the family's model adds each forward pass's
        length to.
    """

    cache: str = "Cache"
    states: str = "rnn_state"
    length: str = "seqlen_offset"


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
    sublayers: the sublayers (`Sublayer`) of every decoder layer, in order: the token mixer and the MLP, or the one
        mixer of a layer that has no separate MLP (Mamba's `residual + mixer(norm(residual))`).
    layer_sublayers: for hybrid decoders, each layer's sublayers by its type (the config's `layer_types`): the token
        mixer the family's decoder layer builds for that type (attention, a linear attention, a short convolution) and
        the MLP, or the one mixer a layer of that type has (Nemotron-H's Mamba 2, attention, MLP or MoE).
    recorded_attention: the suffix of the family's attention class, where its attention module's name is also that
        of modules that are no attention (Nemotron-H's `mixer`, GPT-Neo's inner `attention` for GPT-NeoX Japanese's):
        its attention weights are recorded by that class (`output_attentions`), as by their module's name in the other
        families.
    norm, norm_eps: the family's norm, the class `<prefix><norm>` or torch's `nn.LayerNorm` (`LAYER_NORM`), and the
        config field of its eps, or `None` where the family's LayerNorms take torch's default (OPT). The model builds
        its final norm of that class (unless `parts` names the family's own); the depth steps' key norms take the eps
        too.
    llama_norm: the family's norm computes Llama's function (`LlamaRMSNorm`, which Transformers copies into each
        such family). The model then holds `AttnResRMSNorm` in its place, which computes a depth step's last phase
        fused with the normalisation (docs/design.md §6); other norms (Gemma's `1 + w`, OLMo 2's gain in fp32, a
        LayerNorm) are the family's own, and read the step's result computed but where `norm_gain_offset` says
        otherwise.
    norm_gain_offset: where the family's norm is an RMSNorm that multiplies by its gain `offset + w` in fp32 and rounds
        after it (Gemma's `1 + w`: 1; OLMo 2's and GPT-OSS's `w`: 0), the offset; `None` for Llama's norm and for
        norms of another function. On an fp32 stream the rounding is a no-op and such a norm computes Llama's function
        with that gain, which a depth step's last phase is then fused with too (`modeling_attnres.FusableNorm`).
    scaled_embedding: the family's embedding module multiplies by sqrt(hidden_size) (`<prefix>TextScaledWordEmbedding`).
    embedding_scale: the family's model multiplies the token embeddings by sqrt(hidden_size) before it adds the
        positions (CTRL).
    embedding_dropout: the config field of the dropout the family's model applies to the embedding in training
        (StarCoder2), or `None`.
    embedding_scale_dtype: the dtype in which the family's model holds the sqrt(hidden_size) it multiplies the
        embedding by before the first layer, rounded to it (RecurrentGemma's `normalizer`, in bf16), or `None`.
    mup_embedding_scale: the config field that, when true, has the family's model multiply the embedding by
        sqrt(hidden_size) before the first layer (AFMoE's muP input scaling, `mup_enabled`), or `None`.
    final_norm_on_embeddings: the family's model passes the embeddings through its final norm before the first layer
        (NanoChat, whose norms hold no weights, so that the first and last pipeline stages may both hold it).
    embedding_multiplier, residual_multiplier, logits_divisor, logits_multiplier, logit_softcap: the config fields of
        the scalars the family's model applies to the embedding, to each sublayer's output, and to the logits (divided
        by the value as Granite's, multiplied by it as HyperCLOVA X's, or soft-capped at it), or `None`.
    float_logits: the family's `*ForCausalLM` casts its logits to fp32 before it soft-caps them, whatever the model's
        dtype (xLSTM's).
    z_loss: the config field of the coefficient of the z-loss, the mean over positions of the squared log-sum-exp of
        the logits, that the family's `*ForCausalLM` adds to the loss where the coefficient is positive (Bamba's
        `z_loss_coefficient`), or `None`.
    layer_residual_scale: the attribute of the family's decoder layer holding the scalar it multiplies each sublayer's
        output by, where the layer derives it from the config (MiniCPM3's `residual_scale`, scale_depth /
        sqrt(num_hidden_layers)), or `None`.
    head_input_divisor: the value of the family's config that its `*ForCausalLM` divides the hidden states by before
        its LM head (MiniCPM3's `logits_scaling`, a property of its config class: hidden_size / dim_model_base), or
        `None`.
    rotary_per_layer_type: the rotary embedding takes a layer type (Gemma 3, OLMo 3: bases per attention type).
    fp32_rotary_types: the layer types whose rotary embedding the family's model computes from the embeddings in fp32
        whatever the model's dtype (Dots 3 Note's indexed attention).
    rope_theta_per_layer: the config field of each layer's RoPE base, `0` for a layer without rotary embedding
        (Granite MoE SWA's `layer_rope_theta`), or `None`. The model then builds the family's rotary embedding once per
        base (`RotaryEmbeddingPerBase`), as the family's model does, and each layer reads the one of its base.
    rope_layer_types: the layer types whose attention the family's model gives the rotary embedding, the others none
        (LaRA Mini's windowed layers; its global ones are NoPE), or `None` for every type.
    optional_rope: the family's model builds its rotary embedding only where the config's `rope_parameters` set a
        `rope_theta` (OLMo Hybrid's released checkpoints set none, and are NoPE).
    rotary_embedding: the suffix of the family's rotary-embedding class (Qwen3.5's text model has its own), or `None`
        where the family's model has none and its attention reads no position embeddings (GPT-2's learned positions are
        added to the embeddings; Kimi Linear's latent attention is NoPE).
    rope_switch: the config field that turns the family's rotary embedding on with the value `"rope"` (Granite 4's
        `position_embedding_type`), or `None` where the family's model always has it; off, its attention reads no
        position embeddings.
    moe: how the family's sparse MoE layers are found and trained (`Moe`), or `None` for a dense family.
    decoder_layer, causal_lm: the suffixes of the family's decoder-layer and causal-LM classes (GPT-2's `GPT2Block`
        and `GPT2LMHeadModel`).
    layer_decoder_layers: for hybrids whose model builds each layer type with a class of its own (OLMo Hybrid's
        `AttentionDecoderLayer` and `LinearAttentionDecoderLayer`, Jamba's `AttentionDecoderLayer` and
        `MambaDecoderLayer`), those classes' suffixes by layer type, in place of `decoder_layer`, or `None`.
    layer_buffers: `(path, function)`: the buffers, not persistent, that the family's model registers on modules of
        each decoder layer, by their path under the layer and the function of the family's modeling module that
        computes them from the config (Falcon-H1's `mamba.mup_vector`, by `compute_mup_vector`).
    cache_setup: the method of the family's `*PreTrainedModel` that its model calls with `(config, batch, device,
        dtype)` as it starts a cache, to reset the state its modules hold themselves (RecurrentGemma's
        `_setup_cache`), or `None`.
    layer_takes_index: the family's decoder-layer class takes its layer index after the config; xLSTM's
        `xLSTMBlock(config)` takes the config alone.
    layer_type: the type of every layer where the config has no `layer_types` and the family's layers read no mask
        (xLSTM's, `STATEFUL`), or `None`: then every layer is of an attention type (`layer_types`).
    own_cache: the family's own cache object (`OwnCache`), where its model keeps its layers' state in one that is not
        a Transformers `Cache`, or `None`.
    layer_type_argument: the keyword under which the family's model passes a decoder layer its type (Bamba's
        `layer_type`, from `layers_block_type`), or `None` where the layer reads it from the config.
    parts: the modules of the family's model around the layers that the AttnRes model takes from it (`ModelParts`),
        where they are not Llama's, or `None`.
    checkpoint_renamings: `(pattern, replacement)` regular expressions that rename the family's checkpoint names to
        the model's, in order, where its model holds the layers and the modules around them under other names than
        Llama's `model.layers`, `model.embed_tokens` and `model.norm` (GPT-2's `transformer.h`, `transformer.wte`,
        `transformer.ln_f`): the conversion applies them after Transformers' own renamings for the family.
    initializer_range: the config field of the standard deviation of the family's initialisation (OPT's `init_std`),
        which the comparison residuals initialise their parameters with too; `None` where the config has none
        (RecurrentGemma), for Transformers' default.
    output_vocab: the config field of the size of the family's LM head where it may be pruned below the vocabulary
        (Apertus 1.5 keeps the text-only prefix of the ids; the field's `None` keeps them all), or `None`.
    attention_bias: the bias on the attention scores that the family's model builds and hands to every layer
        (`AttentionBias`: MPT's and BLOOM's ALiBi), or `None`.
    boolean_mask: the family's model hands its attention the causal mask as booleans, true where masked (MPT casts
        the additive mask to `torch.bool`).
    lm_head_bias: the config field that, when true, gives the family's LM head a bias (Phi-3.5-MoE's
        `lm_head_bias`), `True` where it always has one (CTRL's), or `None` where it never has one.
    prediction_head: the suffix of the class of the module that the family's `*ForCausalLM` applies to the model's
        output before its LM head (ModernBERT's decoder: `PredictionHead`, a dense layer, its activation and a
        LayerNorm, held as `lm_head` beside the LM head `decoder`), or `None`. The AttnRes causal LM holds it as
        `prediction_head`, to which `checkpoint_renamings` renames the family's name for it.
    unpadded_vocab: the config field of the number of logits the family's `*ForCausalLM` keeps of its LM head's, the
        rest being padding rows it drops (Inkling's `unpadded_vocab_size`; the field's `None` keeps them all), or
        `None`.
    since: the first Transformers version the row holds for; with an older one the family has no row (AFMoE and Aria
        from 5.19: with 5.16 AFMoE's greedy generation differs from the family's own, and an Aria checkpoint saved
        there computes other logits in 5.19; Jamba from 5.21, its router's class; Falcon-H1 from 5.23, before which
        its own generation fails on its tests' checkpoint; RecurrentGemma from 5.23, its config's `layer_types`;
        JetMoE, Inkling, ModernBERT's decoder and DBRX from 5.25, the version tested, 5.16's JetMoE recording its
        attention's router logits twice, 5.16's Inkling holding its embedding's norm apart, 5.16's ModernBERT
        decoder computing its loss with a loss of its own and 5.16's DBRX experts config refusing fields that its own
        `to_dict` writes, so that no config is built from another's fields).
    """

    model_type: str
    module: str
    prefix: str
    sublayers: tuple[Sublayer, ...] = PRE_NORM
    layer_sublayers: dict[str, tuple[Sublayer, ...]] | None = None
    recorded_attention: str | None = None
    norm: str = "RMSNorm"
    norm_eps: str | None = "rms_norm_eps"
    llama_norm: bool = True
    norm_gain_offset: int | None = None
    scaled_embedding: bool = False
    embedding_scale: bool = False
    embedding_dropout: str | None = None
    embedding_scale_dtype: torch.dtype | None = None
    mup_embedding_scale: str | None = None
    final_norm_on_embeddings: bool = False
    embedding_multiplier: str | None = None
    residual_multiplier: str | None = None
    logits_divisor: str | None = None
    logits_multiplier: str | None = None
    logit_softcap: str | None = None
    float_logits: bool = False
    z_loss: str | None = None
    layer_residual_scale: str | None = None
    head_input_divisor: str | None = None
    rotary_per_layer_type: bool = False
    fp32_rotary_types: tuple[str, ...] = ()
    rope_theta_per_layer: str | None = None
    rope_layer_types: tuple[str, ...] | None = None
    optional_rope: bool = False
    rotary_embedding: str | None = "RotaryEmbedding"
    rope_switch: str | None = None
    moe: Moe | None = None
    model_prefix: str | None = None
    decoder_layer: str = "DecoderLayer"
    causal_lm: str = "ForCausalLM"
    layer_decoder_layers: dict[str, str] | None = None
    layer_type_argument: str | None = None
    layer_takes_index: bool = True
    layer_type: str | None = None
    own_cache: OwnCache | None = None
    layer_buffers: tuple[tuple[str, str], ...] = ()
    cache_setup: str | None = None
    parts: ModelParts | None = None
    checkpoint_renamings: tuple[tuple[str, str], ...] = ()
    initializer_range: str | None = "initializer_range"
    output_vocab: str | None = None
    attention_bias: AttentionBias | None = None
    boolean_mask: bool = False
    lm_head_bias: str | bool | None = None
    prediction_head: str | None = None
    unpadded_vocab: str | None = None
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
        """The family's config value `name` for `config`: a field, a field of a sub-config by its dotted path (DBRX's
        `ffn_config.moe_loss_weight`), or a property of the family's config class (MiniCPM3's `logits_scaling`),
        which `config` does not have but holds the fields of."""
        attribute = getattr(self.config_class, name, None)
        return attribute.fget(config) if isinstance(attribute, property) else operator.attrgetter(name)(config)

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
        if self.parts is not None:  # the modules around the layers, under the model's names (Nemotron-H's `embeddings`)
            parts = self.parts
            names = {parts.tokens: "embed_tokens", parts.positions: "embed_positions", parts.norm: "norm"}
            plan = {names.get(pattern, pattern): style for pattern, style in plan.items()}
        if self.moe and self.moe.mixtral_experts and not any(".experts" in pattern for pattern in plan):
            prefix = f"layers.*.{self.moe.module}."
            plan.update({prefix + pattern: style for pattern, style in EXPERTS_TP_PLAN.items()})
        return plan or None

    @property
    def ep_plan(self) -> dict[str, str] | None:
        return getattr(self.config_class, "base_model_ep_plan", None) if self.moe else None

    def rotary_embedding_of(self, config) -> nn.Module | None:
        """The family's rotary embedding for `config`, or `None` where its model has none (`rotary_embedding`,
        `rope_switch`); one per base where the family's layers have bases of their own (`rope_theta_per_layer`)."""
        if self.rotary_embedding is None or self.rope_switch and getattr(config, self.rope_switch) != "rope":
            return None
        if self.optional_rope and (config.rope_parameters or {}).get("rope_theta") is None:
            return None
        if self.rope_theta_per_layer is not None:
            bases = getattr(config, self.rope_theta_per_layer)
            return RotaryEmbeddingPerBase(self.cls(self.rotary_embedding), config, bases)
        return self.cls(self.rotary_embedding)(config)

    @property
    def rotary_per_layer(self) -> bool:
        """The rotary embedding is called with each layer's key (`rotary_type`): bases per attention type or per
        layer."""
        return self.rotary_per_layer_type or self.rope_theta_per_layer is not None

    def rotary_type(self, config, layer_idx: int):
        """The key of the position embeddings decoder layer `layer_idx` reads: its RoPE base where the family's
        layers have bases of their own, else its attention type (`layer_types`); `None` where the family's model gives
        the layer no rotary embedding (a base of `0`, a type outside `rope_layer_types`)."""
        if self.rope_theta_per_layer is not None:
            return getattr(config, self.rope_theta_per_layer)[layer_idx] or None
        kind = layer_types(config)[layer_idx]
        return kind if self.rope_layer_types is None or kind in self.rope_layer_types else None

    def decoder_layer_of(self, config, layer_idx: int) -> nn.Module:
        """Decoder layer `layer_idx` built as the family's model builds it: with the class of its layer type
        (`layer_decoder_layers`) or the family's one, given its type where the family's model gives it
        (`layer_type_argument`)."""
        kind = config.layer_types[layer_idx] if self.layer_decoder_layers or self.layer_type_argument else None
        layer_class = self.cls(self.layer_decoder_layers[kind] if self.layer_decoder_layers else self.decoder_layer)
        index = (layer_idx,) if self.layer_takes_index else ()
        if self.layer_type_argument is not None:
            return layer_class(config, *index, **{self.layer_type_argument: kind})
        return layer_class(config, *index)

    def sublayers_of(self, config, layer_idx: int) -> tuple[Sublayer, ...]:
        """The sublayers of decoder layer `layer_idx`, in order: its token mixer and its MLP, or its one mixer."""
        if self.layer_sublayers is None:
            return self.sublayers
        return self.layer_sublayers[config.layer_types[layer_idx]]

    @property
    def shared_states(self) -> SharedStates | None:
        """The object the family's attention shares between layers (`Sublayer.shared`: Kolibri 1.1's), or `None`."""
        layers = (self.layer_sublayers or {None: self.sublayers}).values()
        return next((sublayer.shared for sublayers in layers for sublayer in sublayers if sublayer.shared), None)

    def threaded_layers(self, config) -> tuple[int, ...]:
        """The layers whose attention returns a tensor that the next layer's attention takes (`Sublayer.threaded`):
        both layers thread it, and the layer is the first that starts it (`Sublayer.threaded_from`) or a later one."""

        def threading(layer_idx: int) -> Sublayer | None:
            return next((sublayer for sublayer in self.sublayers_of(config, layer_idx) if sublayer.threaded), None)

        layers = []
        for layer_idx in range(config.num_hidden_layers - 1):
            sublayer = threading(layer_idx)
            if sublayer is None or threading(layer_idx + 1) is None:
                continue
            starts = self.config_value(config, sublayer.threaded_from) if sublayer.threaded_from else (0,)
            if any(start <= layer_idx for start in starts):
                layers.append(layer_idx)
        return tuple(layers)

    def layer_offsets(self, config) -> tuple[int, ...]:
        """Where each decoder layer's sublayers sit among the model's L (docs/design.md §1): entry i is the number of
        sublayers in layers 0 .. i - 1, so layer i holds positions `offsets[i] + 1 .. offsets[i + 1]`, and the last
        entry is L."""
        offsets = [0]
        for layer_idx in range(config.num_hidden_layers):
            offsets.append(offsets[-1] + len(self.sublayers_of(config, layer_idx)))
        return tuple(offsets)

    @property
    def num_sublayers_formula(self) -> str:
        """L in terms of the config, as messages state it: `2 * num_hidden_layers` where every layer holds a mixer and
        an MLP, `num_hidden_layers` where every layer holds one mixer."""
        counts = {len(sublayers) for sublayers in (self.layer_sublayers or {None: self.sublayers}).values()}
        if len(counts) > 1:
            return "the sum of the layers' sublayers"
        count = counts.pop()
        return "num_hidden_layers" if count == 1 else f"{count} * num_hidden_layers"

    @property
    def router_recorder(self) -> tuple[type | None, str | None, int]:
        """How the model records the router logits of an MoE family: the router's class or its name under a
        decoder layer (`Moe.router_class`), and the index of the logits in its output."""
        if self.moe.router_class is not None:
            return getattr(self.modeling, self.moe.router_class), None, self.moe.logits_index
        return None, self.moe.router, self.moe.logits_index

    def initializer_std(self, config) -> float:
        """The standard deviation of the family's initialisation (`initializer_range`), Transformers' default where
        the family's config has no field for it."""
        return DEFAULT_INITIALIZER_RANGE if self.initializer_range is None else getattr(config, self.initializer_range)

    def load_balancing_loss(self, config, router_logits: tuple, attention_mask) -> torch.Tensor | None:
        """The family's load-balancing loss over the recorded router logits, as its `*ForCausalLM` computes it, or
        `None` where the family has none."""
        if not (self.moe and self.moe.load_balancing_loss):
            return None
        experts = self.config_value(config, self.moe.experts)
        top_k = self.config_value(config, self.moe.top_k)
        return self.modeling.load_balancing_loss_func(router_logits, experts, top_k, attention_mask)

    def model_parts(self, config) -> nn.Module | None:
        """The family's model (`ModelParts.model`) built from `config` without decoder layers: the modules around
        them, made by the family's own code; `None` where `parts` is."""
        if self.parts is None:
            return None
        config = copy.deepcopy(config)
        for field in self.parts.layer_counts:
            setattr(config, field, 0)
        # The AttnRes model's experts implementation is for its layers' experts; this model has none to set it for.
        config._experts_implementation = None
        # Nor layers to checkpoint, which a config's legacy `gradient_checkpointing=True` has its `post_init` look for.
        config.gradient_checkpointing = False
        # Left uninitialised: the AttnRes model initialises them, as every module, with the family's `_init_weights`
        # and the whole config (ModernBERT decoder's scales its standard deviations by the number of layers).
        with no_init_weights():
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


GEMMA = dict(llama_norm=False, norm_gain_offset=1, scaled_embedding=True)
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
# The modules of MPT's and DBRX's models, under `transformer`: the embedding `wte`, the layers `blocks` and the final
# norm `norm_f`.
BLOCKS_PARTS = ModelParts(tokens="wte", positions=None, norm="norm_f")
BLOCKS_RENAMINGS = (
    (r"^(transformer\.)?wte\.", "model.embed_tokens."),
    (r"^(transformer\.)?blocks\.", "model.layers."),
    (r"^(transformer\.)?norm_f\.", "model.norm."),
)
# MPT: ALiBi over `max_seq_len` positions that its model builds once, the causal mask handed over as booleans,
# LayerNorms without bias, an MLP that adds the residual itself; the layers under `transformer.blocks`.
MPT = dict(
    sublayers=(
        Sublayer("attn", "norm_1", ("resid_attn_dropout",)),
        Sublayer("ffn", "norm_2", call=FEED_FORWARD, residual_argument="residual"),
    ),
    norm=LAYER_NORM,
    norm_eps="layer_norm_epsilon",
    llama_norm=False,
    rotary_embedding=None,
    decoder_layer="Block",
    parts=BLOCKS_PARTS,
    checkpoint_renamings=BLOCKS_RENAMINGS,
    attention_bias=AttentionBias("position_bias", "build_mpt_alibi_tensor", max_positions="max_seq_len"),
    boolean_mask=True,
)
# BLOOM: ALiBi counted over the padding mask, a LayerNorm on the embeddings, an attention and an MLP that add the
# residual themselves; the layers under `transformer.h`.
BLOOM = dict(
    sublayers=(
        Sublayer("self_attention", "input_layernorm", cache_argument="layer_past", residual_argument="residual"),
        Sublayer("mlp", "post_attention_layernorm", call=FEED_FORWARD, residual_argument="residual"),
    ),
    norm=LAYER_NORM,
    norm_eps="layer_norm_epsilon",
    llama_norm=False,
    rotary_embedding=None,
    decoder_layer="Block",
    parts=ModelParts("Model", "word_embeddings", None, "ln_f", embedding_norm="word_embeddings_layernorm"),
    checkpoint_renamings=(
        (r"^(transformer\.)?word_embeddings_layernorm\.", "model.embedding_norm."),
        (r"^(transformer\.)?word_embeddings\.", "model.embed_tokens."),
        (r"^(transformer\.)?h\.", "model.layers."),
        (r"^(transformer\.)?ln_f\.", "model.norm."),
    ),
    attention_bias=AttentionBias("alibi", "build_alibi_tensor"),
)
# GPT-NeoX Japanese: a sequential residual, each branch through a dropout (the attention's with its output
# projection's bias first, in the last layer); the layers under `gpt_neox_japanese.layers`, the head `embed_out`.
GPT_NEOX_JAPANESE = dict(
    sublayers=(
        Sublayer("attention", "input_layernorm", cache_argument="layer_past", output_bias=2, dropout="hidden_dropout"),
        Sublayer("mlp", "post_attention_layernorm", call=FEED_FORWARD, dropout="hidden_dropout"),
    ),
    norm=LAYER_NORM,
    norm_eps="layer_norm_eps",
    llama_norm=False,
    decoder_layer="Layer",
    # by class: its module name, `attention`, is also that of GPT-Neo's inner attention, which would be counted twice
    recorded_attention="Attention",
    parts=ModelParts("Model", "embed_in", None, "final_layer_norm"),
    checkpoint_renamings=(
        (r"^(gpt_neox_japanese\.)?embed_in\.", "model.embed_tokens."),
        (r"^(gpt_neox_japanese\.)?layers\.", "model.layers."),
        (r"^(gpt_neox_japanese\.)?final_layer_norm\.", "model.norm."),
        (r"^embed_out\.", "lm_head."),
    ),
)
# The Mamba families and Nemotron-H: layers of one mixer (`Block`s) with no rotary embedding, the token embedding and
# the final norm of the family's model (`embeddings`, `norm_f`, without a padding row), the layers and those under
# `backbone` (older Mamba checkpoints name the embedding `embedding`) or, in Nemotron-H, `model`.
MAMBA_PARTS = ModelParts(tokens="embeddings", positions=None, norm="norm_f")
MAMBA = dict(
    norm_eps="layer_norm_epsilon",
    rotary_embedding=None,
    decoder_layer="Block",
    parts=MAMBA_PARTS,
    checkpoint_renamings=(
        (r"^(backbone\.)?embeddings?\.", "model.embed_tokens."),
        (r"^(backbone\.)?layers\.", "model.layers."),
        (r"^(backbone\.)?norm_f\.", "model.norm."),
    ),
    # Tested on 5.25; on 5.16 a cache of Mamba layers alone cannot count the positions it holds (`get_seq_length`
    # asks for an attention layer), and Nemotron-H's norms are Llama's.
    since=(5, 25),
)
# DeepSeek-V3, GLM-4.5: a routing bias balances the experts, and their `*ForCausalLM` adds no loss.
NO_LOAD_BALANCING_LOSS = Moe(load_balancing_loss=False)
# The final norm of Jamba's and Bamba's models, `final_layernorm`.
FINAL_LAYERNORM = ((r"^model\.final_layernorm\.", "model.norm."),)
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
        Family("olmo2", "olmo2", "Olmo2", POST_BRANCH_NORM, llama_norm=False, norm_gain_offset=0),
        Family(
            "olmo3",
            "olmo3",
            "Olmo3",
            POST_BRANCH_NORM,
            llama_norm=False,
            norm_gain_offset=0,
            rotary_per_layer_type=True,
        ),
        Family("ministral", "ministral", "Ministral"),
        Family("glm4", "glm4", "Glm4", GLM4_NORMS),
        Family("ernie4_5", "ernie4_5", "Ernie4_5"),
        Family("seed_oss", "seed_oss", "SeedOss"),
        Family("helium", "helium", "Helium", llama_norm=False, norm_gain_offset=0),
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
        Family(
            "gpt_oss",
            "gpt_oss",
            "GptOss",
            llama_norm=False,
            norm_gain_offset=0,
            moe=Moe(router="mlp.router", mixtral_experts=False, router_class="GptOssTopKRouter"),
        ),
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
            norm_gain_offset=0,
            moe=Moe(
                router="feed_forward.router",
                logits_index=1,
                load_balancing_loss=False,
                mixtral_experts=False,
                router_class="Llama4Router",
            ),
            model_prefix="Llama4",
        ),
        Family("hy_v3", "hy_v3", "HYV3", moe=Moe(load_balancing_loss=False)),
        Family("flint", "flint", "Flint", llama_norm=False, norm_gain_offset=0, moe=Moe("num_experts")),
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
                router_class="AriaTextTopKRouter",
            ),
            since=(5, 19),
        ),
        Family("exaone_moe", "exaone_moe", "ExaoneMoe", moe=Moe("num_experts", load_balancing_loss=False)),
        Family("dots1", "dots1", "Dots1", moe=NO_LOAD_BALANCING_LOSS),
        Family("deepseek_v2", "deepseek_v2", "DeepseekV2", moe=Moe("num_experts", load_balancing_loss=False)),
        Family("glm4_moe_lite", "glm4_moe_lite", "Glm4MoeLite", moe=NO_LOAD_BALANCING_LOSS),
        Family("axk1", "axk1", "AXK1", moe=NO_LOAD_BALANCING_LOSS),
        Family("deepseek_v32", "deepseek_v32", "DeepseekV32", moe=NO_LOAD_BALANCING_LOSS),
        # Dots 3 Note's text decoder: DeepSeek-V3.2's indexed latent attention and windowed latent attention of other
        # shapes (`per_layer_config`), a RoPE base per layer type.
        Family(
            "dots3_note_text",
            "dots3_note",
            "Dots3Note",
            decoder_layer="TextDecoderLayer",
            rotary_embedding="TextRotaryEmbedding",
            rotary_per_layer_type=True,
            fp32_rotary_types=("indexed_attention",),
            moe=NO_LOAD_BALANCING_LOSS,
        ),
        # GLM-5: DeepSeek-V3.2's sparse attention, whose `shared` layers reuse the keys the last indexer chose.
        Family(
            "glm_moe_dsa",
            "glm_moe_dsa",
            "GlmMoeDsa",
            (Sublayer("self_attn", "input_layernorm", threaded="prev_topk_indices"), PRE_NORM[1]),
            moe=NO_LOAD_BALANCING_LOSS,
        ),
        # The norms before attention, and before the MoE in MoE layers, gate their output (`AXK2GatedRMSNorm`).
        Family("axk2", "axk2", "AXK2", moe=NO_LOAD_BALANCING_LOSS),
        Family(
            "flex_olmo",
            "flex_olmo",
            "FlexOlmo",
            POST_BRANCH_NORM,
            llama_norm=False,
            norm_gain_offset=0,
            moe=Moe("num_experts"),
        ),
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
            norm_gain_offset=0,
            mup_embedding_scale="mup_enabled",
            moe=Moe(
                "num_experts",
                router="mlp.router",
                load_balancing_loss=False,
                router_class="AfmoeTokenChoiceRouter",
            ),
            since=(5, 19),
        ),
        Family(
            "qwen3_next",
            "qwen3_next",
            "Qwen3Next",
            layer_sublayers=GATED_DELTANET,
            llama_norm=False,
            norm_gain_offset=1,
            moe=Moe("num_experts"),
        ),
        # Qwen3.5's text decoders: multimodal rotary sections over text positions.
        Family(
            "qwen3_5_text",
            "qwen3_5",
            "Qwen3_5",
            layer_sublayers=GATED_DELTANET,
            llama_norm=False,
            norm_gain_offset=1,
            rotary_embedding="TextRotaryEmbedding",
        ),
        Family(
            "qwen3_5_moe_text",
            "qwen3_5_moe",
            "Qwen3_5Moe",
            layer_sublayers=GATED_DELTANET,
            llama_norm=False,
            norm_gain_offset=1,
            rotary_embedding="TextRotaryEmbedding",
            moe=Moe("num_experts"),
        ),
        Family("gpt2", "gpt2", "GPT2", GPT2_SUBLAYERS, causal_lm="LMHeadModel", **GPT2),
        Family("gpt_neo", "gpt_neo", "GPTNeo", LAYER_PAST_SUBLAYERS, **{**GPT2, "embedding_dropout": "embed_dropout"}),
        Family("gpt_bigcode", "gpt_bigcode", "GPTBigCode", LAYER_PAST_SUBLAYERS, **GPT2),
        Family("opt", "opt", "OPT", **OPT),
        Family("biogpt", "biogpt", "BioGpt", **BIOGPT),
        Family("xglm", "xglm", "XGLM", **XGLM),
        Family("mpt", "mpt", "Mpt", **MPT),
        Family("bloom", "bloom", "Bloom", **BLOOM),
        Family("gpt_neox_japanese", "gpt_neox_japanese", "GPTNeoXJapanese", **GPT_NEOX_JAPANESE),
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
        # Windowed and full attention with RoPE bases per type and gated heads (Laguna), q/k norms (Mellum); dense
        # layers among MoE ones with a shared expert (Laguna).
        Family("laguna", "laguna", "Laguna", rotary_per_layer_type=True, moe=Moe("num_experts")),
        Family("mellum", "mellum", "Mellum", rotary_per_layer_type=True, moe=Moe("num_experts")),
        # Phi-3.5-MoE: LayerNorms, sparsemixer routing, a bias on the LM head.
        Family(
            "phimoe",
            "phimoe",
            "Phimoe",
            norm=LAYER_NORM,
            llama_norm=False,
            moe=Moe(router="mlp.router", router_class="PhimoeTopKRouter"),
            lm_head_bias="lm_head_bias",
        ),
        # Grouped sigmoid routing with a routing bias, and no loss.
        Family("minicpm5_moe", "minicpm5_moe", "MiniCPM5Moe", moe=NO_LOAD_BALANCING_LOSS),
        # MiniMax M3's text decoder: Gemma's `1 + w` norms, sparse attention layers whose indexer picks key blocks
        # from the causal mask, dense layers among MoE ones with a shared expert.
        Family("minimax_m3_vl_text", "minimax_m3_vl", "MiniMaxM3VL", llama_norm=False, norm_gain_offset=1, moe=MOE),
        # Param2 and Sarvam-30B run GLM-4.5's model, Sarvam-105B DeepSeek-V3's, on configs of their own.
        Family("param2moe", "glm4_moe", "Glm4Moe", moe=NO_LOAD_BALANCING_LOSS),
        Family("sarvam_moe", "glm4_moe", "Glm4Moe", moe=NO_LOAD_BALANCING_LOSS),
        Family("sarvam_mla", "deepseek_v3", "DeepseekV3", moe=NO_LOAD_BALANCING_LOSS),
        # Granite MoE Shared with windowed layers among full ones, attention sinks and a RoPE base per layer (none in
        # some).
        # Granite with windows, its RoPE base set per layer (0: NoPE), as Granite MoE SWA's.
        Family(
            "granite_swa", "granite_swa", "GraniteSWA", rope_theta_per_layer="layer_rope_theta", **GRANITE_MULTIPLIERS
        ),
        Family(
            "granitemoe_swa",
            "granitemoe_swa",
            "GraniteMoeSWA",
            (PRE_NORM[0], GRANITE_SHARED_MOE),
            rope_theta_per_layer="layer_rope_theta",
            moe=Moe(router="block_sparse_moe.router"),
            **GRANITE_MULTIPLIERS,
        ),
        # Linear attention between attention layers, a dense first layer, then grouped sigmoid routing with a routing
        # bias and a shared expert, and no loss.
        Family(
            "bailing_hybrid",
            "bailing_hybrid",
            "BailingHybrid",
            layer_sublayers=KIMI_DELTA_ATTENTION,
            moe=NO_LOAD_BALANCING_LOSS,
        ),
        # Gated DeltaNet layers between windowed layers with RoPE and global NoPE ones, each followed by the MoE with a
        # shared expert.
        Family(
            "lara_mini",
            "lara_mini",
            "LaraMini",
            layer_sublayers={**GATED_DELTANET, "sliding_attention": PRE_NORM},
            llama_norm=False,
            norm_gain_offset=0,
            rope_layer_types=("sliding_attention",),
            moe=Moe("num_experts"),
        ),
        # Gated DeltaNet layers with pre-norms between attention layers with OLMo 2's norms after each branch, each
        # its own decoder-layer class; RoPE (where the config sets a base) in the attention layers only.
        Family(
            "olmo_hybrid",
            "olmo_hybrid",
            "OlmoHybrid",
            layer_sublayers={
                "full_attention": POST_BRANCH_NORM,
                "linear_attention": GATED_DELTANET["linear_attention"],
            },
            llama_norm=False,
            norm_gain_offset=0,
            rope_layer_types=("full_attention",),
            optional_rope=True,
            layer_decoder_layers={
                "full_attention": "AttentionDecoderLayer",
                "linear_attention": "LinearAttentionDecoderLayer",
            },
        ),
        # Windowed layers with RoPE and sparse NoPE ones that pick their keys from the candidates of the last indexer
        # (`index_layers`), some reading the keys and values of an earlier layer; GLM-4's norms after each branch; dense
        # first layers, then sigmoid routing with a routing bias and a shared expert, and no loss.
        Family(
            "kolibri1_1",
            "kolibri1_1",
            "Kolibri1_1",
            (
                Sublayer(
                    "self_attn",
                    "input_layernorm",
                    ("post_self_attn_layernorm",),
                    threaded="index_pool",
                    threaded_from="index_layers",
                    shared=SharedStates("shared_kv_states", "KVSharingDict", "kv_source_layers", 2),
                ),
                GLM4_NORMS[1],
            ),
            moe=Moe(load_balancing_loss=False),
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
        # Mamba's and Mamba 2's norms compute Llama's function in code of their own (the test compares the code).
        Family("mamba", "mamba", "Mamba", MAMBA_MIXER, llama_norm=False, norm_gain_offset=0, **MAMBA),
        Family("mamba2", "mamba2", "Mamba2", MAMBA_MIXER, llama_norm=False, norm_gain_offset=0, **MAMBA),
        Family("falcon_mamba", "falcon_mamba", "FalconMamba", MAMBA_MIXER, **MAMBA),
        # Its norms apply the gain in fp32; sigmoid routing with a bias, no loss, the experts an MLP without a gate.
        Family(
            "nemotron_h",
            "nemotron_h",
            "NemotronH",
            layer_sublayers=NEMOTRON_H_MIXERS,
            llama_norm=False,
            norm_gain_offset=0,
            moe=Moe(
                "n_routed_experts",
                router="mixer.gate",
                load_balancing_loss=False,
                mixtral_experts=False,
                gated_experts=False,
            ),
            recorded_attention="Attention",
            **{
                **MAMBA,
                "checkpoint_renamings": (
                    (r"^model\.embeddings\.", "model.embed_tokens."),
                    (r"^model\.norm_f\.", "model.norm."),
                ),
            },
        ),
        # Jamba: a class of decoder layer per type, NoPE attention, MoE every `expert_layer_period` layers.
        Family(
            "jamba",
            "jamba",
            "Jamba",
            layer_sublayers=MAMBA_HYBRID,
            layer_decoder_layers={"full_attention": "AttentionDecoderLayer", "linear_attention": "MambaDecoderLayer"},
            rotary_embedding=None,
            moe=Moe("num_experts", router="feed_forward.router", router_class="JambaTopKRouter"),
            checkpoint_renamings=FINAL_LAYERNORM,
            since=(5, 21),
        ),
        Family(
            "bamba",
            "bamba",
            "Bamba",
            layer_sublayers=MAMBA_HYBRID,
            layer_type_argument="layer_type",
            z_loss="z_loss_coefficient",
            checkpoint_renamings=FINAL_LAYERNORM,
        ),
        # Falcon-H1: muP multipliers on the embedding, on the logits and inside the modules.
        Family(
            "falcon_h1",
            "falcon_h1",
            "FalconH1",
            layer_sublayers=FALCON_H1_LAYER,
            layer_buffers=(("mamba.mup_vector", "compute_mup_vector"),),
            embedding_multiplier="embedding_multiplier",
            logits_multiplier="lm_head_multiplier",
            checkpoint_renamings=FINAL_LAYERNORM,
            since=(5, 23),
        ),
        # RecurrentGemma: each temporal block holds its own recurrent state and computes its own rotary embedding.
        Family(
            "recurrent_gemma",
            "recurrent_gemma",
            "RecurrentGemma",
            layer_sublayers=GRIFFIN,
            llama_norm=False,
            norm_gain_offset=1,
            embedding_scale_dtype=torch.bfloat16,
            logit_softcap="logits_soft_cap",
            rotary_embedding=None,
            initializer_range=None,  # its initialisation scales each module by its own variances
            cache_setup="_setup_cache",
            checkpoint_renamings=((r"^model\.final_norm\.", "model.norm."),),
            since=(5, 23),
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
            final_norm_on_embeddings=True,
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
        # JetMoE: a mixture of attention heads (experts of query and output projections over shared keys and values,
        # its own router) and an MoE, each with an output bias; the layers' norms at their class's eps, the final one
        # at the config's.
        Family(
            "jetmoe",
            "jetmoe",
            "JetMoe",
            (Sublayer("self_attention", "input_layernorm"), PRE_NORM[1]),
            moe=Moe(
                router="mlp.router",
                logits_index=4,
                mixtral_experts=False,
                router_class="JetMoeTopKGating",
                attention_router="self_attention.experts.router",
                loss_coefficient="aux_loss_coef",
            ),
            # Tested on 5.25; 5.16's model records its attention's router logits twice (by the attention and by the
            # router), and its loss reads both.
            since=(5, 25),
        ),
        # Inkling's text decoder: a normed embedding; attention with q/k norms and a relative position bias computed
        # from the hidden states (no RoPE), its keys and values through short convolutions, full in every sixth layer
        # and windowed in the others; dense layers among MoE ones with shared experts, routed with a bias and no loss;
        # each branch through a short convolution; the LM head's input divided by its muP width, its padding logits
        # dropped.
        Family(
            "inkling_text",
            "inkling",
            "Inkling",
            layer_sublayers=INKLING_LAYER,
            rotary_embedding=None,
            head_input_divisor="logits_mup_width_multiplier",
            moe=Moe("n_routed_experts", load_balancing_loss=False),
            parts=ModelParts("TextModel", "embed_tokens", None, "norm"),
            unpadded_vocab="unpadded_vocab_size",
            # Tested on 5.25; in 5.16 its model holds the embedding's norm apart (`model.embed_norm`).
            since=(5, 25),
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
        # ModernBERT's decoder: LayerNorms without bias, the embedding's own LayerNorm and dropout before the first
        # layer (whose pre-norm is therefore an identity), windowed and full layers with RoPE bases per type, a
        # prediction head before the LM head `decoder`.
        Family(
            "modernbert-decoder",
            "modernbert_decoder",
            "ModernBertDecoder",
            (Sublayer("attn", "attn_norm"), Sublayer("mlp", "mlp_norm", call=FEED_FORWARD)),
            norm=LAYER_NORM,
            norm_eps="norm_eps",
            llama_norm=False,
            embedding_dropout="embedding_dropout",
            rotary_per_layer_type=True,
            decoder_layer="Layer",
            parts=ModelParts(
                tokens="embeddings.tok_embeddings", positions=None, norm="final_norm", embedding_norm="embeddings.norm"
            ),
            checkpoint_renamings=(
                (r"^model\.embeddings\.tok_embeddings\.", "model.embed_tokens."),
                (r"^model\.embeddings\.norm\.", "model.embedding_norm."),
                (r"^model\.final_norm\.", "model.norm."),
                (r"^lm_head\.", "prediction_head."),
                (r"^decoder\.", "lm_head."),
            ),
            lm_head_bias="decoder_bias",
            prediction_head="PredictionHead",
            # Tested on 5.25; on 5.16 its causal LM computes its loss with a `CrossEntropyLoss` of its own, whose
            # result differs from Transformers' loss function in the last bit.
            since=(5, 25),
        ),
        # CTRL: the token embeddings scaled by sqrt(n_embd) plus sinusoidal positions from a buffer, an attention called
        # with its input three times (`v`, `k`, `q`) and the cache as `layer_past`, LayerNorms, a ReLU MLP in an
        # `nn.Sequential`, a dropout after each branch, an LM head with a bias. Its decoder's classes have no prefix
        # (`EncoderLayer`), its models `CTRL`; the layers under `transformer.h`.
        Family(
            "ctrl",
            "ctrl",
            "",
            (
                Sublayer(
                    "multi_head_attention",
                    "layernorm1",
                    ("dropout1",),
                    cache_argument="layer_past",
                    input_argument=("v", "k", "q"),
                ),
                Sublayer("ffn", "layernorm2", ("dropout2",), call=FEED_FORWARD),
            ),
            model_prefix="CTRL",
            norm=LAYER_NORM,
            norm_eps="layer_norm_epsilon",
            llama_norm=False,
            embedding_scale=True,
            embedding_dropout="embd_pdrop",
            rotary_embedding=None,
            decoder_layer="EncoderLayer",
            causal_lm="LMHeadModel",
            parts=ModelParts("CTRLModel", "w", None, "layernorm", position_table="positional_encoding"),
            checkpoint_renamings=(
                (r"^(transformer\.)?w\.", "model.embed_tokens."),
                (r"^(transformer\.)?h\.", "model.layers."),
                (r"^(transformer\.)?layernorm\.", "model.norm."),
            ),
            lm_head_bias=True,
        ),
        # DBRX: each block's `norm_attn_norm` holds the attention (fused `Wqkv`, clipped) between the LayerNorms
        # (without bias) before each branch and adds the attention's output itself, so its modules are called one by
        # one; a dropout after each branch; the MoE under `ffn`, its settings in the config's `ffn_config`, its
        # experts three stacked matrices; the layers under `transformer.blocks`.
        Family(
            "dbrx",
            "dbrx",
            "Dbrx",
            (
                Sublayer("norm_attn_norm.attn", "norm_attn_norm.norm_1", dropout="resid_pdrop"),
                Sublayer("ffn", "norm_attn_norm.norm_2", call=FEED_FORWARD, dropout="resid_pdrop"),
            ),
            norm=LAYER_NORM,
            norm_eps=None,
            llama_norm=False,
            decoder_layer="Block",
            moe=Moe(
                "ffn_config.moe_num_experts",
                top_k="ffn_config.moe_top_k",
                router="ffn.router",
                mixtral_experts=False,
                loss_coefficient="ffn_config.moe_loss_weight",
            ),
            parts=BLOCKS_PARTS,
            checkpoint_renamings=BLOCKS_RENAMINGS,
            # Tested on 5.25; 5.16's `DbrxFFNConfig` refuses the `_name_or_path` and `output_attentions` of its own
            # `to_dict`, from which the conversion builds the AttnRes config.
            since=(5, 25),
        ),
        # xLSTM: each block an mLSTM layer, called with its recurrent state and returning the new one, which the model
        # keeps in its own `xLSTMCache`, then a gated MLP (`ffn`), each behind its own norm (with an optional bias and
        # fp32 reductions); no positions, no mask; the block takes no layer index; the logits soft-capped; the layers
        # under `backbone.blocks`.
        Family(
            "xlstm",
            "xlstm",
            "xLSTM",
            (
                Sublayer("mlstm_layer", "norm_mlstm", call=STATEFUL),
                Sublayer("ffn", "norm_ffn", call=FEED_FORWARD),
            ),
            norm_eps="norm_eps",
            llama_norm=False,
            logit_softcap="output_logit_soft_cap",
            float_logits=True,
            rotary_embedding=None,
            decoder_layer="Block",
            layer_takes_index=False,
            layer_type=STATEFUL,
            own_cache=OwnCache(),
            parts=ModelParts(
                tokens="embeddings", positions=None, norm="out_norm", layer_counts=("num_hidden_layers", "num_blocks")
            ),
            checkpoint_renamings=(
                (r"^(backbone\.)?embeddings\.", "model.embed_tokens."),
                (r"^(backbone\.)?blocks\.", "model.layers."),
                (r"^(backbone\.)?out_norm\.", "model.norm."),
            ),
            initializer_range=None,
        ),
    )
    if family.model_type in CONFIG_MAPPING and TRANSFORMERS_RELEASE >= family.since
}


# Transformers' standard deviation of an initialisation where a config has no `initializer_range` (RecurrentGemma).
DEFAULT_INITIALIZER_RANGE = 0.02
# The eps of torch's `nn.LayerNorm` where a family's config has no field for it (OPT).
LAYER_NORM_EPS = 1e-5


def norm_eps(config) -> float:
    """The eps of the norms of `config`'s family (`Family.norm_eps`)."""
    field = FAMILIES[config.family].norm_eps
    return LAYER_NORM_EPS if field is None else getattr(config, field)


def layer_types(config) -> list[str]:
    """Each decoder layer's attention type, as the family's model picks its mask: the config's `layer_types` where the
    family has them, else the family's `layer_type` for every layer where it has one (xLSTM's, which read no mask), else
    every layer windowed when the config sets a window (Mistral, Mixtral, Phi-3), else none.
    An empty list where the config cannot count its layers yet: an AttnRes config checking its given fields before
    its family's config has derived the others (Nemotron-H's `num_hidden_layers`, from its layer pattern)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return list(types)
    family = FAMILIES.get(getattr(config, "family", None))
    if family is not None and family.layer_type is not None:
        return [family.layer_type] * (getattr(config, "num_hidden_layers", None) or 0)
    kind = "sliding_attention" if getattr(config, "sliding_window", None) is not None else "full_attention"
    return [kind] * (getattr(config, "num_hidden_layers", None) or 0)
