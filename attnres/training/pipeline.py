"""Pipeline-parallel training of AttnRes models on PyTorch's own engine, `torch.distributed.pipelining`, with the
paper's cross-stage caching (docs/design.md §11; the recipe: docs/training.md#pipeline-parallel).

    layout = PipelineLayout.of(model, num_ranks=world, stages_per_rank=2)
    modules = stage_modules(model, layout, rank)                 # this rank's stages, under the model's names
    stages = [CachingPipelineStage(module, device) for module in modules]
    schedule = pipeline_schedule("interleaved-1f1b", stages, microbatches=4, loss=PipelineLoss(model.config))
    schedule.step(input_ids, target=labels, losses=losses)   # ids on the first stage's rank, labels on the last's

A stage runs whole decoder layers; the first holds the embedding, the last the output's depth mixing, the final norm
and the LM head. What crosses a boundary is the depth state as tensors (`Boundary`): the completed blocks, the
partial sum of the current block (the residual stream in standard mode), and, for an MoE model's load-balancing
loss, the router logits of the layers before it; and what the attention passes on beside the stream where the family
threads state between layers (GLM-5's top-k indices, Kolibri 1.1's key pool and shared keys and values). Stage s runs
on rank s % num_ranks (the engine's loop placement), so with several stages per rank a microbatch comes back to a rank
that already holds the blocks it received or produced there: each rank keeps them (`CrossStageCache`), and a boundary
sends only what the receiving rank lacks.
"""

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleLoopedBFS,
)
from torch.distributed.tensor import DTensor
from transformers.loss.loss_utils import ForCausalLMLoss

from ..depth_mixing import gather_queries
from ..depth_state import DepthContext, ResidualStream
from ..families import FAMILIES
from ..modeling_attnres import (
    AttnResForCausalLM,
    attention_masks,
    family_attention_inputs,
    family_embeddings,
    family_logits,
    pre_norm,
    rotary_embeddings,
    with_family_z_loss,
)


# The engine's schedules whose backward is one pass per stage and microbatch. Cached blocks receive their gradients
# from the later stages that read them by accumulating into the tensors the rank holds (`CrossStageCache`); the
# zero-bubble schedules split that pass into an input pass computed with `autograd.grad`, which accumulates nothing.
SINGLE_STAGE_SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
MULTI_STAGE_SCHEDULES = {"interleaved-1f1b": ScheduleInterleaved1F1B, "looped-bfs": ScheduleLoopedBFS}
SCHEDULES = {**SINGLE_STAGE_SCHEDULES, **MULTI_STAGE_SCHEDULES}
RESIDUAL_MODES = ("standard", "block", "full")


class Transfer(NamedTuple):
    """What one stage boundary sends of a microbatch: which completed blocks (b_0, the embedding, is block 0),
    whether the partial sum (the residual stream in standard mode), which router logits (counted over the layers
    that have a router), whether what the last layer's attention threads to the next (`Sublayer.threaded`), and the
    entries of the object the layers' attention shares (`Sublayer.shared`), by the layer that left each, of
    `entry_size` tensors."""

    blocks: range
    partial: bool
    router_logits: range
    threaded: bool
    shared: tuple[int, ...]
    entry_size: int

    @property
    def num_tensors(self) -> int:
        depth_state = len(self.blocks) + self.partial
        return depth_state + len(self.router_logits) + self.threaded + len(self.shared) * self.entry_size


