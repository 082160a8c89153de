"""AttnRes: a Transformers decoder whose residual connections are softmax attention over depth.

Kimi Team, "Attention Residuals" (arXiv:2603.15031). The sublayers are the source family's own Transformers modules
(attention, MLP or MoE, norms, rotary embedding; `families.py` says which), built by the family's decoder-layer class
with their parameter names, so checkpoints of that family convert by copying tensors and the standard mode equals
the family's `*ForCausalLM`. What changes is what each sublayer reads: instead of the running residual stream, a
depth-mixing module (`depth_mixing.py`) in front of every sublayer and of the final norm computes its input from
everything the network has produced so far. The model's forward loop owns that depth state (`depth_state.py`) and
threads it through the decoder layers. The math is in docs/design.md.
"""

import inspect
import math
from collections.abc import Iterable
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from transformers import initialization as init

from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import (
    create_causal_mask,
    create_chunked_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
)
from transformers.modeling_layers import GenericForSequenceClassification, GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_attnres import AttnResConfig
from .depth_mixing import DepthAttention, DepthQuery, PendingInput, depth_mixer, gather_queries
from .depth_state import DepthContext, DepthState, StateLayout, flatten_state
from .families import (
    ATTENTION,
    FAMILIES,
    FEED_FORWARD,
    HYBRID_MASKS,
    HYBRID_SLIDING_MASKS,
    PositionTable,
    RECURRENT,
    STATEFUL,
    Family,
    Sublayer,
    layer_types,
    norm_eps,
)
from .two_phase import as_float32
from .transformers_compat import (
    CACHE_NAME,
    accepts_cache_params,
    accepts_past_key_values,
    keywords_taken,
    output_cache,
    output_with_cache,
    recurrent_cache_name,
)


# The attribute of a KV cache that holds the depth queries of the forward pass that started it
# (`AttnResModel.depth_queries`).
CACHED_QUERIES = "attnres_depth_queries"


