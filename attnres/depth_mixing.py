"""Depth mixing: what a sublayer reads instead of the residual stream.

One module sits in front of every attention sublayer, every MLP sublayer and the final norm. It turns the *depth
state* (what the network has produced so far) into the sublayer's input, and folds the sublayer's output back into
the state. The state is a tuple (of tensors, and for AttnRes how to compute with them) owned by the model's forward
loop and passed positionally through the decoder layers, so reentrant activation checkpointing sees every tensor:

- standard PreNorm (SPEC §2): `(residual_stream,)`; the input is the stream, the output is added to it.
- Block / Full AttnRes (SPEC §3-§4): `(kernels, materialize, queries, blocks_inv_rms, lse, partial, *blocks, *obar)`:
  - `kernels`: the implementations of the two phases (`DepthKernels`), chosen once per forward pass
    (`two_phase_ops`) rather than by each of the 2L + 1 steps;
  - `materialize` (bool): whether each step must return its input `h` itself (below);
  - `queries` `[L + 1, D]`: every step's pseudo-query with its key-norm gain folded in, read once per forward pass
    through each step's `DepthQuery` module (`AttnResModel.depth_queries`);
  - `blocks_inv_rms` `[N, batch, seq]`: the inverse RMS of the completed blocks (keys are normalised once per block
    and reused by every later query); its length N tells the blocks from phase 1's rows among the trailing tensors;
  - `lse` `[S, batch, seq]` and `obar`, S tensors `[batch, seq, D]`: phase 1 of the current block (SPEC §6) for
    each of its S steps, computed once when the previous block closed: the block's queries against the completed
    blocks. `obar` is held as separate rows, one per step, so that each step's gradient reaches phase 1's backward
    pass as one row, not scattered into a zero-filled `[S, batch, seq, D]` per step that autograd then sums;
  - `partial`: the running sum of the current block (`None` before its first sublayer);
  - the completed block representations b_0 (the embedding), b_1, ... as separate `[batch, seq, D]` tensors. They
    are never stacked in the state: a new stack per completed block would copy every earlier block (quadratic in
    depth for Full AttnRes) and autograd would keep each copy alive until the backward pass.

  This is the two-phase form of SPEC §6: a step hands its last phase to the following pre-norm as a `PendingInput`
  (phase 1's row alone for the block's first step, phase 2 for the others), so its input `h` is never materialised.
  When `output_hidden_states` asks for every `h`, `materialize` makes the steps compute it themselves with the same
  operations, so the outputs do not change. Where the queries cannot be read up front (parameters sharded by FSDP
  or ZeRO-3 exist only inside their own layer's forward), `queries` and `lse` are `None`, the state holds no `obar`
  rows, and every step runs phase 1 for its own query instead of reading its block's. The output step always runs
  its own: the state after the last sublayer holds no `obar` rows either, so that the model can first narrow it to
  the positions it outputs (`at_positions`; a prompt's prefill needs the last one only). The paper's Table 4
  ablations of AttnRes (`depth_ablation`) keep the same state too and compute the naive form from the sources.
- DenseFormer, Hyper-Connections and mHC (SPEC §7, for comparison): see `residual_variants.py`.
"""

import functools
import math
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch import nn
from transformers import initialization as init
from transformers.modeling_utils import slice_logits_to_keep

from .residual_variants import DepthWeightedAverage, HyperConnection, ManifoldHyperConnection, StreamAverage
from .two_phase import as_float32, cast, inverse_rms, phase2
from .two_phase_torch import append_inverse_rms as torch_append_inverse_rms
from .two_phase_torch import phase1 as torch_phase1
from .two_phase_torch import phase1_rms_norm as torch_phase1_rms_norm
from .two_phase_torch import phase2_rms_norm as torch_phase2_rms_norm


try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch built without distributed support: no parameter can be a DTensor
    DTensor = ()


def num_depth_sources(position: int, block_size: int, num_sublayers: int) -> int:
    """How many sources the depth-mixing step in front of sublayer `position` (1..L, or L + 1 for the output)
    attends over: the completed blocks b_0..b_{n-1}, plus the running partial sum unless the sublayer opens its
    block (SPEC §4). With zero pseudo-queries the step returns the sum of these sources divided by this count."""
    if position > num_sublayers:
        return math.ceil(num_sublayers / block_size) + 1
    completed_blocks = (position - 1) // block_size + 1
    opens_block = (position - 1) % block_size == 0
    return completed_blocks if opens_block else completed_blocks + 1