class PipelineLayout(NamedTuple):
    """How a model is split: the decoder layers of each stage, as even as the layer count allows (the first stages
    take one more), and what each boundary cuts through.

    stage_layers: the decoder layers of each stage, in order; stage s runs on rank s % num_ranks.
    num_ranks: the pipeline's processes.
    layer_offsets: the sublayers before each decoder layer, L last (`AttnResConfig.layer_offsets`, docs/design.md §1).
    block_size: sublayers per block, or `None` in standard mode, whose state is the residual stream alone.
    router_layers: the layers whose router logits the load-balancing loss reads (none unless the model computes it),
        each once per router it runs (JetMoE's layers run two).
    threaded_layers: the layers whose attention returns a tensor that the next layer's attention takes
        (`Sublayer.threaded`, `Sublayer.threaded_from`).
    shared_sources: per layer, the layer whose entry of the shared object its attention reads, its own index where it
        reads none (`SharedStates.sources`); empty where the family's attention shares none.
    entry_size: the tensors of such an entry (`SharedStates.entry_size`).
    """

    stage_layers: tuple[range, ...]
    num_ranks: int
    layer_offsets: tuple[int, ...]
    block_size: int | None
    router_layers: tuple[int, ...]
    threaded_layers: tuple[int, ...]
    shared_sources: tuple[int, ...]
    entry_size: int

    @classmethod
    def of(cls, model: AttnResForCausalLM, num_ranks: int, stages_per_rank: int = 1) -> "PipelineLayout":
        """The layout of `model` over `num_ranks` processes with `stages_per_rank` stages each.

        Raises:
            ValueError: a residual mode other than standard, Block or Full AttnRes (or an ablation of it), tied input
                and output embeddings, fewer than 2 ranks, or more stages than decoder layers.
        """
        config = model.config
        if config.residual_mode not in RESIDUAL_MODES or config.depth_ablation is not None:
            mode = config.residual_mode if config.depth_ablation is None else f"{config.residual_mode} with ablation"
            raise ValueError(
                f"residual_mode={mode!r}: pipeline stages split the standard, Block and Full AttnRes models only"
            )
        if getattr(config, "tie_word_embeddings", False):
            raise ValueError(
                "tie_word_embeddings=True: the first stage's embedding and the last stage's LM head would be one "
                "weight on two ranks; pipeline stages split untied models only"
            )
        if num_ranks < 2:
            raise ValueError(f"num_ranks={num_ranks}: a pipeline needs at least 2 ranks")
        num_stages = num_ranks * stages_per_rank
        num_layers = config.num_hidden_layers
        if stages_per_rank < 1 or num_stages > num_layers:
            raise ValueError(
                f"{num_ranks} ranks x stages_per_rank={stages_per_rank} = {num_stages} stages: a stage holds at "
                f"least one of the {num_layers} decoder layers, so at most {num_layers} stages"
            )
        per_stage, remainder = divmod(num_layers, num_stages)
        bounds = [0]
        for stage in range(num_stages):
            bounds.append(bounds[-1] + per_stage + (stage < remainder))
        layers = tuple(range(start, stop) for start, stop in zip(bounds, bounds[1:]))
        block_size = None if config.residual_mode == "standard" else config.depth_block_size
        family = FAMILIES[config.family]
        moe = family.moe
        with_aux_loss = bool(moe and moe.load_balancing_loss and config.output_router_logits)
        routers = tuple(
            i for i, layer in enumerate(model.model.layers) if with_aux_loss for _ in moe.routers_of(layer)
        )
        shared = family.shared_states
        sources = tuple(family.config_value(config, shared.sources)) if shared else ()
        return cls(
            layers,
            num_ranks,
            config.layer_offsets,
            block_size,
            routers,
            family.threaded_layers(config),
            sources,
            shared.entry_size if shared else 0,
        )

    @property
    def num_stages(self) -> int:
        return len(self.stage_layers)

    @property
    def num_sublayers(self) -> int:
        return self.layer_offsets[-1]

    def sublayers_through(self, stage: int) -> int:
        """The sublayers of the stages up to `stage`, included: the position of its last sublayer."""
        return self.layer_offsets[self.stage_layers[stage].stop]

    def rank(self, stage: int) -> int:
        return stage % self.num_ranks

    def blocks_after(self, stage: int) -> int:
        """The completed blocks (b_0 included) after `stage`: the last sublayer of the network closes the last
        block (docs/design.md §4); 0 in standard mode."""
        if self.block_size is None:
            return 0
        sublayers = self.sublayers_through(stage)
        closed = math.ceil if sublayers == self.num_sublayers else math.floor
        return 1 + closed(sublayers / self.block_size)

    def routers_after(self, stage: int) -> int:
        """The router logits produced up to the end of `stage`."""
        return sum(layer < self.stage_layers[stage].stop for layer in self.router_layers)

    def partial_after(self, stage: int) -> bool:
        """Whether the boundary after `stage` cuts a block (or carries the residual stream, in standard mode)."""
        return self.block_size is None or self.sublayers_through(stage) % self.block_size != 0

    def threaded_after(self, stage: int) -> bool:
        """Whether the boundary after `stage` carries what its last layer's attention threads to the next layer's."""
        return self.stage_layers[stage].stop - 1 in self.threaded_layers

    def shared_after(self, stage: int) -> tuple[int, ...]:
        """The layers up to the end of `stage` whose entries of the shared object a layer of a later stage reads, in
        order: an entry whose readers have all run is not carried on."""
        stop = self.stage_layers[stage].stop
        return tuple(sorted({source for layer, source in enumerate(self.shared_sources) if source < stop <= layer}))

    def transfer(self, stage: int, cached: bool) -> Transfer:
        """What the boundary after `stage` sends. Without caching, everything the next stage reads; with it, only
        what its rank did not hold after its previous stage, `num_ranks` stages back (the threaded tensor, the last
        layer's, always)."""
        last_seen = stage + 1 - self.num_ranks
        seen = cached and last_seen >= 0
        known_blocks = self.blocks_after(last_seen) if seen else 0
        known_routers = self.routers_after(last_seen) if seen else 0
        known_shared = self.shared_after(last_seen) if seen else ()
        return Transfer(
            range(known_blocks, self.blocks_after(stage)),
            self.partial_after(stage),
            range(known_routers, self.routers_after(stage)),
            self.threaded_after(stage),
            tuple(layer for layer in self.shared_after(stage) if layer not in known_shared),
            self.entry_size,
        )

    def tensors_sent(self, cached: bool) -> int:
        """Tensors the forward pass sends per microbatch, over every boundary."""
        return sum(self.transfer(stage, cached).num_tensors for stage in range(self.num_stages - 1))