class AttnResRMSNorm(LlamaRMSNorm):
    """Llama's RMSNorm (in fp32, cast back, then the gain), which Transformers copies into most families: the
    pre-norms and the final norm of those families (`Family.llama_norm`).

    A depth-attention step hands over its last phase uncomputed (a `PendingInput`, on every implementation alike),
    and the norm computes it fused with its own normalisation, so the sublayer input never goes through memory.
    """

    def forward(self, hidden_states: torch.Tensor | PendingInput) -> torch.Tensor:
        if isinstance(hidden_states, PendingInput):
            return hidden_states.normalized(self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


class FusableNorm(NamedTuple):
    """A family's RMSNorm that multiplies by its gain `offset + w` in fp32 and rounds after it (Gemma's, OLMo 2's:
    `Family.norm_gain_offset`). On an fp32 stream that rounding is a no-op and the norm computes `AttnResRMSNorm`'s
    function with that gain, so a depth step's last phase is fused with it there too; on a bf16 or fp16 stream the
    two round differently, and the norm reads the step's computed result.

    The fused form reads the norm's gain without calling it, so it serves only the family's own norm (not one an
    engine put in its place) whose gain is on the stream's device: where accelerate's hooks would move or load it
    first (`device_map`, offloading), the norm is called as usual.
    """

    norm_class: type[nn.Module]
    gain_offset: int
    eps_name: str

    @classmethod
    def of(cls, family: Family, norm: nn.Module | None) -> "FusableNorm | None":
        """How `norm`, one of the family's norms, is fused; `None` where it is not the family's fusable norm."""
        if family.norm_gain_offset is None or type(norm) is not family.norm_class:
            return None
        eps_name = "variance_epsilon" if hasattr(norm, "variance_epsilon") else "eps"
        return cls(type(norm), family.norm_gain_offset, eps_name)

    def normalized(self, norm: nn.Module, hidden_states: PendingInput) -> torch.Tensor | None:
        """`norm(hidden_states)` computed fused, or `None` where it cannot be."""
        if type(norm) is not self.norm_class or hidden_states.dtype != torch.float32:
            return None
        weight = norm.weight
        if weight.device != hidden_states.inputs[0].device:
            return None
        # The norm's own fp32 gain, in the stream's dtype, as the fused kernels take it. They add the offset
        # themselves: added here, it would be one more operation per sublayer and decoded token.
        return hidden_states.normalized(as_float32(weight), getattr(norm, self.eps_name), self.gain_offset)


def pre_norm(
    norm: nn.Module | None, hidden_states: torch.Tensor | PendingInput, fusable: FusableNorm | None = None
) -> torch.Tensor:
    """`norm(hidden_states)`, for the norm in front of a sublayer or of the output (none in front of OLMo 2's
    sublayers): a `PendingInput` goes to the model's own norm, which fuses it, or is computed fused with the family's
    norm where that is `fusable`, and is computed first for any other. Engines replace the norms with their own
    (vLLM's Transformers backend swaps every module it recognises as an RMSNorm) and must see the same function."""
    if isinstance(hidden_states, PendingInput):
        if isinstance(norm, AttnResRMSNorm):
            return norm(hidden_states)
        normalized = fusable.normalized(norm, hidden_states) if fusable is not None else None
        if normalized is not None:
            return normalized
        hidden_states = hidden_states.value()
    return hidden_states if norm is None else norm(hidden_states)


def no_mask(*args, **kwargs) -> None:
    return None


def hybrid_masks(config: AttnResConfig, *args, **kwargs) -> dict[str, torch.Tensor | None]:
    """The masks of a layer whose attention and recurrent mixer sit side by side (Falcon-H1's `hybrid` layers), or
    whose attention and short convolutions read both (Inkling's full-attention layers), by the kind each reads
    (`Sublayer.mask`, `Sublayer.padding_mask`): the attention's causal mask and the padding mask."""
    return {
        "full_attention": create_causal_mask(config, *args, **kwargs),
        "linear_attention": create_recurrent_attention_mask(config, *args, **kwargs),
    }


def hybrid_sliding_masks(config: AttnResConfig, *args, **kwargs) -> dict[str, torch.Tensor | None]:
    """The masks of Inkling's windowed layers (`hybrid_sliding`), by kind: the attention's windowed causal mask and
    the short convolutions' padding mask."""
    return {
        "sliding_attention": create_sliding_window_causal_mask(config, *args, **kwargs),
        "linear_attention": create_recurrent_attention_mask(config, *args, **kwargs),
    }


def attention_masks(
    config: AttnResConfig,
    attention_types: Iterable[str],
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
    position_ids: torch.LongTensor,
) -> dict[str, torch.Tensor | None]:
    """The mask of each of `attention_types` (`families.layer_types`), as the family's model makes them. A function
    of the config, so that a pipeline stage, which holds some of the layers, makes the masks its layers read."""
    mask_functions = {
        "full_attention": create_causal_mask,
        "sliding_attention": create_sliding_window_causal_mask,
        "chunked_attention": create_chunked_causal_mask,  # Llama 4
        "linear_attention": create_recurrent_attention_mask,
        # DeepSeek-V3.2's sparse attention: its indexer reads the causal mask even where attention could skip it. In
        # Transformers 5.16, under the name `deepseek_sparse_attention`, its model lets the mask be skipped.
        "indexed_attention": partial(create_causal_mask, allow_is_causal_skip=False),
        "deepseek_sparse_attention": create_causal_mask,
        "minimax_m3_sparse": create_causal_mask,  # MiniMax M3's sparse attention, whose indexer reads the causal mask
        "conv": create_recurrent_attention_mask,  # LFM2's short convolutions
        # Nemotron-H's layers of an MLP or an MoE alone, which read no mask.
        "mlp": no_mask,
        "moe": no_mask,
        STATEFUL: no_mask,  # xLSTM's layers, whose model makes no mask
        HYBRID_MASKS: hybrid_masks,  # Falcon-H1's layers: attention and Mamba side by side; Inkling's full layers
        HYBRID_SLIDING_MASKS: hybrid_sliding_masks,  # Inkling's windowed layers
    }
    # The cache positionally: Transformers 5.20 renamed the argument (transformers_compat.py).
    return {
        kind: mask_functions[kind](config, inputs_embeds, attention_mask, cache, position_ids=position_ids)
        for kind in attention_types
    }


def family_attention_inputs(
    config: AttnResConfig,
    masks: dict[str, torch.Tensor | None],
    inputs_embeds: torch.Tensor,
    attention_mask: torch.Tensor | None,
    cache: Cache | None,
) -> tuple[dict[str, torch.Tensor | None], torch.Tensor | None]:
    """The masks as the family's attention reads them (MPT's as booleans, `Family.boolean_mask`), and the bias on the
    attention scores that the family's model builds for every layer (ALiBi, `Family.attention_bias`) or `None`."""
    family = FAMILIES[config.family]
    if family.boolean_mask:
        masks = {kind: None if mask is None else mask.to(torch.bool) for kind, mask in masks.items()}
    if family.attention_bias is None:
        return masks, None
    return masks, family.attention_bias.build(family.modeling, config, inputs_embeds, attention_mask, cache)


def rotary_embeddings(
    rotary_emb: nn.Module | None,
    family: Family,
    rotary_types: Iterable,
    inputs_embeds: torch.Tensor,
    position_ids: torch.LongTensor,
) -> dict:
    """The rotary position embeddings each of `rotary_types` (the layers' `Family.rotary_type`: their attention types,
    or their RoPE bases) reads: one per type where the family's rotary embedding takes one (`Family.rotary_per_layer`;
    `None` for the types it has no bases for, a hybrid's recurrent layers; in fp32 for `Family.fp32_rotary_types`),
    otherwise one for all; `None` for the layers the family's model gives none (the type `None`: LaRA Mini's and
    Granite MoE SWA's NoPE layers), and for all where the family has no rotary embedding (GPT-2's learned positions,
    Kimi Linear's NoPE attention)."""
    if rotary_emb is None:
        return dict.fromkeys(rotary_types)
    if family.rotary_per_layer:
        embeddings = {}
        for kind in rotary_types:
            inputs = inputs_embeds.float() if kind in family.fp32_rotary_types else inputs_embeds
            embeddings[kind] = rotary_emb(inputs, position_ids, kind) if kind in rotary_emb.layer_types else None
        return embeddings
    shared = rotary_emb(inputs_embeds, position_ids)
    return {kind: None if kind is None else shared for kind in rotary_types}


def family_position_ids(
    config: AttnResConfig, inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, cache: Cache | None
) -> torch.LongTensor:
    """The position ids the family's model makes where none are given: every token counted from the cache's length,
    or, where the family counts them over the attention mask (`ModelParts.positions_from_mask`, OPT), the unpadded
    tokens counted, -1 at padding."""
    family = FAMILIES[config.family]
    past_seen_tokens = 0
    if isinstance(cache, Cache):
        past_seen_tokens = cache.get_seq_length()
    elif cache is not None:  # the family's own (`Family.own_cache`): its count of the tokens seen, a tensor
        past_seen_tokens = getattr(cache, family.own_cache.length)
    parts = family.parts
    padding_mask = isinstance(attention_mask, torch.Tensor) and attention_mask.ndim == 2
    if parts is not None and parts.positions_from_mask and padding_mask:
        counted = (torch.cumsum(attention_mask, dim=1) * attention_mask - 1).long()
        return counted[:, past_seen_tokens:]
    position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
    return position_ids.unsqueeze(0)


def family_embeddings(
    config: AttnResConfig,
    inputs_embeds: torch.Tensor,
    embed_positions: nn.Module | None,
    position_ids: torch.LongTensor,
    training: bool,
    embedding_norm: nn.Module | None,
    norm: nn.Module | None,
) -> torch.Tensor:
    """The embeddings as the family's model feeds them to its first layer: times CTRL's sqrt(hidden_size), plus the
    position embeddings of the families that add them (GPT-2's, OPT's, CTRL's), through BLOOM's and ModernBERT
    decoder's `embedding_norm`, times Granite's
    `embedding_multiplier`, times RecurrentGemma's rounded sqrt(hidden_size), times sqrt(hidden_size) under AFMoE's
    muP, through GPT-2's, StarCoder2's and ModernBERT decoder's embedding dropout in training, through NanoChat's final
    `norm`."""
    family = FAMILIES[config.family]
    if family.embedding_scale:
        inputs_embeds = inputs_embeds * math.sqrt(config.hidden_size)
    if embed_positions is not None:
        # In the embeddings' dtype, as CTRL casts its table, built in fp32 whatever the model's dtype.
        positions = family.parts.position_embeddings(embed_positions, position_ids).to(inputs_embeds.dtype)
        inputs_embeds = inputs_embeds + positions
    if embedding_norm is not None:
        inputs_embeds = embedding_norm(inputs_embeds)
    if family.embedding_multiplier is not None:
        inputs_embeds = inputs_embeds * getattr(config, family.embedding_multiplier)
    if family.embedding_scale_dtype is not None:
        scale = torch.tensor(config.hidden_size**0.5, dtype=family.embedding_scale_dtype)
        inputs_embeds = inputs_embeds * scale.to(inputs_embeds.device, inputs_embeds.dtype)
    if family.mup_embedding_scale is not None and getattr(config, family.mup_embedding_scale):
        inputs_embeds = inputs_embeds * (config.hidden_size**0.5)
    if family.embedding_dropout is not None:
        inputs_embeds = nn.functional.dropout(inputs_embeds, getattr(config, family.embedding_dropout), training)
    if family.final_norm_on_embeddings:
        inputs_embeds = norm(inputs_embeds)
    return inputs_embeds


def family_logits(
    config: AttnResConfig,
    lm_head: nn.Module,
    hidden_states: torch.Tensor,
    prediction_head: nn.Module | None = None,
) -> torch.Tensor:
    """The logits as the family's `*ForCausalLM` computes them from the model's output: the LM head's input through
    ModernBERT decoder's `prediction_head` or divided by MiniCPM3's `logits_scaling` or Inkling's muP width, in fp32
    as xLSTM's, the logits of Inkling's padding rows dropped, divided by Granite's `logits_scaling`, multiplied by
    HyperCLOVA X's, soft-capped by Gemma's `final_logit_softcapping` or xLSTM's `output_logit_soft_cap`."""
    family = FAMILIES[config.family]
    if prediction_head is not None:
        hidden_states = prediction_head(hidden_states)
    if family.head_input_divisor is not None:
        hidden_states = hidden_states / family.config_value(config, family.head_input_divisor)
    logits = lm_head(hidden_states)
    if family.float_logits:
        logits = logits.float()
    unpadded = getattr(config, family.unpadded_vocab) if family.unpadded_vocab else None
    if unpadded is not None and unpadded < logits.shape[-1]:
        logits = logits[..., :unpadded]
    if family.logits_divisor is not None:
        logits = logits / getattr(config, family.logits_divisor)
    if family.logits_multiplier is not None:
        logits = logits * getattr(config, family.logits_multiplier)
    cap = getattr(config, family.logit_softcap) if family.logit_softcap else None
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def with_family_z_loss(config: AttnResConfig, loss: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """`loss` plus the z-loss the family's `*ForCausalLM` adds where its coefficient is positive (Bamba's
    `z_loss_coefficient`), over the logits it computes."""
    field = FAMILIES[config.family].z_loss
    coefficient = getattr(config, field) if field else 0
    if coefficient > 0:
        loss = loss + coefficient * logits.logsumexp(dim=-1).to(dtype=loss.dtype).pow(2).mean()
    return loss


class RecordedHiddenState(nn.Module):
    """A hidden state that `output_hidden_states` records: what an attention sublayer reads, or the model's output at
    every position. Transformers records by hooking module outputs, and a depth-attention step's output is a
    `PendingInput`, so this module computes the record; it runs only while recording, beside what the model computes
    and goes on with (fused, at the kept positions), so recording changes no output."""

    def forward(self, hidden_states: torch.Tensor | PendingInput) -> torch.Tensor:
        return hidden_states.value() if isinstance(hidden_states, PendingInput) else hidden_states


class LayerInputs(NamedTuple):
    """What the model gives every sublayer of a decoder layer besides its input: the mask (one per kind where the
    layer has several), the rotary position embeddings, the position ids, the cache, an ALiBi bias, what the layers'
    attentions pass on (`AttnResDecoderLayer.forward`'s `threaded`) and the keywords the family's modules take."""

    attention_mask: torch.Tensor | dict | None
    position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    position_ids: torch.LongTensor | None
    cache: Cache | None
    attention_bias: torch.Tensor | None
    threaded: dict | None
    kwargs: dict


class AttnResDecoderLayer(GradientCheckpointingLayer):
    """The family's sublayers of one decoder layer, each behind its own depth-mixing module: its token mixer
    (attention, or a hybrid's linear attention) behind `attn_residual` and its MLP or MoE behind `mlp_residual`, or,
    in a layer of one mixer and no MLP (Mamba, Nemotron-H), that mixer behind `attn_residual` alone.

    The family's own decoder-layer class builds the modules, which this layer holds under the family's names; the
    family's row (`families.Family`) says which sublayers the layer has (for hybrids, by the layer's type), which
    norm each reads through, how the family calls it and which modules its output goes through. The layer maps the
    depth state to the next one. Under activation checkpointing the state crosses the layer's boundary flattened to
    positional tensors (`__call__`), the only form in which reentrant checkpointing recomputes and differentiates
    through all of them; what is not a tensor (the state's layout, the forward pass's `DepthContext`) travels as
    keywords.
    """

    def __init__(self, config: AttnResConfig, layer_idx: int):
        super().__init__()
        family = FAMILIES[config.family]
        family_layer = family.decoder_layer_of(config, layer_idx)
        for name, module in family_layer.named_children():
            self.add_module(name, module)
        self.sublayers = family.sublayers_of(config, layer_idx)
        self.summands = tuple(sublayer.summands for sublayer in self.sublayers)
        if family.llama_norm:  # the same function, fused with the depth step in front of it
            for sublayer in self.sublayers:
                # Only where the layer holds the family's norm: A.X K2's MoE layers gate theirs.
                norm = self.module_at(sublayer.pre_norm) if sublayer.pre_norm is not None else None
                if type(norm) is family.norm_class:  # at the norm's own eps: JetMoE's layers keep the class default
                    self.set_submodule(sublayer.pre_norm, AttnResRMSNorm(config.hidden_size, eps=norm.variance_epsilon))
        # How the family's own pre-norms fuse on an fp32 stream, where they can (`FusableNorm`): one for them all.
        pre_norms = [self.module_at(sublayer.pre_norm) for sublayer in self.sublayers if sublayer.pre_norm is not None]
        self.fusable_norm = next(filter(None, (FusableNorm.of(family, norm) for norm in pre_norms)), None)
        self.residual_multiplier = None
        if family.residual_multiplier is not None:
            self.residual_multiplier = getattr(config, family.residual_multiplier)
        elif family.layer_residual_scale is not None:
            self.residual_multiplier = getattr(family_layer, family.layer_residual_scale)
        self.branch_dropouts = {s.dropout: getattr(config, s.dropout) for s in self.sublayers if s.dropout}
        # The scalars the family's layer applies to its modules' inputs and outputs (Falcon-H1's).
        self.multipliers = {name: getattr(config, name) for sublayer in self.sublayers for name in sublayer.multipliers}
        # Buffers the family's model registers on its layers' modules (Falcon-H1's muP vector).
        for path, function in family.layer_buffers:
            module, _, name = path.rpartition(".")
            buffer = getattr(family.modeling, function)(config)
            self.get_submodule(module).register_buffer(name, buffer, persistent=False)
        # How the layer's recurrent mixer, where it has one, takes the cache and which keywords (transformers_compat).
        recurrent = [self.module_at(sublayer.module) for sublayer in self.sublayers if sublayer.call == RECURRENT]
        self.recurrent_cache_name = recurrent_cache_name(recurrent[0]) if recurrent else None
        self.recurrent_keywords = keywords_taken(recurrent[0].forward) if recurrent else None
        # The attentions that declare `position_embeddings` are given `None` in a layer without RoPE (Granite MoE SWA's
        # NoPE layers); a NoPE family's attention that does not declare it (Kimi Linear's) is not given it.
        self.declares_position_embeddings = {
            sublayer.module
            for sublayer in self.sublayers
            if sublayer.call == ATTENTION
            and "position_embeddings" in inspect.signature(self.module_at(sublayer.module).forward).parameters
        }
        self.layer_idx = layer_idx
        # Where a `STATEFUL` mixer's state sits in the family's own cache (`Family.own_cache`).
        self.cache_states = family.own_cache.states if family.own_cache is not None else None
        # The objects the family's model makes once per forward pass for its layers' attention (`Sublayer.shared`).
        self.shared_per_forward = {
            sublayer.shared.keyword: getattr(family.modeling, sublayer.shared.cls)
            for sublayer in self.sublayers
            if sublayer.shared is not None
        }
        self.attention_type = layer_types(config)[layer_idx]
        self.attention_bias_keyword = family.attention_bias.keyword if family.attention_bias else None
        self.rotary_type = family.rotary_type(config, layer_idx)
        first = config.layer_offsets[layer_idx] + 1  # the position of the layer's first sublayer (docs/design.md §1)
        self.attn_residual = depth_mixer(config, first)
        if len(self.sublayers) == 2:
            self.mlp_residual = depth_mixer(config, first + 1)
        self.recorded_input = RecordedHiddenState()

    @property
    def depth_mixers(self) -> tuple[nn.Module, ...]:
        """The depth-mixing modules in front of the layer's sublayers, in order; each looked up once (a submodule
        lookup is `nn.Module.__getattr__`, a Python call per read)."""
        if len(self.sublayers) == 1:
            return (self.attn_residual,)
        return self.attn_residual, self.mlp_residual

    def __call__(self, depth_state: tuple, **kwargs) -> tuple:
        if not (self.gradient_checkpointing and self.training):
            return super().__call__(depth_state, **kwargs)
        tensors, layout = flatten_state(depth_state)
        *tensors, layout = super().__call__(*tensors, depth_layout=layout, **kwargs)
        return layout.unflatten(tensors)

    def forward(
        self,
        *depth_state: tuple | torch.Tensor | None,
        depth_context: DepthContext,
        depth_layout: StateLayout | None = None,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        attention_bias: torch.Tensor | None = None,
        threaded: dict | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple:
        r"""
        threaded (`dict`, *optional*):
            What the layers' attentions pass on beside the residual stream in one forward pass: what each returned for
            the next one's (`Sublayer.threaded`), by layer index, so that a layer recomputed under activation
            checkpointing reads what its predecessor gave it the first time, and the objects they share
            (`Sublayer.shared`), by keyword.
        """
        state = depth_state[0] if depth_layout is None else depth_layout.unflatten(depth_state)
        depth_mixers = self.depth_mixers
        if type(state) is DepthState and state.blocks_inv_rms.dtype != torch.float32:
            # FSDP2's `MixedPrecisionPolicy` casts every floating-point tensor among a unit's inputs to `param_dtype`,
            # the state's fp32 statistics too: they are computed again from the blocks, as a pipeline stage resumes
            # a state, and each step runs phase 1 for its own query (docs/training.md#mixed-precision).
            state, _ = depth_mixers[0].resumed_state(state.blocks, state.partial, None)
        inputs = LayerInputs(attention_mask, position_embeddings, position_ids, cache, attention_bias, threaded, kwargs)
        for index, (sublayer, summands, mixer) in enumerate(zip(self.sublayers, self.summands, depth_mixers)):
            hidden_states = mixer(state, depth_context)
            if index == 0 and depth_context.record_inputs:
                self.recorded_input(hidden_states)
            norm = self.module_at(sublayer.pre_norm) if sublayer.pre_norm else None
            sublayer_input = pre_norm(norm, hidden_states, self.fusable_norm)
            output = self.sublayer_output(summands, sublayer_input, inputs)
            output = self.branch_output(sublayer, output, sublayer_input.shape, inputs)
            state = mixer.absorb(output, state, depth_context)
        if depth_layout is None:
            return state
        tensors, layout = flatten_state(state)
        return *tensors, layout

    def module_at(self, path: str) -> nn.Module | None:
        """The family's module at `path` under this layer: a name, or a dotted path where the family's layer holds it
        inside a module of its own (DBRX's `norm_attn_norm.attn`, `Sublayer.module`); `None` where the family's layer
        left it out for the config (Granite 4's MoE without experts). Plain attribute reads, which torch.compile
        traces as the one-name lookups they replace."""
        if "." not in path:  # the common case, one lookup
            return getattr(self, path, None)
        module = self
        for name in path.split("."):
            module = getattr(module, name, None)
        return module

    def sublayer_output(
        self, summands: tuple[Sublayer, ...], hidden_states: torch.Tensor, inputs: LayerInputs
    ) -> torch.Tensor | tuple:
        """The output of the sublayer's module, or the sum of the outputs of the modules its branch sums
        (`Sublayer.summands`), in order, of those the family's layer built (Granite 4's MoE without experts is
        skipped, as its layer skips it). A branch of one module, the common case, is that module's output: no list
        is built per sublayer and decoded token."""
        if len(summands) == 1:
            return self.module_output(summands[0], hidden_states, inputs)
        outputs = [self.module_output(part, hidden_states, inputs) for part in summands]
        outputs = [output for output in outputs if output is not None]
        return sum(outputs[1:], outputs[0])

    def module_output(
        self, part: Sublayer, hidden_states: torch.Tensor, inputs: LayerInputs
    ) -> torch.Tensor | tuple | None:
        """One module of a branch called as the family's decoder layer calls it (`Sublayer.call`), `None` where the
        family's layer left it out: attention with the position embeddings or the family's attention bias and its
        mask, a recurrent mixer with its padding mask, both with the cache; an MLP or MoE on the hidden states alone;
        a zero residual where the module adds one itself (`Sublayer.residual_argument`). It reads its kind of mask
        where the layer has several (`Sublayer.mask`; an attention is given the padding mask too where the family's
        reads it, `Sublayer.padding_mask`), its input and output are multiplied by the family's multipliers, and it
        is given what the previous layer's threaded to it (`Sublayer.threaded`), keeping what it threads on."""
        module = self.module_at(part.module)
        if module is None:
            return None
        if part.input_multiplier is not None:
            hidden_states = hidden_states * self.multipliers[part.input_multiplier]
        output = self.call_module(part, module, hidden_states, inputs)
        if part.output_multiplier is not None:
            output = output * self.multipliers[part.output_multiplier]
        return output

    def call_module(
        self, part: Sublayer, module: nn.Module, hidden_states: torch.Tensor, inputs: LayerInputs
    ) -> torch.Tensor | tuple:
        """`module`'s output, called as `part.call` says (`module_output`)."""
        # A zero tensor of no dimensions: it broadcasts, and adds nothing.
        residual = {part.residual_argument: hidden_states.new_zeros(())} if part.residual_argument else {}
        if part.call == FEED_FORWARD:
            return module(hidden_states, **residual)
        attention_mask, cache, kwargs = inputs.attention_mask, inputs.cache, inputs.kwargs
        if part.mask is not None:
            attention_mask = attention_mask[part.mask]
        if part.call == RECURRENT:
            if self.recurrent_keywords is not None:
                kwargs = {name: value for name, value in kwargs.items() if name in self.recurrent_keywords}
            cache_argument = {self.recurrent_cache_name: cache}
            return module(hidden_states=hidden_states, attention_mask=attention_mask, **cache_argument, **kwargs)
        if part.call == STATEFUL:
            # The layer's state in the family's own cache, overwritten in place with the one the module returns, as the
            # family's model does (xLSTM's).
            state = getattr(cache, self.cache_states)[self.layer_idx] if cache is not None else None
            output, new_state = module(hidden_states, state)
            if cache is not None:
                for held, new in zip(state, new_state):
                    held.copy_(new)
            return output
        kwargs = dict(kwargs, attention_mask=attention_mask, position_ids=inputs.position_ids)
        kwargs[part.cache_argument or CACHE_NAME] = cache
        if inputs.position_embeddings is not None or part.module in self.declares_position_embeddings:
            kwargs["position_embeddings"] = inputs.position_embeddings
        if part.padding_mask is not None:
            kwargs[part.padding_mask] = inputs.attention_mask["linear_attention"]
        if inputs.attention_bias is not None:  # ALiBi (MPT, BLOOM), under the family's keyword
            kwargs[self.attention_bias_keyword] = inputs.attention_bias
        threaded = inputs.threaded
        if part.threaded is not None:
            kwargs[part.threaded] = threaded.get(self.layer_idx - 1)
        for keyword, shared in self.shared_per_forward.items():
            if keyword not in threaded:
                threaded[keyword] = shared()
            kwargs[keyword] = threaded[keyword]
        # The input under the keyword the family's layer passes it by (under each of CTRL's three), or by position
        # (RecurrentGemma's).
        keywords = part.input_argument
        if keywords is None:
            outputs = module(hidden_states, **residual, **kwargs)
        else:
            for keyword in (keywords,) if isinstance(keywords, str) else keywords:
                kwargs[keyword] = hidden_states
            outputs = module(**residual, **kwargs)
        if part.threaded is not None:
            threaded[self.layer_idx] = outputs[2]
        bias = outputs[part.output_bias] if part.output_bias is not None else None
        return outputs[0] if bias is None else outputs[0] + bias

    def branch_output(
        self,
        sublayer: Sublayer,
        output: torch.Tensor | tuple,
        shape: torch.Size,
        inputs: LayerInputs,
    ) -> torch.Tensor:
        """The sublayer's output v_l as it joins the stream: the module's first output where it returns more (GPT-OSS's
        and Llama 4's MoE return their router scores or logits beside it), through the family's short convolution of
        the branch with the cache and the layer's padding mask (Inkling's), its post-norm or residual dropout (or the
        rest of OPT's MLP) and the dropout the family's layer applies as a function (GPT-NeoX Japanese), in the `shape`
        of the module's input (Llama 4's MoE returns one row per token), and scaled by the family's residual
        multiplier (Granite)."""
        if isinstance(output, tuple):
            output = output[0]
        if sublayer.convolution is not None:
            padding_mask = {sublayer.padding_mask: inputs.attention_mask["linear_attention"]}
            output = self.module_at(sublayer.convolution)(output, **{CACHE_NAME: inputs.cache}, **padding_mask)
        for name in sublayer.post:
            output = self.module_at(name)(output)
        if sublayer.dropout is not None:
            output = nn.functional.dropout(output, self.branch_dropouts[sublayer.dropout], self.training)
        if output.shape != shape:
            output = output.view(shape)
        return output if self.residual_multiplier is None else output * self.residual_multiplier


def family_initialisation(config: AttnResConfig, model: nn.Module) -> PreTrainedModel:
    """The family's `*PreTrainedModel` holding `config`, to run the family's own `_init_weights` on the modules of
    `model` (Gemma's zero norm gains and embedding scale, Gemma 3's per-type rotary frequencies, the experts of the MoE
    families). That method may call `super()`, which needs an instance of the family's class: this one is not built
    by its `__init__` and holds the config and `model`'s modules, which are all the method reads. xLSTM's reads the
    modules: it picks each linear layer's initialisation by the layer's path in the model (`igate`, `proj_down`), which
    under `model`'s names holds the same module names, and initialises the token embedding by the name its model gives
    it (`ModelParts.tokens`, `embeddings`), under which this one holds it too where that is one name."""
    family = FAMILIES[config.family]
    family_class = family.cls("PreTrainedModel")
    initialisation = family_class.__new__(family_class)
    nn.Module.__init__(initialisation)
    initialisation.config = config
    for name, child in model.named_children():
        initialisation.add_module(name, child)
    if family.parts is not None and "." not in family.parts.tokens:
        initialisation.add_module(family.parts.tokens, model.get_input_embeddings())
    return initialisation


class AttnResPreTrainedModel(PreTrainedModel):
    config: AttnResConfig
    config_class = AttnResConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AttnResDecoderLayer"]
    _can_compile_fullgraph = True
    _supports_attention_backend = True
    # `hidden_states[i]` is the input the i-th decoder layer's attention sublayer reads (the depth-mixed input under
    # AttnRes, the residual stream in standard mode, where this equals the family's), and the last entry is the output
    # after the final norm, each computed by a `RecordedHiddenState`. Attentions and router logits are recorded by
    # module name, where the families' classes differ: `self_attn`, and each MoE family's router (`families.Moe`; by
    # its class where another family's router has its name but not its output's layout); by class where the name is
    # that of other modules too (`Family.recorded_attention`). One
    # list for every family, since Transformers < 5.25 keeps one record per model class; a model holds the modules
    # of its own family only.
    _can_record_outputs = {
        "hidden_states": [
            OutputRecorder(None, class_name="recorded_input", capture_initial_hidden_state=False),
            OutputRecorder(None, class_name="recorded_output", capture_initial_hidden_state=False),
        ],
        "attentions": [
            OutputRecorder(None, index=1, class_name=f".{attention}")
            for attention in dict.fromkeys(
                # A recorder matches the end of a module's path, so an attention at a dotted path is recorded by its
                # last name (DBRX's `norm_attn_norm.attn` by GPT-2's `.attn`), once.
                part.module.rpartition(".")[2]
                for family in FAMILIES.values()
                if family.recorded_attention is None
                for sublayers in (family.layer_sublayers or {None: family.sublayers}).values()
                for sublayer in sublayers
                for part in sublayer.summands
                if part.call == ATTENTION
            )
        ]
        + [
            OutputRecorder(family.cls(family.recorded_attention), index=1)
            for family in FAMILIES.values()
            if family.recorded_attention is not None
        ],
        "router_logits": [
            OutputRecorder(router_class, index=index, class_name=router)
            for router_class, router, index in dict.fromkeys(
                family.router_recorder for family in FAMILIES.values() if family.moe
            )
        ],
    }

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Transformers' own pipeline parallelism (`distributed_config` with `pp_size > 1`) hands one hidden-states
        tensor from stage to stage, where an AttnRes boundary carries the depth state: refused in one line, pointing
        to the pipeline on PyTorch's engine that carries it (docs/training.md, "Pipeline parallel")."""
        distributed_config = kwargs.get("distributed_config")
        pp_size = (
            distributed_config.get("pp_size")
            if isinstance(distributed_config, dict)
            else getattr(distributed_config, "pp_size", None)
        )
        if pp_size is not None and pp_size > 1:
            raise ValueError(
                f"distributed_config pp_size={pp_size}: Transformers' pipeline stages pass one hidden-states tensor, "
                "an AttnRes stage boundary the depth state; split the model with attnres.training.pipeline instead"
            )
        return super().from_pretrained(*args, **kwargs)

    # The attention implementations the family's attention supports (Gemma 2's soft-capping has no SDPA), which
    # Transformers reads from the model when it picks one.
    @property
    def _supports_sdpa(self) -> bool:
        return FAMILIES[self.config.family].cls("PreTrainedModel")._supports_sdpa

    @property
    def _supports_flash_attn(self) -> bool:
        return FAMILIES[self.config.family].cls("PreTrainedModel")._supports_flash_attn

    @property
    def _supports_flex_attn(self) -> bool:
        return FAMILIES[self.config.family].cls("PreTrainedModel")._supports_flex_attn

    @classmethod
    def _can_set_experts_implementation(cls) -> bool:
        """The MoE experts are the family's (`MixtralExperts` and its copies), which dispatch on
        `config._experts_implementation`, so the model takes the family's default (`grouped_mm`) and
        `experts_implementation=` like it. Transformers decides this by finding `@use_experts_implementation` in the
        model's own source file, where it is not."""
        return True

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        """Every module goes through `_init_weights`, as in Transformers' own models. For a model outside Transformers
        it skips the modules whose own parameters are all initialised, for code that writes them in place without
        flagging them; this one initialises through `transformers.initialization`, which flags them, and skipping
        would leave out a family's module that initialises its children's parameters (Qwen3-Next's MoE block, its
        router), holding none itself."""
        super()._initialize_weights(module, is_custom_code=False)

    def _init_weights(self, module: nn.Module) -> None:
        family_initialisation(self.config, self)._init_weights(module)
        std = FAMILIES[self.config.family].initializer_std(self.config)
        if isinstance(module, AttnResDecoderLayer):
            family = FAMILIES[self.config.family]
            for path, function in family.layer_buffers:
                init.copy_(module.get_buffer(path), getattr(family.modeling, function)(self.config))
        elif isinstance(module, DepthQuery):
            # Zero pseudo-queries: uniform depth attention, which reproduces the PreNorm residual up to the norms.
            init.zeros_(module.pseudo_query)
            if module.key_norm_weight is not None:
                init.ones_(module.key_norm_weight)
        elif isinstance(module, PositionTable):  # a buffer, not loaded from checkpoints
            init.copy_(module.table, module.computed())
        elif isinstance(module, DepthAttention) and module.output_scale_tensor is not None:
            init.constant_(module.output_scale_tensor, module.output_scale)  # a buffer, not loaded from checkpoints
        if hasattr(module, "init_residual_parameters"):
            # Comparison residuals and AttnRes ablations (residual_variants.py, depth_ablations.py) initialise their own
            # parameters as their papers do, most of them so that a fresh model equals the PreNorm baseline.
            module.init_residual_parameters(std)


class AttnResModel(AttnResPreTrainedModel):
    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size

        family = FAMILIES[config.family]
        # The family's own modules around the layers, where they are not Llama's (GPT-2's position embedding).
        parts = family.model_parts(config)
        self.embed_tokens = family.embedding(config) if parts is None else parts.get_submodule(family.parts.tokens)
        self.embed_positions = None
        if parts is not None and family.parts.positions is not None:
            self.embed_positions = parts.get_submodule(family.parts.positions)
        elif parts is not None and family.parts.position_table is not None:
            function = getattr(family.modeling, family.parts.position_table)
            self.embed_positions = PositionTable(function, config.max_position_embeddings, config.hidden_size)
        if parts is not None and family.parts.embedding_norm is not None:
            self.embedding_norm = parts.get_submodule(family.parts.embedding_norm)
        else:
            self.embedding_norm = None
        self.layers = nn.ModuleList(
            [AttnResDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.output_residual = depth_mixer(config, config.num_sublayers + 1)
        if parts is not None:
            self.norm = parts.get_submodule(family.parts.norm)
        else:
            norm = AttnResRMSNorm if family.llama_norm else family.norm_class
            self.norm = norm(config.hidden_size, eps=norm_eps(config))
        self.fusable_norm = FusableNorm.of(family, self.norm)
        self.recorded_output = RecordedHiddenState()
        self.rotary_emb = family.rotary_embedding_of(config)
        self.gradient_checkpointing = False
        self._keep_depth_queries_in_float32()
        # The family's own modules kept in fp32 on loading (DeepSeek-V3's router weights and routing bias, GPT-OSS's
        # norms), as its model keeps them.
        family_model = family.cls("PreTrainedModel")
        self._keep_in_fp32_modules = list(family_model._keep_in_fp32_modules or [])
        self._keep_in_fp32_modules_strict += family_model._keep_in_fp32_modules_strict or []

        self.post_init()

    def _keep_depth_queries_in_float32(self) -> None:
        """Pseudo-queries and key-norm gains are held in fp32 whatever dtype the model is built or loaded in
        (`from_pretrained(dtype=torch.bfloat16)`, a 4-bit `quantization_config`): they are read in fp32 anyway
        (`DepthQuery`), they are two vectors per sublayer, and in bf16 an optimizer step below half the spacing of
        their values is rounded away (the spacing is 0.0078 at a key-norm gain of 1; Adam's steps are about the
        learning rate, 3e-4 in docs/training.md). Transformers' `_keep_in_fp32_modules_strict` names them for loading,
        by parameter name, in the models that have them (standard mode and the comparison residuals have none); built
        from a config they are made fp32 here. `model.to(dtype)` still casts them. bitsandbytes quantizes linear
        layers only, so a 4-bit model holds them as they are."""
        names = set()
        for module in self.modules():
            if isinstance(module, DepthQuery):
                module.float()
                names.update(name for name, _ in module.named_parameters(recurse=False))
        self._keep_in_fp32_modules_strict = sorted(names)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embed_tokens = value

    @accepts_past_key_values
    @merge_with_config_defaults
    @capture_outputs(tie_last_hidden_states=False)  # the recorded output spans every position (`forward`)
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeModelOutputWithPast:
        r"""
        logits_to_keep (`int` or `torch.Tensor`, *optional*, defaults to 0):
            The positions at which to compute the output (`last_hidden_state`), as `logits_to_keep` of
            `AttnResForCausalLM` (which passes its own): `0` for all of them, an `int` for the last ones, or a tensor
            (see `slice_logits_to_keep`). Under AttnRes the output is depth attention
            over every block, so a prompt's prefill, which keeps the last position, skips it at all the others.
            The recorded hidden states (`output_hidden_states`) span every position, the output among them, as Llama's
            do.
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)

        family = FAMILIES[self.config.family]
        if use_cache and cache is None and family.own_cache is not None:
            # The family's own cache, made as its model makes it (xLSTM's), in the embeddings' dtype.
            cache = family.cls(family.own_cache.cache)(
                self.config, inputs_embeds.shape[0], dtype=inputs_embeds.dtype, device=inputs_embeds.device
            )
        elif use_cache and cache is None:
            cache = DynamicCache(config=self.config)
            if family.cache_setup is not None:  # the state RecurrentGemma's modules hold, reset for the new cache
                setup = getattr(family.cls("PreTrainedModel"), family.cache_setup)
                setup(self, self.config, inputs_embeds.shape[0], inputs_embeds.device, inputs_embeds.dtype)

        if position_ids is None:
            position_ids = family_position_ids(self.config, inputs_embeds, attention_mask, cache)
        inputs_embeds = family_embeddings(
            self.config,
            inputs_embeds,
            self.embed_positions,
            position_ids,
            self.training,
            self.embedding_norm,
            self.norm,
        )

        masks = attention_mask  # `generate` may have made them, one per attention type
        if not isinstance(masks, dict):
            attention_types = dict.fromkeys(layer.attention_type for layer in self.layers)
            masks = attention_masks(self.config, attention_types, inputs_embeds, attention_mask, cache, position_ids)
        masks, attention_bias = family_attention_inputs(self.config, masks, inputs_embeds, attention_mask, cache)
        rotary_types = dict.fromkeys(layer.rotary_type for layer in self.layers)
        position_embeddings = rotary_embeddings(self.rotary_emb, family, rotary_types, inputs_embeds, position_ids)

        record_inputs = bool(kwargs.get("output_hidden_states", self.config.output_hidden_states))
        first_mixer = self.layers[0].depth_mixers[0]
        depth_state, depth_context = first_mixer.initial_state(inputs_embeds, self.depth_queries(cache), record_inputs)
        threaded = {}
        for decoder_layer in self.layers[: self.config.num_hidden_layers]:
            depth_state = decoder_layer(
                depth_state,
                depth_context=depth_context,
                threaded=threaded,
                attention_mask=masks[decoder_layer.attention_type],
                position_embeddings=position_embeddings[decoder_layer.rotary_type],
                position_ids=position_ids,
                cache=cache,
                attention_bias=attention_bias,
                use_cache=use_cache,
                **kwargs,
            )
        if use_cache and family.own_cache is not None:  # the tokens its own cache has seen, counted as its model does
            getattr(cache, family.own_cache.length).add_(inputs_embeds.shape[1])
        # The output at the kept positions only (docs/design.md §6.1). The recorded output spans every position, as
        # Llama's does, so recording computes it there too.
        keeps_all = isinstance(logits_to_keep, int) and not 0 < logits_to_keep < inputs_embeds.shape[1]
        output_state = depth_state if keeps_all else depth_state.at_positions(logits_to_keep)
        hidden_states = pre_norm(self.norm, self.output_residual(output_state, depth_context), self.fusable_norm)
        if record_inputs:
            recorded = hidden_states
            if not keeps_all:
                recorded = pre_norm(self.norm, self.output_residual(depth_state, depth_context), self.fusable_norm)
            self.recorded_output(recorded)

        return output_with_cache(MoeModelOutputWithPast, cache, last_hidden_state=hidden_states)

    def depth_queries(self, cache: Cache | None = None) -> tuple[torch.Tensor, ...] | None:
        """Every step's folded pseudo-query `[D]` in sublayer order (the output step last), so that
        phase 1 runs once per block for all of its queries (docs/design.md §6). Read through each step's `DepthQuery`
        module, so offloading hooks and PEFT wrappers see the call.

        `None` when the model runs no two-phase depth attention (standard mode, the comparison residuals, the AttnRes
        ablations), and when the queries cannot be read before their own layers run (parameters sharded by FSDP or
        DeepSpeed ZeRO-3): each step then runs phase 1 for its own query (same result, more passes over the blocks).

        A KV cache keeps the queries read by the forward pass that started it, as it keeps that pass's keys and
        values, and the passes that continue it without autograd reuse them: reading 2L + 1 modules costs more per
        decoded token than the depth attention itself (docs/design.md §6, "Decoding"). Only a `Cache` holds one
        sequence's history: continuous batching's paged cache, which serves many, is read through every pass.
        """
        if not self.output_residual.two_phase:
            return None
        kept = isinstance(cache, Cache) and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
        queries = getattr(cache, CACHED_QUERIES, None) if kept else None
        if queries is not None and cache.get_seq_length() > 0:
            return queries
        mixers = [mixer for layer in self.layers for mixer in layer.depth_mixers]
        queries = gather_queries([mixer.query for mixer in (*mixers, self.output_residual)])
        if kept:
            setattr(cache, CACHED_QUERIES, queries)
        return queries

    @torch.no_grad()
    def depth_attention_weights(self, input_ids: torch.LongTensor, **kwargs) -> dict[str, torch.Tensor]:
        """Run a forward pass and return the depth-attention weights of every depth-mixing step.

        Keys are module names (`"layers.3.mlp_residual"`, `"output_residual"`); values are fp32 tensors
        `[batch, seq, num_sources]` over the sources [b_0 = embedding, b_1, ..., partial sum] in order. Computed by
        forward hooks with the naive form, so the forward pass itself is unchanged.
        """
        weights: dict[str, torch.Tensor] = {}
        handles = []
        for name, module in self.named_modules():
            if isinstance(module, DepthAttention):

                def record(module, args, name=name):
                    weights[name] = module.attention_weights(*args)

                handles.append(module.register_forward_pre_hook(record))
        try:
            self(input_ids=input_ids, use_cache=False, **kwargs)
        finally:
            for handle in handles:
                handle.remove()
        return weights


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = AttnResModel(config)
        self.vocab_size = config.vocab_size
        bias = self.family.lm_head_bias
        if isinstance(bias, str):
            bias = getattr(config, bias)
        bias = bool(bias)
        self.lm_head = nn.Linear(config.hidden_size, self.family.output_vocab_size(config), bias=bias)
        prediction_head = self.family.prediction_head
        self.prediction_head = self.family.cls(prediction_head)(config) if prediction_head is not None else None
        if not self.family.causal_lm_class._tied_weights_keys:
            # The head is its own wherever the family's causal LM ties none to the embedding (Nemotron-H, Kimi Linear),
            # whatever `tie_word_embeddings` says, as there.
            self._tied_weights_keys = {}
        self.post_init()
        if not self.family.causal_lm_class._tp_plan:
            # The head stays whole where the family's own causal LM has no plan (GPT-2, StableLM): sharding it alone
            # would gather logits over an embedding it is tied to and that stays whole.
            self.tp_plan = {name: style for name, style in self.tp_plan.items() if name != "lm_head"}

    @property
    def family(self) -> Family:
        return FAMILIES[self.config.family]

    def _prepare_cache_for_generation(self, *args, **kwargs) -> None:
        """`generate` makes a `DynamicCache`, except for a family with a cache of its own (`Family.own_cache`), which
        the model makes at the first step, as `generate` leaves the family's own model to (xLSTM's)."""
        if self.family.own_cache is None:
            super()._prepare_cache_for_generation(*args, **kwargs)

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    @accepts_past_key_values
    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> MoeCausalLMOutputWithPast:
        if output_router_logits is None:  # DeepSeek-V3's, GLM-4.5's and HunYuan's configs lack it in Transformers 5.16
            output_router_logits = getattr(self.config, "output_router_logits", False)
        output_router_logits = self.family.moe is not None and output_router_logits
        outputs: MoeModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            logits_to_keep=logits_to_keep,
            **kwargs,
        )

        logits = family_logits(self.config, self.lm_head, outputs.last_hidden_state, self.prediction_head)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=logits.shape[-1], **kwargs)
            loss = with_family_z_loss(self.config, loss, logits)

        aux_loss = None
        if output_router_logits:
            aux_loss = self.family.load_balancing_loss(self.config, outputs.router_logits, attention_mask)
            if labels is not None and aux_loss is not None:
                coefficient = self.family.config_value(self.config, self.family.moe.loss_coefficient)
                loss = loss + coefficient * aux_loss.to(loss.device)

        return output_with_cache(
            MoeCausalLMOutputWithPast,
            output_cache(outputs),
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
        )


class AttnResForSequenceClassification(GenericForSequenceClassification, AttnResPreTrainedModel):
    """Llama's classification head (the score of the last non-padding token) on `AttnResModel`.

    The backbone is built here, not by the generic class's `AutoModel.from_config(config)`: loaded from a checkpoint's
    remote code, that call is not given `trust_remote_code` and refuses the checkpoint's own model class.
    """

    def __init__(self, config: AttnResConfig):
        AttnResPreTrainedModel.__init__(self, config)
        self.num_labels = config.num_labels
        self.model = AttnResModel(config)
        self.score = nn.Linear(config.hidden_size, self.num_labels, bias=False)
        self.post_init()

    forward = accepts_cache_params(GenericForSequenceClassification.forward)


AttnResModel.register_for_auto_class("AutoModel")
AttnResForCausalLM.register_for_auto_class("AutoModelForCausalLM")
AttnResForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")

__all__ = [
    "AttnResPreTrainedModel",
    "AttnResModel",
    "AttnResForCausalLM",
    "AttnResForSequenceClassification",
]
