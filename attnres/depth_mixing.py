"""Depth mixing: what each sublayer reads instead of the residual stream.

One mixer sits in front of every attention sublayer, every MLP sublayer and the final norm (the protocol and the
states are in `depth_state.py`):

- `StandardResidual`: the PreNorm residual, Llama's (docs/design.md §2);
- `DepthAttention`: Block AttnRes, and Full AttnRes as blocks of one sublayer (§3, §4), in the two-phase form (§6);
- the comparison residuals (`residual_variants.py`) and the paper's ablations of AttnRes (`depth_ablations.py`).

`depth_mixer` builds the mixer for a config's residual mode; `output_scale` gives the factor on a step's output that
an exact retrofit applies (docs/design.md §5).
"""

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn

from .depth_state import DepthContext, DepthMixer, DepthState, ResidualStream
from .families import norm_eps
from .kernel_dispatch import DepthKernels, depth_kernels
from .residual_variants import DepthWeightedAverage, HyperConnection, ManifoldHyperConnection, StreamAverage
from .two_phase import as_float32, block_input, cast, inverse_rms


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support: no parameter can be a DTensor
    DTensor = ()


def num_depth_sources(position: int, block_size: int, num_sublayers: int) -> int:
    """How many sources the step in front of sublayer `position` (1..L, or L + 1 for the output) attends over: the
    completed blocks, plus the running partial sum unless the sublayer opens its block (docs/design.md §4)."""
    if position > num_sublayers:
        return math.ceil(num_sublayers / block_size) + 1
    completed_blocks = (position - 1) // block_size + 1
    opens_block = (position - 1) % block_size == 0
    return completed_blocks if opens_block else completed_blocks + 1


class PendingInput(NamedTuple):
    """A step's input `k * h`, handed over uncomputed to the RMSNorm that reads it (docs/design.md §6).

    `h` is only ever read by the pre-norm in front of its sublayer, so the model's own norm (`AttnResRMSNorm`, or a
    family's RMSNorm of the same function on an fp32 stream, `modeling_attnres.FusableNorm`) computes the step's last
    phase and its own normalisation in one operation, and `h` is never written to memory nor kept for the backward
    pass. Any other norm (an engine's that replaced the model's, as vLLM's Transformers backend does) reads the input
    itself, computed unfused (`value`). A named tuple of plain tuples, so that accelerate's hooks (`device_map`) move
    its tensors to the norm's device like any other input.

    `dtype` is the dtype of `k * h`, the stream's. `scale` is the step's output scale k (1 but under `exact_retrofit`,
    docs/design.md §5): the fused norm folds it into its eps, `RMSNorm(k h; eps) = RMSNorm(h; eps / k²)`, and `value`
    multiplies by `scale_tensor`, the same k as the step's 0-d buffer, so that under torch.compile every step's
    kernels read k as an input instead of a constant of their own.
    """

    compute: Callable
    compute_and_norm: Callable
    inputs: tuple
    dtype: torch.dtype
    scale: float = 1.0
    scale_tensor: torch.Tensor | None = None

    def value(self) -> torch.Tensor:
        """`k * h` itself."""
        return self.compute(*self.inputs, scale=self.scale_tensor)

    def normalized(self, norm_weight: torch.Tensor, norm_eps: float, gain_offset: float = 0.0) -> torch.Tensor:
        """`(norm_weight + gain_offset) * RMSNorm(k * h)` with the norm's eps."""
        return self.compute_and_norm(*self.inputs, norm_weight, norm_eps / self.scale**2, gain_offset)


class DepthQuery(nn.Module):
    """A step's pseudo-query `w` (zero at initialisation: uniform depth attention) and its key-norm gain `gamma`,
    returned folded into one fp32 vector `w * gamma` (exact, docs/design.md §6). The model reads every query through
    this module's forward, so accelerate's offloading hooks load the parameters first and PEFT's `modules_to_save`
    copies are the ones read."""

    def __init__(self, hidden_size: int, key_norm: bool = True):
        super().__init__()
        self.pseudo_query = nn.Parameter(torch.zeros(hidden_size))
        self.key_norm_weight = nn.Parameter(torch.ones(hidden_size)) if key_norm else None

    def forward(self, offset: torch.Tensor | None = None) -> torch.Tensor:
        """The folded query `[D]`; with `offset` (`[*tokens, D]`, for an input-dependent ablation),
        `(w + offset) * gamma`."""
        query = as_float32(self.pseudo_query)
        if offset is not None:
            query = query + offset
        key_norm_weight = self.key_norm_weight  # read once: a parameter's lookup is a Python call
        return query if key_norm_weight is None else query * as_float32(key_norm_weight)