class Boundary(NamedTuple):
    """The state that crosses a stage boundary, as tensors (`Transfer` says which of it a boundary sends): the depth
    state, the router logits, what the attention threads to the next layer and the entries of the object it shares."""

    blocks: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None
    router_logits: tuple[torch.Tensor, ...]
    threaded: torch.Tensor | None
    shared: tuple[tuple[torch.Tensor, ...], ...]

    def flatten(self) -> tuple[torch.Tensor, ...]:
        """The tensors in order, each contiguous: the engine sends a tensor's memory as it lies, and the keys and values
        an attention shares may be views (Kolibri 1.1's, transposed); a contiguous tensor is sent as it is."""
        partial = () if self.partial is None else (self.partial,)
        threaded = () if self.threaded is None else (self.threaded,)
        tensors = (*self.blocks, *partial, *self.router_logits, *threaded, *(t for entry in self.shared for t in entry))
        return tuple(tensor.contiguous() for tensor in tensors)

    @classmethod
    def unflatten(cls, tensors: Sequence[torch.Tensor], transfer: Transfer) -> "Boundary":
        blocks, rest = tuple(tensors[: len(transfer.blocks)]), tensors[len(transfer.blocks) :]
        partial, rest = (rest[0], rest[1:]) if transfer.partial else (None, rest)
        router_logits, rest = tuple(rest[: len(transfer.router_logits)]), rest[len(transfer.router_logits) :]
        threaded, rest = (rest[0], rest[1:]) if transfer.threaded else (None, rest)
        return cls(blocks, partial, router_logits, threaded, entries(rest, transfer.entry_size))


def entries(tensors: Sequence[torch.Tensor], size: int) -> tuple[tuple[torch.Tensor, ...], ...]:
    """`tensors` in entries of `size` tensors each, in order; none where the family's attention shares no object
    (`size` 0)."""
    if size == 0:
        return ()
    return tuple(tuple(tensors[start : start + size]) for start in range(0, len(tensors), size))


class CachedCopy(NamedTuple):
    """The copy of a tensor produced on this rank that the rank's later stages read (a leaf sharing its memory)."""

    tensor: torch.Tensor