def initial_depth_state(
    config, inputs_embeds: torch.Tensor, queries: torch.Tensor | None = None, materialize: bool = False
) -> tuple:
    """The depth state before the first sublayer for `config.residual_mode`: the embedding is the whole residual
    stream, block b_0, DenseFormer's stream and x_0, or every one of the Hyper-Connections streams.

    For AttnRes, `queries` are every step's folded pseudo-query (`AttnResModel.depth_queries`; `None` for the
    ablations), with which phase 1 of the first block is computed here, and `materialize` is the state's flag. The
    kernels are chosen here for the embeddings' device (a model dispatched over several devices by accelerate
    executes every layer on devices of one type; offloaded layers run on the main device) and for whether autograd
    records the forward pass.
    """
    mode = config.residual_mode
    if mode == "standard":
        return (inputs_embeds,)
    if mode == "denseformer":
        return inputs_embeds, inputs_embeds.unsqueeze(0)
    if mode in ("hc", "mhc"):
        return (inputs_embeds.unsqueeze(0).expand(config.hc_streams, *inputs_embeds.shape),)
    kernels = two_phase_ops(inputs_embeds.device, config.depth_kernel, differentiable=torch.is_grad_enabled())
    if queries is None:
        blocks_inv_rms = inverse_rms(inputs_embeds, config.rms_norm_eps).unsqueeze(0)
        return kernels, materialize, queries, blocks_inv_rms, None, None, inputs_embeds
    # The embedding closes block b_0: its inverse RMS is appended to none.
    no_blocks_inv_rms = inputs_embeds.new_empty((0, *inputs_embeds.shape[:-1]), dtype=torch.float32)
    first_block = queries[: min(config.depth_block_size, config.num_sublayers)]
    embeds = (inputs_embeds,)
    blocks_inv_rms, obar, lse = kernels.close_block(embeds, no_blocks_inv_rms, first_block, config.rms_norm_eps)
    return kernels, materialize, queries, blocks_inv_rms, lse, None, inputs_embeds, *obar


def _stacked_phase1(kernel: Callable) -> Callable:
    """The Triton phase 1, which reads the blocks as one `[N, *tokens, D]` tensor, behind `two_phase_torch.phase1`'s
    signature (blocks given separately). The stack is one extra pass over the blocks per block, not per sublayer."""

    def phase1(blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: torch.Tensor):
        return kernel(torch.stack(blocks), blocks_inv_rms, queries)

    return phase1


def _in_rows(phase1: Callable) -> Callable:
    """A phase 1 that returns `obar` stacked `[S, *tokens, D]`, returning it as its S rows (`DepthKernels.phase1`)."""

    def phase1_rows(blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: torch.Tensor):
        obar, lse = phase1(blocks, blocks_inv_rms, queries)
        return obar.unbind(0), lse

    return phase1_rows


class DepthKernels(NamedTuple):
    """The implementations of the two-phase form's operations: `two_phase_torch`'s functions and signatures, except
    that `phase1` returns `obar` as a tuple of its S rows `[*tokens, D]`, the form the depth state holds, and
    `close_block(blocks, blocks_inv_rms, queries, eps)`, what a step that closes a block computes: the newest block's
    inverse RMS appended to `blocks_inv_rms`, then phase 1 over all blocks, `(blocks_inv_rms, obar rows, lse)` (the
    CPU kernel does both in one pass over the blocks). `differentiable`: whether the forward pass they were chosen
    for is recorded by autograd (`two_phase_ops`); when it is not, the steps may update their own tensors in place."""

    phase1: Callable
    phase1_rms_norm: Callable
    phase2_rms_norm: Callable
    append_inverse_rms: Callable
    close_block: Callable
    differentiable: bool = True

    @classmethod
    def unfused(
        cls, phase1: Callable, phase1_rms_norm: Callable, phase2_rms_norm: Callable, append_inverse_rms: Callable
    ) -> "DepthKernels":
        """These operations, with `close_block` composed of `append_inverse_rms` and `phase1`."""

        def close_block(
            blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: torch.Tensor, eps: float
        ) -> tuple:
            blocks_inv_rms = append_inverse_rms(blocks_inv_rms, blocks[-1], eps)
            return blocks_inv_rms, *phase1(blocks, blocks_inv_rms, queries)

        return cls(phase1, phase1_rms_norm, phase2_rms_norm, append_inverse_rms, close_block)