def gather_queries(steps: Sequence[DepthQuery]) -> tuple[torch.Tensor, ...] | None:
    """Every step's folded query `[D]`, in order, or `None` when a parameter cannot be read outside its own layer's
    forward: a shard of FSDP2 (a DTensor), or the empty placeholder FSDP1 and DeepSpeed ZeRO-3 leave until the owning
    unit gathers it. Separate tensors, not rows of one: under torch.compile a row's offset would be a constant in the
    kernels of the step that reads it, which would then differ from step to step (docs/design.md §8)."""
    if not all(holds_full_values(step) for step in steps):
        return None
    return tuple(step() for step in steps)


def holds_full_values(step: DepthQuery) -> bool:
    """Whether the step's parameters are whole (not a DTensor shard nor an empty placeholder), as its pseudo-query
    tells: FSDP and ZeRO-3 shard and gather a module's own parameters together, so its key-norm gain is in the same
    state (and not read again: every read of a parameter is a Python call, on every forward pass). A plain
    `nn.Parameter` is no DTensor, and skips the slower subclass check."""
    query = step.pseudo_query
    return query.numel() > 0 and (type(query) is nn.Parameter or not isinstance(query, DTensor))


class StandardResidual(DepthMixer):
    """The PreNorm residual `h_{l+1} = h_l + v_l`, bit-compatible with Llama and Mixtral."""

    def initial_state(self, inputs_embeds: torch.Tensor, queries: None, record_inputs: bool):
        return ResidualStream(inputs_embeds), DepthContext(record_inputs=record_inputs)

    def forward(self, state: ResidualStream, context: DepthContext) -> torch.Tensor:
        return state.hidden_states

    def absorb(self, output: torch.Tensor, state: ResidualStream, context: DepthContext) -> ResidualStream:
        return ResidualStream(state.hidden_states + output)