class AddCachedGradient(torch.autograd.Function):
    """The identity on a tensor that its stage produced and sends on, whose backward adds the gradient that later
    stages of the same rank left on its cached copy. The engine runs each stage's backward on its own graph; the
    later stages read the copy, a leaf, so their backward accumulates into it, and runs first: a stage's backward
    needs the gradient of the next stage, which needs the one after, up to every stage that read the copy."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, copy: CachedCopy) -> torch.Tensor:
        ctx.copy = copy
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        cached_grad = ctx.copy.tensor.grad
        return (grad if cached_grad is None else grad + cached_grad), None


class Held(NamedTuple):
    """What a rank holds of one microbatch after running one of its stages: the completed blocks and the router
    logits so far, and the entries of the attention's shared object that later layers read, by the layer that left
    each; every tensor a leaf that the rank's later stages read as it is (`CrossStageCache`)."""

    blocks: tuple[torch.Tensor, ...] = ()
    router_logits: tuple[torch.Tensor, ...] = ()
    shared: Mapping[int, tuple[torch.Tensor, ...]] = MappingProxyType({})


class CrossStageCache:
    """Per microbatch, what this rank holds after the last stage it ran of it (the paper's cross-stage caching).

    Received tensors are the engine's receive buffers, autograd leaves of the stage that received them: a later stage
    reading one accumulates its gradient there, where the engine reads the receiving stage's input gradient after
    that stage's backward (which runs later, see `AddCachedGradient`). Tensors produced on this rank are kept as a
    leaf sharing their memory, whose gradient `AddCachedGradient` adds in the producing stage's backward. Entries
    last one schedule step (`CachingPipelineStage.clear_runtime_states`).
    """

    def __init__(self):
        self.entries: dict[int | None, Held] = {}

    def held(self, microbatch: int | None) -> Held:
        return self.entries.get(microbatch, Held())

    def hold(self, microbatch: int | None, held: Held) -> None:
        self.entries[microbatch] = held

    def clear(self) -> None:
        self.entries.clear()