TORCH_KERNELS = DepthKernels.unfused(
    _in_rows(torch_phase1), torch_phase1_rms_norm, torch_phase2_rms_norm, torch_append_inverse_rms
)


def two_phase_ops(device: torch.device, depth_kernel: str = "auto", differentiable: bool = True) -> DepthKernels:
    """The implementations that compute depth attention for tensors on `device`; with `differentiable=False`, ones
    that may assume autograd records nothing (the C++ kernels then skip checking it in every call).

    Under `"auto"` (the config field `depth_kernel` and the environment variable `ATTNRES_DEPTH_KERNEL`): the Triton
    kernels (`attnres.kernels`) on CUDA when Triton is importable; on the CPU, the fused C++ kernels
    (`attnres.kernels.cpu`) when they build; elsewhere, and under `"reference"` in either place, `two_phase_torch`
    (PyTorch ops with hand-written backward, same numerics). `ATTNRES_DEPTH_KERNEL=triton` demands the Triton kernels
    on any device (on CPU that means Triton's interpreter, `TRITON_INTERPRET=1`, for tests) and
    `ATTNRES_DEPTH_KERNEL=cpu` the C++ ones for CPU tensors; either fails if its kernels cannot be loaded.

    The model asks once per forward pass (`initial_depth_state`), `differentiable` when gradients are on as it starts
    (a forward pass never turns them on inside; activation checkpointing turns them off for its first pass, which the
    kernels with autograd check call by call), and the choice is made once per combination
    (`_remembered_kernels`): when decoding one token on a CPU, re-importing and re-checking cost more than phase 2.
    Inside `torch.compile` the choice is traced instead (dynamo does not trace into the cache), and the CPU's is the
    PyTorch path, whose plain operations inductor fuses itself.
    """
    override = os.environ.get("ATTNRES_DEPTH_KERNEL", "auto")
    if override not in ("auto", "reference", "triton", "cpu"):
        raise ValueError(f"ATTNRES_DEPTH_KERNEL must be 'auto', 'reference', 'triton' or 'cpu', got {override!r}")
    if torch.compiler.is_compiling():
        return _select_kernels(device.type, depth_kernel, override, differentiable, compiling=True)
    return _remembered_kernels(device.type, depth_kernel, override, differentiable)


def _select_kernels(
    device_type: str, depth_kernel: str, override: str, differentiable: bool, compiling: bool = False
) -> DepthKernels:
    """`two_phase_ops`'s choice, with its `differentiable` flag."""
    kernels = _select_implementations(device_type, depth_kernel, override, differentiable, compiling)
    return kernels._replace(differentiable=differentiable)


def _select_implementations(
    device_type: str, depth_kernel: str, override: str, differentiable: bool, compiling: bool
) -> DepthKernels:
    """The implementations `two_phase_ops` chooses. The imports are absolute and inside `try` because this file is
    copied flat into remote-code checkpoints, which must load where neither `attnres` nor Triton is installed."""
    if depth_kernel == "reference" or override == "reference":
        return TORCH_KERNELS
    if device_type == "cpu" and override in ("auto", "cpu") and not compiling:
        try:
            from attnres.kernels import cpu
        except ImportError:
            cpu = None
        if cpu is not None and cpu.extension() is not None:
            return DepthKernels(*(cpu.KERNELS if differentiable else cpu.KERNELS_WITHOUT_AUTOGRAD))
        if override == "cpu":
            raise RuntimeError("ATTNRES_DEPTH_KERNEL=cpu, but the fused CPU kernels could not be built (log above)")
        return TORCH_KERNELS
    if override == "auto" and device_type != "cuda":
        return TORCH_KERNELS
    try:
        from attnres.kernels import phase1 as kernel_phase1
        from attnres.kernels import phase2_rms_norm as kernel_phase2_rms_norm
    except ImportError:
        if override == "triton":
            raise
        return TORCH_KERNELS
    return DepthKernels.unfused(
        _in_rows(_stacked_phase1(kernel_phase1)),
        torch_phase1_rms_norm,
        kernel_phase2_rms_norm,
        torch_append_inverse_rms,
    )