class DepthAttention(DepthMixer):
    """Block AttnRes in front of one sublayer: softmax attention over the completed blocks and the partial sum
    (docs/design.md §4); Full AttnRes is the same module with block size 1.

    A step reads its row of phase 1, computed for its whole block when the previous block closed, and hands phase 2
    (for a block's first step, the cast of its row) to the following pre-norm as a `PendingInput`. The step that
    closes a block computes phase 1 for the next one, except after the last sublayer: the output step computes its
    own, at the positions the model outputs (§6.1).
    """

    two_phase = True

    def __init__(
        self,
        hidden_size: int,
        eps: float,
        position: int,
        block_size: int,
        num_sublayers: int,
        depth_kernel: str,
        output_scale: float = 1,
    ):
        super().__init__()
        self.query = DepthQuery(hidden_size)
        self.eps = eps
        self.position = position
        self.depth_kernel = depth_kernel
        self.output_scale = output_scale
        # k as a tensor, for `PendingInput.value` (`None` where it is 1); not saved: the config determines it.
        scale_tensor = torch.tensor(float(output_scale)) if output_scale != 1 else None
        self.register_buffer("output_scale_tensor", scale_tensor, persistent=False)
        # Which of its block's phase-1 rows this step reads; the output step (L + 1) is a block of its own.
        self.block_offset = (position - 1) % block_size if position <= num_sublayers else 0
        # A block closes after its last sublayer and after the network's last, so the output sees complete blocks.
        self.closes_block = position % block_size == 0 or position == num_sublayers
        # The rows of `queries` of this step's block, and of the next block, which phase 1 serves when this step
        # closes its own. After the last sublayer there is none.
        block_start = position - 1 - self.block_offset
        self.block = slice(block_start, min(block_start + block_size, num_sublayers))
        next_end = min(position + block_size, num_sublayers)
        self.next_block = slice(position, next_end) if position < num_sublayers else None
        # The blocks the state holds after the last sublayer, b_0 included: the most any phase 1 reads.
        self.num_blocks = num_depth_sources(num_sublayers + 1, block_size, num_sublayers)

    def kernels(self, device: torch.device) -> DepthKernels:
        """The implementations of the two phases for a forward pass on `device` (`kernel_dispatch.depth_kernels`)."""
        return depth_kernels(
            device,
            self.depth_kernel,
            torch.is_grad_enabled(),
            num_blocks=self.num_blocks,
            num_queries=self.block.stop - self.block.start,
            eps=self.eps,
        )

    def initial_state(self, inputs_embeds: torch.Tensor, queries: torch.Tensor | None, record_inputs: bool):
        """b_0 = the embedding; with gathered queries, phase 1 for the first block (this step's)."""
        kernels = self.kernels(inputs_embeds.device)
        context = DepthContext(kernels, record_inputs)
        no_blocks_inv_rms = inputs_embeds.new_empty((0, *inputs_embeds.shape[:-1]), dtype=torch.float32)
        if queries is None:
            blocks_inv_rms = kernels.append_inverse_rms(no_blocks_inv_rms, inputs_embeds, self.eps)
            return DepthState(blocks=(inputs_embeds,), blocks_inv_rms=blocks_inv_rms), context
        first_block = queries[self.block]
        blocks_inv_rms, rows, lse = kernels.close_block((inputs_embeds,), no_blocks_inv_rms, first_block, self.eps)
        state = DepthState((inputs_embeds,), blocks_inv_rms, queries=queries, phase1_rows=rows, lse=lse)
        return state, context

    def resumed_state(
        self, blocks: tuple[torch.Tensor, ...], partial: torch.Tensor | None, queries: tuple[torch.Tensor, ...] | None
    ) -> tuple[DepthState, DepthContext]:
        """The state in front of this step when the steps before it ran elsewhere (an earlier pipeline stage), from
        what they handed on: the completed blocks and the partial sum (`None` where this step opens its block). The
        blocks' inverse RMS is computed again rather than handed on, and with gathered queries phase 1 for this
        step's block, as the step that closed the last block computes it (`absorb`)."""
        kernels = self.kernels(blocks[0].device)
        blocks_inv_rms = blocks[0].new_empty((0, *blocks[0].shape[:-1]), dtype=torch.float32)
        for block in blocks[:-1]:
            blocks_inv_rms = kernels.append_inverse_rms(blocks_inv_rms, block, self.eps)
        if queries is None:
            blocks_inv_rms = kernels.append_inverse_rms(blocks_inv_rms, blocks[-1], self.eps)
            return DepthState(blocks, blocks_inv_rms, partial), DepthContext(kernels)
        blocks_inv_rms, rows, lse = kernels.close_block(blocks, blocks_inv_rms, queries[self.block], self.eps)
        return DepthState(blocks, blocks_inv_rms, partial, queries, rows, lse), DepthContext(kernels)

    def step_query(self, state: DepthState) -> torch.Tensor:
        """This step's folded query `[D]`: the state's gathered one, or read from its own module."""
        return self.query() if state.queries is None else state.queries[self.position - 1]

    def forward(self, state: DepthState, context: DepthContext) -> torch.Tensor | PendingInput:
        kernels = context.kernels
        if state.phase1_rows:
            row, lse, lse_row = state.phase1_rows[self.block_offset], state.lse, self.block_offset
        else:  # the output step, or no gathered queries: phase 1 for this step's own query
            (row,), lse = kernels.phase1(state.blocks, state.blocks_inv_rms, (self.step_query(state),))
            lse_row = 0
        # k and its buffer (`PendingInput`), read only where k is not 1: a buffer's lookup is a Python call per step.
        scale = (self.output_scale, self.output_scale_tensor) if self.output_scale != 1 else ()
        if state.partial is None:  # the block's first step: phase 1 is the whole softmax
            dtype = state.blocks[0].dtype
            return PendingInput(block_input, kernels.phase1_rms_norm, (row, dtype), dtype, *scale)
        # The row's log-sum-exp, taken only here: a row of a stacked `lse` is a tensor operation.
        args = (row, lse[lse_row], state.partial, self.step_query(state), self.eps)
        return PendingInput(kernels.phase2, kernels.phase2_rms_norm, args, state.partial.dtype, *scale)

    def absorb(self, output: torch.Tensor, state: DepthState, context: DepthContext) -> DepthState:
        kernels = context.kernels
        partial = state.partial
        if partial is None:
            # Sums over depth are kept in the dtype of the embedding, b_0, as the family's residual stream is: under
            # autocast a sublayer's output arrives in bf16 / fp16 and the stream stays fp32 (docs/design.md §6).
            partial = cast(output, state.blocks[0].dtype)
        elif self.block_offset >= 2 and not kernels.differentiable and partial.dtype == output.dtype:
            # Fast path: from a block's third step on the partial sum is a tensor of the model's own (the first is
            # the sublayer's output, the second their sum), so where autograd records nothing it is updated in place
            # instead of allocated and written anew per step. Tested to compute what `partial + output` does.
            partial = partial.add_(output)
        else:
            partial = partial + output
        if not self.closes_block:
            return DepthState(state.blocks, state.blocks_inv_rms, partial, state.queries, state.phase1_rows, state.lse)
        blocks = (*state.blocks, partial)
        if state.queries is None or self.next_block is None:
            blocks_inv_rms = kernels.append_inverse_rms(state.blocks_inv_rms, partial, self.eps)
            return DepthState(blocks, blocks_inv_rms, queries=state.queries)
        next_queries = state.queries[self.next_block]
        blocks_inv_rms, rows, lse = kernels.close_block(blocks, state.blocks_inv_rms, next_queries, self.eps)
        return DepthState(blocks, blocks_inv_rms, queries=state.queries, phase1_rows=rows, lse=lse)

    def sources(self, state: DepthState) -> tuple[torch.Tensor, torch.Tensor]:
        """The sources [b_0, ..., b_{n-1}, partial] stacked `[K, *tokens, D]`, and their inverse RMS `[K, *tokens]`."""
        if state.partial is None:
            return torch.stack(state.blocks), state.blocks_inv_rms
        partial_inv_rms = inverse_rms(state.partial, self.eps).unsqueeze(0)
        return torch.stack([*state.blocks, state.partial]), torch.cat([state.blocks_inv_rms, partial_inv_rms])

    def attention_weights(self, state: DepthState, context: DepthContext) -> torch.Tensor:
        """The depth-attention weights `[batch, seq, num_sources]` over [b_0, ..., b_{n-1}, partial], for analysis."""
        sources, inv_rms = self.sources(state)
        logits = (sources.float() @ self.query()) * inv_rms
        return torch.softmax(logits, dim=0).movedim(0, -1)

    def extra_repr(self) -> str:
        scale = f", output_scale={self.output_scale}" if self.output_scale != 1 else ""
        return f"sublayer={self.position}, closes_block={self.closes_block}{scale}"


