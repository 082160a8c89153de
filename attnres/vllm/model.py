"""AttnRes as a native vLLM model: each family's own vLLM modules for the sublayers, this package's depth mixing
between them (docs/serving.md#vllm).

The decoder layers hold the family's vLLM modules (`families.NATIVE_FAMILIES`): attention over the paged KV cache,
the fused MLP or MoE, the norms and the tensor-parallel linears. In front of every sublayer and of the final norm
sits the Transformers model's own depth-mixing module (`depth_mixing.depth_mixer`), computing the same function in
the same code: the two-phase form of docs/design.md §6, which vLLM's compilation traces and inductor fuses as it does
through the Transformers backend. vLLM feeds every forward pass one flattened `[num_tokens]` batch of several
sequences; depth attention is per token, so it needs nothing of the batch's layout.

Pipeline stages hand on the depth state as `IntermediateTensors` (`Boundary`). Tensor parallelism shards the
family's linears, attention heads and experts; the depth-mixing parameters are replicated: every rank holds whole
hidden states between sublayers (the row-parallel output projections all-reduce them), and a depth step reads all
of a token's channels at once.
"""

import re
from collections.abc import Iterable
from itertools import islice
from typing import NamedTuple

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.distributed import get_pp_group
from vllm.logger import init_logger
from vllm.model_executor.layers import layernorm
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import SupportsPP
from vllm.model_executor.models.utils import (
    AutoWeightsLoader,
    PPMissingLayer,
    WeightsMapper,
    extract_layer_index,
    make_empty_intermediate_tensors_factory,
    make_layers,
    maybe_prefix,
)
from vllm.sequence import IntermediateTensors

from ..depth_mixing import DepthAttention, DepthQuery, PendingInput, depth_mixer, gather_queries
from ..depth_state import DepthContext, DepthState, ResidualStream
from ..families import norm_eps
from .families import NATIVE_FAMILIES, NativeFamily, why_not_native


# Under vLLM's logger, which vLLM configures (level, format) in each of its processes.
logger = init_logger("vllm.attnres")


def pre_norm(norm: nn.Module, mixed: torch.Tensor | PendingInput) -> torch.Tensor:
    """`norm(mixed)` for the norm in front of a sublayer or of the output. vLLM's `RMSNorm` computes Llama's function,
    so a depth step's pending input goes to the kernel that computes the step's last phase fused with that norm
    (docs/design.md §6), as the Transformers model's `AttnResRMSNorm` does: one call in place of phase 2's and the
    norm's, whose input never goes through memory. Any other norm (Gemma's `1 + w`) reads the step's result computed."""
    if not isinstance(mixed, PendingInput):
        return norm(mixed)
    if type(norm) is layernorm.RMSNorm and norm.has_weight and norm.variance_size_override is None:
        return mixed.normalized(norm.weight, norm.variance_epsilon)
    return norm(mixed.value())


def keep_in_float32(mixer: nn.Module) -> nn.Module:
    """The mixer with its pseudo-query, key-norm gain and output scale in fp32, whatever dtype vLLM builds the model
    in: they are read in fp32 anyway (docs/design.md §6, "Mixed precision")."""
    return mixer.float() if isinstance(mixer, DepthAttention) else mixer


class AttnResDecoderLayer(nn.Module):
    """One decoder layer: the family's vLLM attention and MLP under the family's names, each behind its depth-mixing
    module (`attn_residual`, `mlp_residual`), as the Transformers model's layer holds them."""

    def __init__(self, vllm_config: VllmConfig, family: NativeFamily, prefix: str):
        super().__init__()
        config = vllm_config.model_config.hf_config
        for name, module in family.decoder_layer(vllm_config, prefix).named_children():
            self.add_module(name, module)
        self.mlp_name, self.mlp_norm_name = family.mlp, family.mlp_norm
        self.attn_post_norm_name, self.mlp_post_norm_name = family.post_norms
        first = config.layer_offsets[extract_layer_index(prefix)] + 1  # docs/design.md §1
        self.attn_residual = keep_in_float32(depth_mixer(config, first))
        self.mlp_residual = keep_in_float32(depth_mixer(config, first + 1))

    def forward(
        self, positions: torch.Tensor, state: DepthState | ResidualStream, context: DepthContext
    ) -> DepthState | ResidualStream:
        hidden_states = pre_norm(self.input_layernorm, self.attn_residual(state, context))
        output = self.self_attn(positions=positions, hidden_states=hidden_states)
        if self.attn_post_norm_name is not None:
            output = getattr(self, self.attn_post_norm_name)(output)
        state = self.attn_residual.absorb(output, state, context)

        hidden_states = pre_norm(getattr(self, self.mlp_norm_name), self.mlp_residual(state, context))
        output = getattr(self, self.mlp_name)(hidden_states)
        if self.mlp_post_norm_name is not None:
            output = getattr(self, self.mlp_post_norm_name)(output)
        return self.mlp_residual.absorb(output, state, context)


