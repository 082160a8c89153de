"""Which source checkpoints convert, how their configs map onto `AttnResConfig`, and how their tensors are named.

A checkpoint converts exactly when its residual stream is a plain sum of its sublayers' outputs, `h + g(h)` with any
norms inside `g`, because then the AttnRes model with zero pseudo-queries computes the same function
(docs/design.md §5). Every family in `attnres/families.py` is such a decoder, and the AttnRes model is built from the
family's own modules, so its config maps field by field and its tensors keep their names. True post-norm
(`norm(h + f(h))`) and parallel-residual decoders break the identity and are refused with the reason.
"""

import re
from collections.abc import Iterator

import torch
from transformers import PreTrainedConfig

from ..configuration_attnres import AttnResConfig
from ..families import FAMILIES, Family


class ConversionError(ValueError):
    """The source cannot be converted (unsupported architecture, malformed checkpoint, unsafe paths...)."""


SUPPORTED_ARCHITECTURES = {family.architecture: family for family in FAMILIES.values()}

# Model types whose residual layout has no exact AttnRes counterpart, with the reason given to the user; keyed by
# model type so that every head of a family (BertForMaskedLM as much as BertLMHeadModel) gets the reason.
_POST_NORM = (
    "true post-norm sublayers, norm(h + f(h)): the norm is applied to the residual stream itself, so the stream is "
    "not a plain sum of the sublayers' outputs"
)
_PARALLEL = (
    "a parallel residual, h + attn(h) + mlp(h): attention and MLP read the same input, so there is no sublayer order "
    "to attend over"
)
REFUSED_MODEL_TYPES = {
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "distilbert", "electra"), _POST_NORM),
    **dict.fromkeys(("gpt_neox", "gptj", "phi", "cohere", "cohere2"), _PARALLEL),
}
# Config fields that are not part of a family's model: `AttnResConfig` sets its own.
_NOT_COPIED = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")


def _supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def source_architecture(config: PreTrainedConfig) -> Family:
    """The family `config` declares, or a `ConversionError` that names what was found and why it does not convert."""
    architectures = list(getattr(config, "architectures", None) or [])
    if len(architectures) != 1:
        raise ConversionError(
            f"The source config declares architectures={architectures!r}; exactly one is needed to know how to "
            f"convert it. Supported: {_supported_list()}."
        )
    name = architectures[0]
    if getattr(config, "use_parallel_residual", False) or getattr(config, "parallel_attn", False):
        raise ConversionError(f"{name} uses {_PARALLEL}; AttnRes conversion is exact only for residual-sum decoders.")
    if config.model_type in REFUSED_MODEL_TYPES or getattr(config, "do_layer_norm_before", True) is False:
        reason = REFUSED_MODEL_TYPES.get(config.model_type, _POST_NORM)
        raise ConversionError(f"{name} uses {reason}; AttnRes conversion is exact only for residual-sum decoders.")
    family = SUPPORTED_ARCHITECTURES.get(name)
    if family is None or family.model_type != config.model_type:
        raise ConversionError(
            f"Unsupported architecture {name} (model_type {config.model_type!r}): attnres/families.py has no row "
            f"for it. Supported: {_supported_list()}."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ConversionError(f"{name} has use_bidirectional_attention=True: an encoder, not a causal decoder.")
    return family


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
    """The `AttnResConfig` computing what `source` computes (every field of its family copied verbatim) with the
    chosen residual."""
    family = source_architecture(source)
    sublayers = 2 * source.num_hidden_layers
    if block_size is not None and not 1 <= block_size <= sublayers:
        raise ConversionError(f"block_size={block_size!r}: must be {block_size_rule(sublayers)}")
    fields = {name: value for name, value in source.to_dict().items() if name not in _NOT_COPIED}
    return AttnResConfig(
        **fields,
        family=family.model_type,
        residual_mode=mode,
        block_size=block_size,
        exact_retrofit=exact_retrofit,
        architectures=["AttnResForCausalLM"],
    )


# Tensors some checkpoints carry that are recomputed from the config, not learned.
_DERIVED_BUFFER = re.compile(r"\.rotary_emb\.inv_freq$")
# The per-expert layout MoE checkpoints are stored in (and Transformers saves them in): Mixtral's `w1` (gate), `w3`
# (up) and `w2` (down) under `block_sparse_moe`, Qwen's `gate_proj`, `up_proj` and `down_proj` under `mlp`.
_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


class TensorRenamer:
    """Streams source tensors into AttnRes names, shard by shard.

    Tensors keep the family's names. MoE checkpoints in the per-expert layout are fused into the stacked
    `mlp.experts.gate_up_proj` / `mlp.experts.down_proj` tensors that the family's experts module holds (as
    Transformers fuses them when it loads one); a layer's experts may span shards, so they wait in a buffer until the
    layer's last expert tensor arrives.
    """

    def __init__(self, config: AttnResConfig):
        self.num_experts = config.num_experts if FAMILIES[config.family].moe else 0
        self.tied = config.tie_word_embeddings
        self._pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if _DERIVED_BUFFER.search(name) or (self.tied and name == "lm_head.weight"):
            return
        expert = _PER_EXPERT.match(name)
        if expert is None:
            yield name.replace(".block_sparse_moe.", ".mlp."), tensor
            return
        layer, index, kind = expert.group(1), int(expert.group(2)), _EXPERT_PART[expert.group(3)]
        if not 0 <= index < self.num_experts:
            raise ConversionError(f"{name}: expert {index} does not exist (the config has {self.num_experts} experts).")
        pending = self._pending.setdefault(layer, {})
        pending[kind, index] = tensor
        if len(pending) == 3 * self.num_experts:
            del self._pending[layer]
            experts = range(self.num_experts)
            gate = torch.stack([pending["gate", e] for e in experts])
            up = torch.stack([pending["up", e] for e in experts])
            yield f"{layer}.mlp.experts.gate_up_proj", torch.cat([gate, up], dim=1)
            yield f"{layer}.mlp.experts.down_proj", torch.stack([pending["down", e] for e in experts])

    def finish(self) -> None:
        """Fail if some layer's experts never completed (a truncated or inconsistent checkpoint)."""
        if self._pending:
            layer, tensors = next(iter(self._pending.items()))
            raise ConversionError(
                f"{layer}: only {len(tensors)} of {3 * self.num_experts} expert tensors (gate, up and down per expert) "
                "were found in the checkpoint."
            )


def is_depth_parameter(name: str) -> bool:
    """The parameters AttnRes adds: a pseudo-query and a key-norm gain per depth-mixing module."""
    return bool(re.search(r"_residual\.query\.(pseudo_query|key_norm_weight)$", name))


def initial_depth_parameter(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Zero pseudo-queries (uniform depth attention: the retrofit identity) and unit key-norm gains."""
    if name.endswith("pseudo_query"):
        return torch.zeros(shape, dtype=dtype)
    return torch.ones(shape, dtype=dtype)