def depth_mixer(config, position: int) -> DepthMixer:
    """The mixer in front of sublayer `position` (1..L; L + 1 is the output) for `config.residual_mode`."""
    from .depth_ablations import depth_ablation  # here: the ablations subclass `DepthAttention`

    mode = config.residual_mode
    if mode == "standard":
        return StandardResidual()
    if mode == "denseformer":
        return DepthWeightedAverage(position, config.layer_offsets, config.dwa_dilation, config.dwa_period)
    if mode in ("hc", "mhc") and position > config.num_sublayers:
        return StreamAverage()
    eps = norm_eps(config)  # the family's: its RMSNorm's, or its LayerNorm's (StableLM, StarCoder2)
    if mode == "hc":
        return HyperConnection(config.hidden_size, position, config.hc_streams, eps)
    if mode == "mhc":
        return ManifoldHyperConnection(config.hidden_size, position, config.hc_streams, eps, config.sinkhorn_iterations)
    args = (config.hidden_size, eps, position, config.depth_block_size, config.num_sublayers)
    kwargs = dict(depth_kernel=config.depth_kernel, output_scale=output_scale(config, position))
    if config.depth_ablation is not None:
        return depth_ablation(config, *args, **kwargs)
    return DepthAttention(*args, **kwargs)


def output_scale(config, position: int) -> int:
    """The factor k on the output of mixer `position`: with `exact_retrofit`, the k of a step that averages k sources
    at zero queries, so that it hands on their sum as the residual stream did (docs/design.md §5); 1 otherwise. Only
    AttnRes averages its sources."""
    if config.residual_mode not in ("full", "block") or not config.exact_retrofit:
        return 1
    return zero_query_divisor(config, position)


def zero_query_divisor(config, position: int) -> int:
    """k such that AttnRes step `position` returns (sum of its sources) / k while its query is zero: its number of
    sources, counted after the sliding window if any; 2 for the sigmoid ablation (every weight is 1/2)."""
    if config.depth_ablation == "sigmoid":
        return 2
    k = num_depth_sources(position, config.depth_block_size, config.num_sublayers)
    if config.depth_ablation == "sliding_window":
        return 1 + min(k - 1, config.depth_window)
    return k