class AttnResStage(nn.Module):
    """The part of an `AttnResForCausalLM` that one pipeline stage runs, holding the model's own modules under their
    names in the model (`model.layers.5.self_attn.q_proj.weight`, `lm_head.weight`), so that state dicts and
    gradients line up with the whole model's.

    `forward` takes the token ids (first stage) or the tensors of the `Boundary` before it, and returns those of the
    boundary after it, or, on the last stage, the logits and, for an MoE model, its load-balancing loss `[1]` over
    every layer's router logits (the family's `load_balancing_loss_func`, as the model computes it).
    """

    def __init__(self, model: AttnResForCausalLM, layout: PipelineLayout, stage: int, cache: CrossStageCache | None):
        super().__init__()
        self.config = model.config
        self.layout = layout
        self.stage_index = stage
        self.cache = cache
        self.is_first, self.is_last = stage == 0, stage == layout.num_stages - 1
        backbone = model.model
        # The backbone's parts this stage runs, under their names in `AttnResModel`.
        self.model = nn.Module()
        if self.is_first:
            self.model.embed_tokens = backbone.embed_tokens
            self.model.embed_positions = backbone.embed_positions
            self.model.embedding_norm = backbone.embedding_norm
            if FAMILIES[self.config.family].final_norm_on_embeddings:
                self.model.norm = backbone.norm
        self.model.layers = nn.ModuleDict({str(i): backbone.layers[i] for i in layout.stage_layers[stage]})
        self.model.rotary_emb = backbone.rotary_emb  # buffers only: every stage may hold it
        if self.is_last:
            self.model.output_residual = backbone.output_residual
            self.model.norm = backbone.norm
            self.model.fusable_norm = backbone.fusable_norm
            self.lm_head = model.lm_head
            self.prediction_head = model.prediction_head
        # The microbatch the stage runs, which `CachingPipelineStage` sets around each forward; `None` outside them,
        # where the engine infers what the stage returns by running it on tensors of arbitrary values.
        self.microbatch: int | None = 0
        self.recorded_router_logits: list[torch.Tensor] | None = None
        moe = FAMILIES[self.config.family].moe
        for index in layout.stage_layers[stage]:
            if index in layout.router_layers:
                for router in moe.routers_of(backbone.layers[index]):
                    router.register_forward_hook(self.record_router_logits)

    def record_router_logits(self, module: nn.Module, args: tuple, output: tuple | torch.Tensor) -> None:
        """Forward hook on a router: its logits, while this stage's forward runs (not in a checkpointed layer's
        recomputation during the backward pass); the whole output of a router that returns its logits alone (DBRX's),
        as Transformers' recorder takes it."""
        if self.recorded_router_logits is not None:
            logits = output[FAMILIES[self.config.family].moe.logits_index] if isinstance(output, tuple) else output
            self.recorded_router_logits.append(logits)

    @property
    def first_mixer(self) -> nn.Module:
        return next(iter(self.model.layers.values())).attn_residual

    def depth_queries(self) -> tuple[torch.Tensor, ...] | None:
        """Every step's folded query in sublayer order, as `AttnResModel.depth_queries` gives them, for the steps
        this stage holds; a step held by another stage has a zero in its place. Such a query is read only where
        phase 1 runs for a whole block that a boundary cuts (the step before the boundary closes the block before,
        or the stage after resumes inside it), and the rows it gives there are never read: each stage computes its
        own steps' rows."""
        if not self.first_mixer.two_phase:
            return None
        mixers = [mixer for layer in self.model.layers.values() for mixer in layer.depth_mixers]
        if self.is_last:
            mixers.append(self.model.output_residual)
        queries = gather_queries([mixer.query for mixer in mixers])
        if queries is None:
            return None
        by_position = {mixer.position: query for mixer, query in zip(mixers, queries)}
        placeholder = queries[0].new_zeros(queries[0].shape)
        return tuple(by_position.get(position, placeholder) for position in range(1, self.config.num_sublayers + 2))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        cached = self.cache is not None
        if self.is_first:
            embed_tokens = self.model.embed_tokens  # in the model's mode, where a stage is built in training mode
            position_ids = torch.arange(inputs[0].shape[1], device=inputs[0].device).unsqueeze(0)
            inputs_embeds = family_embeddings(
                self.config,
                embed_tokens(inputs[0]),
                self.model.embed_positions,
                position_ids,
                embed_tokens.training,
                self.model.embedding_norm,
                getattr(self.model, "norm", None),
            )
            state, context = self.first_mixer.initial_state(inputs_embeds, self.depth_queries(), False)
            started_from, previous_threaded = Held(), None
        else:
            if self.microbatch is None:
                # The engine's inference: arbitrary integers would index out of range (GLM-5's top-k indices), zeros
                # do not.
                inputs = tuple(t if t.is_floating_point() else torch.zeros_like(t) for t in inputs)
            held = self.cache.held(self.microbatch) if cached else Held()
            transfer = self.layout.transfer(self.stage_index - 1, cached)
            received = Boundary.unflatten(inputs, transfer)
            started_from = Held(
                held.blocks + received.blocks,
                held.router_logits + received.router_logits,
                {**held.shared, **dict(zip(transfer.shared, received.shared))},
            )
            previous_threaded = received.threaded
            if self.layout.block_size is None:
                state, context = ResidualStream(received.partial), DepthContext()
            else:
                state, context = self.first_mixer.resumed_state(
                    started_from.blocks, received.partial, self.depth_queries()
                )
        hidden_states = state.hidden_states if isinstance(state, ResidualStream) else state.blocks[0]

        position_ids = torch.arange(hidden_states.shape[1], device=hidden_states.device).unsqueeze(0)
        attention_types = dict.fromkeys(layer.attention_type for layer in self.model.layers.values())
        masks = attention_masks(self.config, attention_types, hidden_states, None, None, position_ids)
        masks, attention_bias = family_attention_inputs(self.config, masks, hidden_states, None, None)
        rotary_types = dict.fromkeys(layer.rotary_type for layer in self.model.layers.values())
        position_embeddings = rotary_embeddings(
            self.model.rotary_emb, FAMILIES[self.config.family], rotary_types, hidden_states, position_ids
        )
        self.recorded_router_logits = []
        threaded = self.threaded_state(previous_threaded, started_from.shared)
        try:
            for layer in self.model.layers.values():
                state = layer(
                    state,
                    depth_context=context,
                    threaded=threaded,
                    attention_mask=masks[layer.attention_type],
                    position_embeddings=position_embeddings[layer.rotary_type],
                    position_ids=position_ids,
                    cache=None,
                    attention_bias=attention_bias,
                    use_cache=False,
                )
            router_logits = started_from.router_logits + tuple(self.recorded_router_logits)
        finally:
            self.recorded_router_logits = None

        if self.is_last:
            return self.output(state, context, router_logits)
        return self.hand_on(state, router_logits, started_from, threaded)

    def threaded_state(self, previous: torch.Tensor | None, shared: Mapping[int, tuple[torch.Tensor, ...]]) -> dict:
        """What the layers' attentions pass on beside the stream (`AttnResDecoderLayer`'s `threaded`) as the stage's
        first layer finds it in the whole model: what the previous layer's attention returned for it, and the family's
        shared object holding the entries of earlier layers that this stage's layers or later ones read."""
        threaded = {} if previous is None else {self.layout.stage_layers[self.stage_index].start - 1: previous}
        family = FAMILIES[self.config.family]
        if family.shared_states is not None:
            states = getattr(family.modeling, family.shared_states.cls)()
            states.update({str(layer): entry for layer, entry in shared.items()})
            threaded[family.shared_states.keyword] = states
        return threaded

    def output(self, state: NamedTuple, context: DepthContext, router_logits: tuple[torch.Tensor, ...]):
        """The logits, and the load-balancing loss `[1]` where the model computes one."""
        hidden_states = pre_norm(self.model.norm, self.model.output_residual(state, context), self.model.fusable_norm)
        logits = family_logits(self.config, self.lm_head, hidden_states, self.prediction_head)
        if not self.layout.router_layers:
            return logits
        aux_loss = FAMILIES[self.config.family].load_balancing_loss(self.config, router_logits, None)
        return logits, aux_loss.reshape(1)

    def hand_on(
        self, state: NamedTuple, router_logits: tuple[torch.Tensor, ...], started_from: Held, threaded: dict
    ) -> tuple:
        """The tensors the boundary after this stage sends; with caching, what the rank keeps first. The blocks and
        shared entries the stage started from are handed on and kept as the tensors it was given (an
        activation-checkpointed layer may return its inputs as new tensors of its own graph), those it completed or
        left as produced here."""
        if isinstance(state, ResidualStream):
            blocks, partial = (), state.hidden_states
        else:
            blocks, partial = started_from.blocks + state.blocks[len(started_from.blocks) :], state.partial
        shared_layers = self.layout.shared_after(self.stage_index)
        if shared_layers:
            states = threaded[FAMILIES[self.config.family].shared_states.keyword]
            shared = tuple(started_from.shared.get(layer) or tuple(states[str(layer)]) for layer in shared_layers)
        else:
            shared = ()
        cached = self.cache is not None
        if cached:
            # Everything produced here is sent (the receiving rank last saw this microbatch before this stage ran),
            # through `AddCachedGradient`. The entries the stage started from come first: they were left by the
            # layers of earlier stages.
            blocks, kept_blocks = keep(blocks, len(started_from.blocks))
            router_logits, kept_router_logits = keep(router_logits, len(started_from.router_logits))
            size, num_before = self.layout.entry_size, sum(layer in started_from.shared for layer in shared_layers)
            sent_shared, kept_shared = keep(tuple(t for entry in shared for t in entry), num_before * size)
            shared = entries(sent_shared, size)
            held = Held(kept_blocks, kept_router_logits, dict(zip(shared_layers, entries(kept_shared, size))))
            self.cache.hold(self.microbatch, held)
        transfer = self.layout.transfer(self.stage_index, cached)
        boundary = Boundary(
            tuple(blocks[i] for i in transfer.blocks),
            partial if transfer.partial else None,
            tuple(router_logits[i] for i in transfer.router_logits),
            threaded[self.layout.stage_layers[self.stage_index].stop - 1] if transfer.threaded else None,
            tuple(shared[shared_layers.index(layer)] for layer in transfer.shared),
        )
        return boundary.flatten()