class Boundary(NamedTuple):
    """The depth state as it crosses the pipeline-stage boundary after `position` sublayers: the completed blocks
    (b_0, the embedding, first; for Full AttnRes every output so far) and, where the boundary falls inside a block,
    the partial sum, each `[num_tokens, hidden_size]` under a name of its own; the residual stream in standard mode.
    The names are fixed by the position, so the receiving stage preallocates them
    (`make_empty_intermediate_tensors`)."""

    num_blocks: int
    has_partial: bool
    standard: bool

    @classmethod
    def after(cls, config, position: int) -> "Boundary":
        if config.residual_mode == "standard":
            return cls(0, False, True)
        block_size = config.depth_block_size
        return cls(position // block_size + 1, position % block_size != 0, False)

    @property
    def keys(self) -> list[str]:
        if self.standard:
            return ["hidden_states"]
        return [f"block_{n}" for n in range(self.num_blocks)] + (["partial"] if self.has_partial else [])

    def tensors(self, state: DepthState | ResidualStream) -> IntermediateTensors:
        values = (state.hidden_states,) if self.standard else (*state.blocks, state.partial)
        return IntermediateTensors(dict(zip(self.keys, values)))  # no `partial` key where it is `None`

    def blocks_and_partial(self, tensors: IntermediateTensors) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """What `tensors` sends of a depth state, received: its completed blocks and its partial sum (`None` where the
        boundary closes a block)."""
        values = [tensors[key] for key in self.keys]
        return tuple(values[: self.num_blocks]), values[-1] if self.has_partial else None


@support_torch_compile
class AttnResModel(nn.Module):
    """The embedding, this stage's decoder layers and, on the last stage, the output step and the final norm."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        family = NATIVE_FAMILIES[config.family]
        self.config = config
        self.quant_config = vllm_config.quant_config
        pp = get_pp_group()
        if pp.is_first_rank or (config.tie_word_embeddings and pp.is_last_rank):
            self.embed_tokens = VocabParallelEmbedding(
                config.vocab_size, config.hidden_size, quant_config=self.quant_config, prefix=f"{prefix}.embed_tokens"
            )
        else:
            self.embed_tokens = PPMissingLayer()
        if family.embedding_scale:  # in the model's dtype, as the family's model rounds it
            self.register_buffer("embedding_scale", torch.tensor(config.hidden_size**0.5), persistent=False)
        else:
            self.embedding_scale = None
        self.start_layer, self.end_layer, self.layers = make_layers(
            config.num_hidden_layers,
            lambda prefix: AttnResDecoderLayer(vllm_config, family, prefix),
            prefix=f"{prefix}.layers",
        )
        self.output_residual = keep_in_float32(depth_mixer(config, config.num_sublayers + 1))
        # The queries of the steps on other stages, by layer: a stage scores a whole block's queries when the block
        # before it closes, and a block may span a stage boundary (docs/design.md §6, §11).
        self.two_phase = self.output_residual.two_phase
        self.remote_queries = nn.ModuleDict(
            {
                str(index): nn.ModuleDict({kind: DepthQuery(config.hidden_size).float() for kind in ("attn", "mlp")})
                for index in range(config.num_hidden_layers)
                if self.two_phase and not self.start_layer <= index < self.end_layer
            }
        )
        self.folded_queries: tuple[torch.Tensor, ...] | None = None
        if pp.is_last_rank:
            self.norm = getattr(layernorm, family.norm)(config.hidden_size, eps=norm_eps(config))
        else:
            self.norm = PPMissingLayer()
        self.received = Boundary.after(config, config.layer_offsets[self.start_layer])
        self.sent = Boundary.after(config, config.layer_offsets[self.end_layer])
        self.make_empty_intermediate_tensors = make_empty_intermediate_tensors_factory(
            self.received.keys, config.hidden_size
        )

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        embeddings = self.embed_tokens(input_ids)
        return embeddings if self.embedding_scale is None else embeddings * self.embedding_scale

    def depth_steps(self) -> list[DepthQuery]:
        """Every step's `DepthQuery` in sublayer order, the output's last: this stage's layers' own, the others'
        copies."""
        steps = []
        for index, layer in enumerate(self.layers):
            if self.start_layer <= index < self.end_layer:
                steps += [layer.attn_residual.query, layer.mlp_residual.query]
            else:
                steps += self.remote_queries[str(index)].values()
        return [*steps, self.output_residual.query]

    def depth_queries(self) -> tuple[torch.Tensor, ...] | None:
        """The folded queries (docs/design.md §6): folded once after loading for eager passes, and in the graph under
        torch.compile, where reading them costs nothing but would otherwise be constants of the compiled code."""
        if not self.two_phase:
            return None
        if self.folded_queries is None or torch.compiler.is_compiling():
            return gather_queries(self.depth_steps())
        return self.folded_queries

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        first_mixer = self.layers[self.start_layer].attn_residual
        if get_pp_group().is_first_rank:
            embeddings = self.embed_input_ids(input_ids) if inputs_embeds is None else inputs_embeds
            state, context = first_mixer.initial_state(embeddings, self.depth_queries(), False)
        elif self.received.standard:
            state, context = ResidualStream(intermediate_tensors["hidden_states"]), DepthContext()
        else:
            blocks, partial = self.received.blocks_and_partial(intermediate_tensors)
            state, context = first_mixer.resumed_state(blocks, partial, self.depth_queries())
        for layer in islice(self.layers, self.start_layer, self.end_layer):
            state = layer(positions, state, context)
        if not get_pp_group().is_last_rank:
            return self.sent.tensors(state)
        return pre_norm(self.norm, self.output_residual(state, context))

    def remote_query_name(self, name: str) -> str:
        """The name under which this stage loads a checkpoint tensor: a depth query of another stage's layer goes to
        its copy in `remote_queries`."""
        match = re.fullmatch(r"model\.layers\.(\d+)\.(attn|mlp)_residual\.query\.(\w+)", name)
        if match is None or match[1] not in self.remote_queries:
            return name
        return f"model.remote_queries.{match[1]}.{match[2]}.{match[3]}"


class AttnResForCausalLM(nn.Module, SupportsPP):
    """`AttnResForCausalLM` in vLLM, registered by attnres's plugin (`attnres.vllm.register`).

    A checkpoint whose family has no native row, or whose residual mode is not native, is served by vLLM's
    Transformers modeling backend instead: this class then builds that backend's model, and says so in one log line.
    """

    def __new__(cls, *, vllm_config: VllmConfig, prefix: str = ""):
        reason = why_not_native(vllm_config.model_config.hf_config)
        if reason is None:
            return super().__new__(cls)
        from vllm.model_executor.models.transformers import TransformersForCausalLM, TransformersMoEForCausalLM

        backend = TransformersMoEForCausalLM if vllm_config.model_config.is_moe else TransformersForCausalLM
        logger.info("AttnRes: %s; serving it with vLLM's Transformers modeling backend (%s)", reason, backend.__name__)
        return backend(vllm_config=vllm_config, prefix=prefix)

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.config = config
        family = NATIVE_FAMILIES[config.family]
        self.hf_to_vllm_mapper = family.cls(family.model).hf_to_vllm_mapper | WeightsMapper(
            orig_to_new_substr=family.renamed
        )
        self.model = AttnResModel(vllm_config=vllm_config, prefix=maybe_prefix(prefix, "model"))
        if get_pp_group().is_last_rank:
            self.lm_head = ParallelLMHead(
                config.vocab_size,
                config.hidden_size,
                quant_config=vllm_config.quant_config,
                prefix=maybe_prefix(prefix, "lm_head"),
            )
            if config.tie_word_embeddings:
                self.lm_head = self.lm_head.tie_weights(self.model.embed_tokens)
            soft_cap = getattr(config, "final_logit_softcapping", None)
            self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=soft_cap)
        else:
            self.lm_head = PPMissingLayer()
        self.make_empty_intermediate_tensors = self.model.make_empty_intermediate_tensors

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: IntermediateTensors | None = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor | IntermediateTensors:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        return self.logits_processor(self.lm_head, hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The checkpoint as saved: the family's tensor names, stacked into vLLM's fused parameters by the family's
        mapping; then the folded queries, once."""
        renamed = ((self.model.remote_query_name(name), tensor) for name, tensor in weights)
        loaded = AutoWeightsLoader(self).load_weights(renamed, mapper=self.hf_to_vllm_mapper)
        if self.model.two_phase:
            with torch.no_grad():
                self.model.folded_queries = gather_queries(self.model.depth_steps())
        return loaded
