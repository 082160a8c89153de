"""Which source checkpoints convert, how their configs map onto `AttnResConfig`, and how their tensors are named.

A checkpoint converts exactly when every sublayer is PreNorm (`h + f(RMSNorm(h))`) and its weights are those of
Llama's or Mixtral's modules, because then the AttnRes model with zero pseudo-queries computes the same function
(docs/design.md §5). Post-norm and parallel-residual decoders break that identity and are refused with the reason.
"""

import re
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedConfig

from ..configuration_attnres import AttnResConfig


class ConversionError(ValueError):
    """The source cannot be converted (unsupported architecture, malformed checkpoint, unsafe paths...)."""


# Fields every supported source shares with `AttnResConfig`, with the same name and meaning.
_COMMON_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_dropout",
)
_MOE_FIELDS = (
    "num_local_experts",
    "num_experts_per_tok",
    "router_aux_loss_coef",
    "output_router_logits",
    "router_jitter_noise",
)


@dataclass(frozen=True)
class SourceArchitecture:
    """A supported source class: the config fields it adds to the common ones, and whether it has Qwen2's
    q/k/v-only attention bias."""

    name: str
    fields: tuple[str, ...]
    qkv_bias: bool = False


SUPPORTED_ARCHITECTURES = {
    arch.name: arch
    for arch in (
        SourceArchitecture("LlamaForCausalLM", ("attention_bias", "mlp_bias")),
        SourceArchitecture("MistralForCausalLM", ("sliding_window",)),
        SourceArchitecture("MixtralForCausalLM", ("sliding_window", *_MOE_FIELDS)),
        SourceArchitecture("Qwen2ForCausalLM", (), qkv_bias=True),
    )
}

# Model types whose residual layout has no exact AttnRes counterpart, with the reason given to the user; keyed by
# model type so that every head of a family (BertForMaskedLM as much as BertLMHeadModel) gets the reason.
_POST_NORM = "post-norm sublayers (a norm after the sublayer output), so the residual stream is not a plain sum"
_PARALLEL = "a parallel residual (attention and MLP read the same input), which has no sublayer order to attend over"
REFUSED_MODEL_TYPES = {
    **dict.fromkeys(("olmo2", "olmo3", "gemma2", "gemma3", "gemma3_text"), _POST_NORM),
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "distilbert", "electra"), _POST_NORM),
    **dict.fromkeys(("gptj", "phi", "cohere", "cohere2"), _PARALLEL),
}


def _supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def source_architecture(config: PreTrainedConfig) -> SourceArchitecture:
    """The supported architecture `config` declares, or a `ConversionError` that names what was found and why."""
    architectures = list(getattr(config, "architectures", None) or [])
    if len(architectures) != 1:
        raise ConversionError(
            f"The source config declares architectures={architectures!r}; exactly one is needed to know how to "
            f"convert it. Supported: {_supported_list()}."
        )
    name = architectures[0]
    if getattr(config, "use_parallel_residual", False) or getattr(config, "parallel_attn", False):
        raise ConversionError(f"{name} uses {_PARALLEL}; AttnRes conversion is exact only for PreNorm decoders.")
    if config.model_type in REFUSED_MODEL_TYPES:
        raise ConversionError(
            f"{name} uses {REFUSED_MODEL_TYPES[config.model_type]}; AttnRes conversion is exact only for PreNorm "
            f"decoders (supported: {_supported_list()})."
        )
    if name not in SUPPORTED_ARCHITECTURES:
        raise ConversionError(f"Unsupported architecture {name}. Supported: {_supported_list()}.")
    return SUPPORTED_ARCHITECTURES[name]


def block_size_rule(sublayers: int | None = None) -> str:
    """What a conversion's block size may be; `sublayers` is the source's number, once its config is read."""
    bound = "2 * num_hidden_layers" + (f" = {sublayers}" if sublayers is not None else "")
    return f"an integer from 1 to {bound}, the source's number of sublayers"