def keep(tensors: tuple[torch.Tensor, ...], num_before: int) -> tuple[tuple, tuple]:
    """`tensors` as a stage sends them and as its rank keeps them: the first `num_before` (those it started from:
    received, or read from the cache) as they are; each later one, produced by the stage, kept as a leaf sharing its
    memory and sent through `AddCachedGradient`, which adds the leaf's gradient in the stage's backward pass. Without
    autograd (evaluation, an integer tensor) a tensor is kept as it is."""
    sent, kept = list(tensors[:num_before]), list(tensors[:num_before])
    for tensor in tensors[num_before:]:
        if not tensor.requires_grad:
            sent.append(tensor)
            kept.append(tensor)
            continue
        copy = CachedCopy(tensor.detach().requires_grad_())
        sent.append(AddCachedGradient.apply(tensor, copy))
        kept.append(copy.tensor)
    return tuple(sent), tuple(kept)


@dataclass
class Traffic:
    """Bytes a stage handed to the engine's sends: activations in the forward pass, their gradients in the
    backward pass."""

    activations: int = 0
    gradients: int = 0


class CachingPipelineStage(PipelineStage):
    """The engine's `PipelineStage` for an `AttnResStage`: it tells the module which microbatch it runs (so that it
    finds what its rank holds of it) or that it runs outside one (the engine's inference of what it returns, from
    inputs of arbitrary values), empties the rank's cache with the engine's own per-step state, and counts the bytes
    it sends (`traffic`)."""

    def __init__(self, module: AttnResStage, device: torch.device, group: dist.ProcessGroup | None = None):
        super().__init__(module, module.stage_index, module.layout.num_stages, device, group=group)
        module.microbatch = None  # until a chunk runs: the engine's inference of the stage's outputs comes first
        self.traffic = Traffic()

    def forward_one_chunk(
        self, fwd_chunk_id: int, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None, save_forward_output=True
    ):
        self.submod.microbatch = fwd_chunk_id
        try:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            self.submod.microbatch = None  # what the engine's shape inference runs under, outside any chunk

    def get_fwd_send_ops(self, fwd_chunk_id: int) -> list[dist.P2POp]:
        operations = super().get_fwd_send_ops(fwd_chunk_id)
        self.traffic.activations += sum(operation.tensor.nbytes for operation in operations)
        return operations

    def get_bwd_send_ops(self, bwd_chunk_id: int) -> list[dist.P2POp]:
        operations = super().get_bwd_send_ops(bwd_chunk_id)
        self.traffic.gradients += sum(operation.tensor.nbytes for operation in operations)
        return operations

    def clear_runtime_states(self) -> None:
        super().clear_runtime_states()
        if self.submod.cache is not None:
            self.submod.cache.clear()