_remembered_kernels = functools.cache(_select_kernels)


def split_blocks_and_obar(
    blocks_inv_rms: torch.Tensor, blocks_and_obar: tuple[torch.Tensor, ...]
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The depth state's trailing tensors: the completed blocks, one per row of `blocks_inv_rms`, then phase 1's
    `obar` rows."""
    num_blocks = blocks_inv_rms.shape[0]
    return blocks_and_obar[:num_blocks], blocks_and_obar[num_blocks:]


def at_positions(depth_state: tuple, logits_to_keep: int | torch.Tensor) -> tuple:
    """AttnRes's depth state after the last sublayer (complete blocks, no phase-1 rows) at the positions
    `logits_to_keep` selects, as `slice_logits_to_keep` selects them from hidden states: the output step then reads
    its sources at those positions only. Per position, the output is the same as the whole state's at it."""
    kernels, materialize, queries, blocks_inv_rms, lse, partial, *blocks = depth_state
    at = functools.partial(slice_logits_to_keep, logits_to_keep=logits_to_keep)
    blocks_inv_rms = at(blocks_inv_rms.movedim(0, -1)).movedim(-1, 0)  # the token axes of `[N, *tokens]` first
    return kernels, materialize, queries, blocks_inv_rms, lse, partial, *map(at, blocks)


class PendingInput(NamedTuple):
    """A depth-attention step's result `h`, handed over uncomputed to the RMSNorm that reads it.

    A step's input `h` is only ever read by the pre-norm in front of its sublayer, so the step returns this instead
    of `h` and the norm (`AttnResRMSNorm`) computes the step's last phase and its own normalisation as one operation:
    `phase2_rms_norm`, or `phase1_rms_norm` for a block's first step, whose `h` is phase 1's row alone. `h` is never
    written to memory and read back, nor kept for the backward pass. It is a named tuple of plain tuples so that
    accelerate's hooks (`device_map`) move its tensors to the norm's device like any other input.
    """

    compute_and_norm: Callable
    inputs: tuple

    def normalized(self, norm_weight: torch.Tensor, norm_eps: float) -> torch.Tensor:
        """`norm_weight * RMSNorm(h)` with the norm's eps."""
        return self.compute_and_norm(*self.inputs, norm_weight, norm_eps)


class DepthQuery(nn.Module):
    """A depth-attention step's pseudo-query `w` (zero-initialised: a new model starts from uniform depth attention)
    and the gain `gamma` of its key RMSNorm, returned folded into one fp32 vector `w * gamma`.

    `w . (gamma * RMSNorm(v)) == (w * gamma) . RMSNorm(v)`, so folding is exact and lets every query share the same
    normalised keys (SPEC §6). The model reads every step's query through this module's forward, so accelerate's
    offloading hooks load the parameters first and PEFT's `modules_to_save` copies are the ones read.
    """

    def __init__(self, hidden_size: int, key_norm: bool = True):
        super().__init__()
        self.pseudo_query = nn.Parameter(torch.zeros(hidden_size))
        self.key_norm_weight = nn.Parameter(torch.ones(hidden_size)) if key_norm else None

    def forward(self, offset: torch.Tensor | None = None) -> torch.Tensor:
        """The folded query `[D]`; with `offset` (`[*tokens, D]`, for an input-dependent ablation), the per-token
        `(w + offset) * gamma`."""
        query = as_float32(self.pseudo_query)
        if offset is not None:
            query = query + offset
        return query if self.key_norm_weight is None else query * as_float32(self.key_norm_weight)


def fold_queries(steps: Sequence[nn.Module], hidden_size: int) -> torch.Tensor | None:
    """`torch.stack([step() for step in steps])` for `DepthQuery` modules (or wrappers of them): `[len(steps), D]`.

    `None` when a parameter cannot be read outside its own layer's forward: a shard of FSDP2 (a DTensor) or the empty
    placeholder FSDP1 and DeepSpeed ZeRO-3 leave until the owning unit gathers it.

    When every call would run nothing but `DepthQuery.forward`, the parameters are stacked and folded in three tensor
    operations instead of one module call each: this runs on every forward pass, and 2L + 1 module calls cost more
    than a decoder layer when decoding one token on a CPU. The fold is elementwise, so the result is the same. The
    parameters are read from `_parameters` because `nn.Module.__getattr__` alone costs microseconds per read, and the
    checks look at all the steps in one pass each, since at decode they cost as much as the fold.
    """
    if _run_only_forward(steps):
        pseudo_queries = [step._parameters["pseudo_query"] for step in steps]
        gains = [step._parameters["key_norm_weight"] for step in steps]
        if not _hold_full_values((*pseudo_queries, *gains), hidden_size):
            return None
        return as_float32(torch.stack(pseudo_queries)) * as_float32(torch.stack(gains))
    if not _hold_full_values([parameter for step in steps for parameter in step.parameters()], hidden_size):
        return None
    return torch.stack([step() for step in steps])


def _run_only_forward(steps: Sequence[nn.Module]) -> bool:
    """Whether calling each of `steps` runs nothing but `DepthQuery.forward`: not a subclass's nor a wrapper's, and no
    hook attached (torch's, global or the module's, or accelerate's, which replaces `forward` on the instance)."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return False
    return all(
        type(step) is DepthQuery
        and not step._forward_hooks
        and not step._forward_pre_hooks
        and "forward" not in step.__dict__
        for step in steps
    )


def _hold_full_values(parameters: Sequence[torch.Tensor], size: int) -> bool:
    """Whether every one of `parameters` (`[size]` vectors) is whole: no DTensor shard nor empty placeholder. A plain
    `nn.Parameter` is no DTensor; `isinstance` (a tensor subclass check, slower than the rest) is left to others."""
    return all(
        parameter.numel() == size and (type(parameter) is nn.Parameter or not isinstance(parameter, DTensor))
        for parameter in parameters
    )


class StandardResidual(nn.Module):
    """The PreNorm residual connection `h_{l+1} = h_l + f_l(h_l)`, bit-compatible with Llama and Mixtral."""

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        return residual

    def absorb(self, output: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor]:
        return (residual + output,)


class DepthAttention(nn.Module):
    """Block AttnRes in front of one sublayer: softmax attention over the completed blocks and the partial sum.

    Holds the step's `query` (pseudo-query and key-norm gain). Full AttnRes is the same module with block size 1.
    The step reads its row of phase 1, computed for the whole block when the previous block closed, and leaves
    phase 2 (or, for the block's first step, the cast of phase 1's row) to the following pre-norm (`PendingInput`)
    unless the state asks it to `materialize` its input; the step that closes a block computes phase 1 for the next
    one (SPEC §6), except after the last sublayer: the output step computes its own, at the positions the model keeps.
    """

    def __init__(self, hidden_size: int, eps: float, position: int, block_size: int, num_sublayers: int):
        super().__init__()
        self.query = DepthQuery(hidden_size)
        self.eps = eps
        self.position = position
        # Which of its block's phase-1 rows this step reads; the output step (L + 1) is a block of its own.
        self.block_offset = (position - 1) % block_size if position <= num_sublayers else 0
        # The block is closed after its last sublayer and after the network's last sublayer, so the output step
        # always sees complete blocks only.
        self.closes_block = position % block_size == 0 or position == num_sublayers
        # The steps whose queries phase 1 serves once this step closes its block (0-based rows of `queries`): the
        # next block's sublayers. After the last sublayer there is none: the output step runs phase 1 itself, for
        # only the positions the model outputs (`AttnResModel.forward`'s `logits_to_keep`).
        next_end = min(position + block_size, num_sublayers)
        self.next_block = slice(position, next_end) if position < num_sublayers else None

    def forward(
        self,
        kernels: DepthKernels,
        materialize: bool,
        queries: torch.Tensor | None,
        blocks_inv_rms: torch.Tensor,
        lse: torch.Tensor | None,
        partial: torch.Tensor | None,
        *blocks_and_obar: torch.Tensor,
    ) -> torch.Tensor | PendingInput:
        # The state's trailing tensors are the completed blocks, then phase 1's rows for this block's steps, if any.
        num_blocks = blocks_inv_rms.shape[0]
        has_rows = len(blocks_and_obar) > num_blocks
        # A block's first step reads its row of phase 1 and nothing else (indexing costs a dispatch at decode).
        if has_rows and partial is None:
            query = None
        else:
            query = self.query() if queries is None else queries[self.position - 1]
        if has_rows:
            obar, offset = blocks_and_obar[num_blocks + self.block_offset], self.block_offset
        else:  # the output step, or queries not gathered (sharded parameters): this step's own phase 1
            (obar,), lse = kernels.phase1(blocks_and_obar, blocks_inv_rms, query.unsqueeze(0))
            offset = 0
        dtype = blocks_and_obar[0].dtype
        if partial is None:  # the block's first step: phase 1 is the whole softmax
            if materialize:
                return cast(obar, dtype)
            return PendingInput(kernels.phase1_rms_norm, (obar, dtype))
        args = (obar, lse[offset], partial, query, self.eps)
        if materialize:
            return phase2(*args)
        return PendingInput(kernels.phase2_rms_norm, args)

    def absorb(
        self,
        output: torch.Tensor,
        kernels: DepthKernels,
        materialize: bool,
        queries: torch.Tensor | None,
        blocks_inv_rms: torch.Tensor,
        lse: torch.Tensor | None,
        partial: torch.Tensor | None,
        *blocks_and_obar: torch.Tensor,
    ) -> tuple:
        if partial is None:
            partial = output
        elif self.block_offset >= 2 and not kernels.differentiable and partial.dtype == output.dtype:
            # From the block's third step on, the partial sum is a tensor of the model's own (the first step's is
            # the sublayer's output, the second's their sum). Where autograd records nothing, adding in place saves
            # allocating and writing a new one per step (SmolLM2 prefill, S = 8: 0.999x of Llama's time against
            # 1.014x, without page faults either way; README, "In-place partial sums").
            partial = partial.add_(output)
        else:
            partial = partial + output
        if not self.closes_block:
            return kernels, materialize, queries, blocks_inv_rms, lse, partial, *blocks_and_obar
        blocks, _ = split_blocks_and_obar(blocks_inv_rms, blocks_and_obar)
        blocks = (*blocks, partial)
        if queries is None or self.next_block is None:
            blocks_inv_rms, obar, lse = kernels.append_inverse_rms(blocks_inv_rms, partial, self.eps), (), None
        else:
            blocks_inv_rms, obar, lse = kernels.close_block(blocks, blocks_inv_rms, queries[self.next_block], self.eps)
        return kernels, materialize, queries, blocks_inv_rms, lse, None, *blocks, *obar

    def sources(
        self, kernels, materialize, queries, blocks_inv_rms, lse, partial: torch.Tensor | None, *blocks_and_obar
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The sources [b_0, ..., b_{n-1}, partial] stacked `[K, *tokens, D]`, and their inverse RMS `[K, *tokens]`."""
        blocks, _ = split_blocks_and_obar(blocks_inv_rms, blocks_and_obar)
        if partial is None:
            return torch.stack(blocks), blocks_inv_rms
        partial_inv_rms = inverse_rms(partial, self.eps).unsqueeze(0)
        return torch.stack([*blocks, partial]), torch.cat([blocks_inv_rms, partial_inv_rms])

    def attention_weights(self, *depth_state: torch.Tensor | None) -> torch.Tensor:
        """The depth-attention weights `[batch, seq, num_sources]` over [b_0, ..., b_{n-1}, partial], for analysis."""
        sources, inv_rms = self.sources(*depth_state)
        logits = (sources.float() @ self.query()) * inv_rms
        return torch.softmax(logits, dim=0).movedim(0, -1)

    def extra_repr(self) -> str:
        return f"sublayer={self.position}, closes_block={self.closes_block}"


class DepthAttentionAblation(DepthAttention):
    """The naive form of depth attention (SPEC §3) over explicitly listed sources: the paper's Table 4 ablations.

    Each ablation changes one step of the weights: the query (`step_query`), the scores (`logits`), how scores become
    weights (`normalize`) or which sources are visible (`sources`). Each also breaks an assumption of the two-phase
    form (a static query, the softmax merge, a common key norm), so they are computed naively, always in the per-step
    form (the model gathers no queries for them): they exist to measure quality, not speed. Weights are
    `[K, *tokens, heads]` (one head but for the multi-head ablation), in fp32.
    """

    def step_query(self, sources: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        """The query with the key-norm gain folded in: `[D]`, or `[*tokens, D]` when it depends on the input."""
        return self.query()

    def logits(self, sources: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        scores = (sources.float() * self.step_query(sources, inv_rms)).sum(-1) * inv_rms
        return scores.unsqueeze(-1)

    def normalize(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=0)

    def forward(self, *depth_state: torch.Tensor | None) -> torch.Tensor:
        sources, inv_rms = self.sources(*depth_state)
        weights = self.normalize(self.logits(sources, inv_rms))
        values = sources.float().unflatten(-1, (weights.shape[-1], -1))  # [K, *tokens, heads, D / heads]
        return (weights.unsqueeze(-1) * values).sum(0).flatten(-2).to(sources.dtype)

    def attention_weights(self, *depth_state: torch.Tensor | None) -> torch.Tensor:
        """The weights `[batch, seq, num_sources]` (averaged over heads), for analysis."""
        sources, inv_rms = self.sources(*depth_state)
        return self.normalize(self.logits(sources, inv_rms)).mean(-1).movedim(0, -1)


class InputDependentQueryDepthAttention(DepthAttentionAblation):
    """Ablation: a per-token query `w_l + W_l RMSNorm(h)`, with h the newest source (v_{l-1} in Full AttnRes, the
    running partial sum or the newest completed block in Block AttnRes), i.e. what the network has just computed.

    `W_l` (`query_proj`, D x D) starts at zero, so the model starts as AttnRes with zero pseudo-queries. It costs a
    D x D projection per sublayer, and the queries of a block can no longer be scored together (no phase 1).
    """

    def __init__(self, hidden_size: int, eps: float, position: int, block_size: int, num_sublayers: int):
        super().__init__(hidden_size, eps, position, block_size, num_sublayers)
        self.query_proj = nn.Parameter(torch.zeros(hidden_size, hidden_size))

    def step_query(self, sources: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        newest = sources[-1].float() * inv_rms[-1].unsqueeze(-1)
        return self.query(newest @ self.query_proj.float().T)

    def init_residual_parameters(self, std: float) -> None:
        init.zeros_(self.query_proj)


class SigmoidDepthAttention(DepthAttentionAblation):
    """Ablation: each source's weight is `sigmoid(logit)` on its own: sources do not compete and weights do not sum
    to 1. With zero pseudo-queries every weight is 1/2, so the input is half the sum of the sources."""

    def normalize(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits)


class NoKeyNormDepthAttention(DepthAttentionAblation):
    """Ablation: scores `w . v_i` on the raw sources, so a source's weight grows with its magnitude as well as its
    direction. There is no key RMSNorm and no gain (on raw keys a gain would only rescale the query)."""

    def __init__(self, hidden_size: int, eps: float, position: int, block_size: int, num_sublayers: int):
        super().__init__(hidden_size, eps, position, block_size, num_sublayers)
        self.query = DepthQuery(hidden_size, key_norm=False)

    def logits(self, sources: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        return (sources.float() @ self.query()).unsqueeze(-1)


class SlidingWindowDepthAttention(DepthAttentionAblation):
    """Ablation: attend over the embedding and the newest `window` sources only (SPEC §7).

    The state keeps b_0 and the newest `window` completed blocks, all that any later step can see, so depth memory
    is bounded by the window instead of growing with depth.
    """

    def __init__(
        self, hidden_size: int, eps: float, position: int, block_size: int, num_sublayers: int, window: int
    ):
        super().__init__(hidden_size, eps, position, block_size, num_sublayers)
        self.window = window
        self.num_unwindowed_sources = num_depth_sources(position, block_size, num_sublayers)

    def sources(self, *depth_state: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        sources, inv_rms = super().sources(*depth_state)
        start = max(1, sources.shape[0] - self.window)
        return torch.cat([sources[:1], sources[start:]]), torch.cat([inv_rms[:1], inv_rms[start:]])

    def absorb(self, output: torch.Tensor, *depth_state: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        kernels, materialize, queries, blocks_inv_rms, lse, partial, *blocks = super().absorb(output, *depth_state)
        if len(blocks) > self.window + 1:  # an ablation's state holds no phase-1 rows: the trailing tensors are blocks
            blocks = [blocks[0], *blocks[-self.window :]]
            blocks_inv_rms = torch.cat([blocks_inv_rms[:1], blocks_inv_rms[-self.window :]])
        return kernels, materialize, queries, blocks_inv_rms, lse, partial, *blocks

    def attention_weights(self, *depth_state: torch.Tensor | None) -> torch.Tensor:
        """The weights over all the sources the unwindowed step would see, zero outside the window."""
        visible = super().attention_weights(*depth_state)
        hidden = visible.new_zeros(*visible.shape[:-1], self.num_unwindowed_sources - visible.shape[-1])
        return torch.cat([visible[..., :1], hidden, visible[..., 1:]], dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}"


class MultiHeadDepthAttention(DepthAttentionAblation):
    """Ablation: `heads` independent depth attentions, each scoring (with per-head key RMSNorm) and mixing its own
    `D / heads` channels, so different channel groups can read different depths."""

    def __init__(
        self, hidden_size: int, eps: float, position: int, block_size: int, num_sublayers: int, heads: int
    ):
        super().__init__(hidden_size, eps, position, block_size, num_sublayers)
        self.heads = heads

    def logits(self, sources: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        keys = sources.float().unflatten(-1, (self.heads, -1))  # [K, *tokens, heads, D / heads]
        keys = keys * inverse_rms(keys, self.eps).unsqueeze(-1)
        return (keys * self.step_query(sources, inv_rms).unflatten(-1, (self.heads, -1))).sum(-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, heads={self.heads}"


def depth_mixer(config, position: int) -> nn.Module:
    """The depth-mixing module in front of sublayer `position` (1..L; L + 1 is the output) for `config`'s mode."""
    mode = config.residual_mode
    if mode == "standard":
        return StandardResidual()
    if mode == "denseformer":
        return DepthWeightedAverage(position, config.num_sublayers, config.dwa_dilation, config.dwa_period)
    if mode in ("hc", "mhc") and position > config.num_sublayers:
        return StreamAverage()
    if mode == "hc":
        return HyperConnection(config.hidden_size, position, config.hc_streams, config.rms_norm_eps)
    if mode == "mhc":
        return ManifoldHyperConnection(
            config.hidden_size, position, config.hc_streams, config.rms_norm_eps, config.sinkhorn_iterations
        )
    args = (config.hidden_size, config.rms_norm_eps, position, config.depth_block_size, config.num_sublayers)
    ablation = config.depth_ablation
    if ablation is None:
        return DepthAttention(*args)
    if ablation == "sliding_window":
        return SlidingWindowDepthAttention(*args, window=config.depth_window)
    if ablation == "multi_head":
        return MultiHeadDepthAttention(*args, heads=config.depth_heads)
    ablations = {
        "input_query": InputDependentQueryDepthAttention,
        "sigmoid": SigmoidDepthAttention,
        "no_key_norm": NoKeyNormDepthAttention,
    }
    return ablations[ablation](*args)


def pre_norm_eps(config, position: int) -> float:
    """The eps of the RMSNorm that reads the output of depth-mixing step `position`.

    With `exact_retrofit`, eps / k**2 for a step with k sources (SPEC §5): zero pseudo-queries average the sources,
    and RMSNorm(sum / k, eps / k**2) == RMSNorm(sum, eps), so a converted PreNorm checkpoint is reproduced exactly.
    Only AttnRes averages its sources; the other modes keep the eps.
    """
    if config.residual_mode not in ("full", "block") or not config.exact_retrofit:
        return config.rms_norm_eps
    return config.rms_norm_eps / zero_query_divisor(config, position) ** 2


def zero_query_divisor(config, position: int) -> int:
    """k such that AttnRes step `position` returns (sum of its sources) / k while its query is zero: its number of
    sources, counted after the sliding window if any; 2 for the sigmoid ablation (every weight is 1/2)."""
    if config.depth_ablation == "sigmoid":
        return 2
    k = num_depth_sources(position, config.depth_block_size, config.num_sublayers)
    if config.depth_ablation == "sliding_window":
        return 1 + min(k - 1, config.depth_window)
    return k