def attnres_config(
    source: PreTrainedConfig,
    *,
    mode: str,
    block_size: int | None,
    exact_retrofit: bool,
) -> AttnResConfig:
    """The `AttnResConfig` computing what `source` computes (its fields copied verbatim) with the chosen residual."""
    arch = source_architecture(source)
    sublayers = 2 * source.num_hidden_layers
    if block_size is not None and not 1 <= block_size <= sublayers:
        raise ConversionError(f"block_size={block_size!r}: must be {block_size_rule(sublayers)}")
    fields = {name: getattr(source, name) for name in (*_COMMON_FIELDS, *arch.fields) if hasattr(source, name)}
    if arch.qkv_bias:
        fields.update(_qwen2_attention_fields(source))
    return AttnResConfig(
        **fields,
        residual_mode=mode,
        block_size=block_size,
        exact_retrofit=exact_retrofit,
        architectures=["AttnResForCausalLM"],
    )


def _qwen2_attention_fields(source: PreTrainedConfig) -> dict:
    """Qwen2 puts biases on q, k and v (not o), and may window attention in some layers only."""
    layer_types = set(getattr(source, "layer_types", None) or ["full_attention"])
    if layer_types == {"full_attention"}:
        sliding_window = None
    elif layer_types == {"sliding_attention"}:
        sliding_window = source.sliding_window
    else:
        raise ConversionError(
            f"{source.architectures[0]} mixes sliding-window and full-attention layers (layer_types="
            f"{source.layer_types}); AttnRes applies one attention window to every layer."
        )
    return {"qkv_bias": True, "attention_bias": False, "sliding_window": sliding_window}


# Tensors some checkpoints carry that are recomputed from the config, not learned.
_DERIVED_BUFFER = re.compile(r"\.rotary_emb\.inv_freq$")
# Mixtral's original layout: one Linear per expert (w1 = gate, w3 = up, w2 = down) under `block_sparse_moe`.
_LEGACY_EXPERT = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$")


class TensorRenamer:
    """Streams source tensors into AttnRes names, shard by shard.

    Llama-family tensors keep their names. Mixtral checkpoints in the original per-expert layout are fused into the
    stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` tensors that `MixtralExperts` holds; a layer's
    experts may span shards, so they wait in a buffer until the layer's last expert tensor arrives.
    """

    def __init__(self, config: AttnResConfig):
        self.num_experts = config.num_local_experts
        self.tied = config.tie_word_embeddings
        self._pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if _DERIVED_BUFFER.search(name) or (self.tied and name == "lm_head.weight"):
            return
        expert = _LEGACY_EXPERT.match(name)
        if expert is None:
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor
            return
        layer, index, kind = expert.group(1), int(expert.group(2)), expert.group(3)
        if not 0 <= index < self.num_experts:
            raise ConversionError(f"{name}: expert {index} does not exist (num_local_experts={self.num_experts}).")
        pending = self._pending.setdefault(layer, {})
        pending[kind, index] = tensor
        if len(pending) == 3 * self.num_experts:
            del self._pending[layer]
            experts = range(self.num_experts)
            gate = torch.stack([pending["w1", e] for e in experts])
            up = torch.stack([pending["w3", e] for e in experts])
            yield f"{layer}.mlp.experts.gate_up_proj", torch.cat([gate, up], dim=1)
            yield f"{layer}.mlp.experts.down_proj", torch.stack([pending["w2", e] for e in experts])

    def finish(self) -> None:
        """Fail if some layer's experts never completed (a truncated or inconsistent checkpoint)."""
        if self._pending:
            layer, tensors = next(iter(self._pending.items()))
            raise ConversionError(
                f"{layer}: only {len(tensors)} of {3 * self.num_experts} expert tensors (w1, w2, w3 per expert) were "
                "found in the checkpoint."
            )


def is_depth_parameter(name: str) -> bool:
    """The parameters AttnRes adds: a pseudo-query and a key-norm gain per depth-mixing module."""
    return bool(re.search(r"_residual\.query\.(pseudo_query|key_norm_weight)$", name))


def initial_depth_parameter(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Zero pseudo-queries (uniform depth attention: the retrofit identity) and unit key-norm gains."""
    if name.endswith("pseudo_query"):
        return torch.zeros(shape, dtype=dtype)
    return torch.ones(shape, dtype=dtype)