def stage_modules(
    model: AttnResForCausalLM, layout: PipelineLayout, rank: int, cross_stage_cache: bool = True
) -> list[AttnResStage]:
    """This rank's stages of `model` (stage `rank`, `rank + num_ranks`, ...), sharing one `CrossStageCache` unless
    `cross_stage_cache=False`, where every boundary sends the whole state. They hold the model's modules, not
    copies: what they do not hold can be freed by dropping the model."""
    cache = CrossStageCache() if cross_stage_cache else None
    return [AttnResStage(model, layout, stage, cache) for stage in range(rank, layout.num_stages, layout.num_ranks)]


class PipelineLoss:
    """The engine's loss function on the last stage's output: the model's causal-LM loss (Transformers'
    `ForCausalLMLoss`, which shifts the labels) of one microbatch over the logits the model returns (fewer than its
    vocabulary where the family drops padding rows, Inkling's `Family.unpadded_vocab`), plus `router_aux_loss_coef`
    times its load-balancing loss for an MoE model and the family's z-loss (Bamba's), as `AttnResForCausalLM.forward`
    adds them."""

    def __init__(self, config):
        self.config = config
        family = FAMILIES[config.family]
        moe = family.moe
        with_loss = moe and moe.load_balancing_loss
        self.router_aux_loss_coef = family.config_value(config, moe.loss_coefficient) if with_loss else None

    def __call__(self, output: torch.Tensor | tuple[torch.Tensor, torch.Tensor], labels: torch.Tensor) -> torch.Tensor:
        logits, aux_loss = output if isinstance(output, tuple) else (output, None)
        loss = with_family_z_loss(self.config, ForCausalLMLoss(logits, labels, logits.shape[-1]), logits)
        return loss if aux_loss is None else loss + self.router_aux_loss_coef * aux_loss[0]


def pipeline_schedule(
    name: str, stages: Sequence[CachingPipelineStage], microbatches: int, loss: Callable | None
) -> ScheduleGPipe | Schedule1F1B | ScheduleInterleaved1F1B | ScheduleLoopedBFS:
    """The engine's schedule `name` (`SCHEDULES`) over this rank's stages, `microbatches` per step; gradients are
    averaged over the microbatches, as the mean loss of the whole batch would give them.

    Raises:
        ValueError: an unknown schedule, or a stage count it does not run (one per rank for "gpipe" and "1f1b",
            several for the others).
    """
    if name not in SCHEDULES:
        raise ValueError(f"schedule={name!r}: allowed values are {', '.join(SCHEDULES)}")
    if name in SINGLE_STAGE_SCHEDULES:
        if len(stages) != 1:
            raise ValueError(f"schedule={name!r} runs one stage per rank, this rank holds {len(stages)}")
        return SINGLE_STAGE_SCHEDULES[name](stages[0], n_microbatches=microbatches, loss_fn=loss)
    return MULTI_STAGE_SCHEDULES[name](list(stages), n_microbatches=microbatches, loss_fn=loss)


def clip_grad_norm(modules: Sequence[nn.Module], max_norm: float, group: dist.ProcessGroup | None = None) -> float:
    """`torch.nn.utils.clip_grad_norm_` over the whole model that the stages of every rank in `group` hold: the norm
    of all their gradients together, each rank's part summed over the group, every gradient scaled alike. FSDP2
    shards (DTensors) count their local part, since the shards of a parameter are disjoint. Returns the norm."""
    squares = torch.zeros((), dtype=torch.float64)
    grads = [p.grad for module in modules for p in module.parameters() if p.grad is not None]
    for grad in grads:
        local = grad.to_local() if isinstance(grad, DTensor) else grad
        squares += local.detach().double().pow(2).sum().cpu()
    dist.all_reduce(squares, group=group)
    norm = squares.sqrt().item()
    scale = max_norm / (norm + 1e-6)
    if scale < 1:
        for grad in grads:
            grad.mul_(scale)
    return norm


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A parameter, gradient or buffer whole, on the CPU: an FSDP2 shard (a DTensor) is gathered (a collective of
    its mesh)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.full_tensor()
    return tensor.detach().cpu()


def save_pipeline_checkpoint(
    modules: Sequence[AttnResStage], path: str | Path, group: dist.ProcessGroup | None = None
) -> None:
    """Save the model that the stages of every rank hold together as one checkpoint folder, which
    `from_pretrained` loads in one process. Every rank calls it; rank 0 gathers the tensors and writes the folder
    with the model's own `save_pretrained` (code files included)."""
    state = {name: full_tensor(tensor) for module in modules for name, tensor in module.state_dict().items()}
    gathered = [None] * dist.get_world_size(group) if dist.get_rank(group) == 0 else None
    dist.gather_object(state, gathered, dst=dist.get_global_rank(group, 0) if group else 0, group=group)
    if gathered is not None:
        config = modules[0].config
        with torch.device("meta"):
            model = AttnResForCausalLM(config)
        model.save_pretrained(path, state_dict={name: t for part in gathered for name, t in part.items()})
    dist.barrier(group)
