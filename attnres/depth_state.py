"""The depth state: what the network has produced so far, which each depth-mixing module reads and extends.

Every residual mode keeps its state in a named tuple of tensors. A depth-mixing module ("mixer") sits in front of
every sublayer and of the final norm and follows one protocol (`DepthMixer`):

    input = mixer(state, context)                  # what the sublayer (or the final norm) reads
    state = mixer.absorb(output, state, context)   # the sublayer's raw output folded in

`context` (`DepthContext`) holds what one forward pass's mixers share that is not a tensor. Under activation
checkpointing the state crosses each decoder layer's boundary as positional tensors (`flatten_state`), the form in
which reentrant checkpointing recomputes and differentiates through all of them.

This file is copied flat into remote-code checkpoints, so it imports only its neighbours, relatively.
"""

import functools
from typing import NamedTuple

import torch
from torch import nn

from .kernel_dispatch import DepthKernels, autocast_off
from .transformers_compat import slice_logits_to_keep


class DepthContext(NamedTuple):
    """What the mixers of one forward pass share besides the state's tensors.

    kernels: the implementations of the two phases (`kernel_dispatch.DepthKernels`), chosen once per forward pass;
        `None` for the modes that compute no depth attention.
    record_inputs: whether the inputs of the attention sublayers and of the final norm are recorded
        (`output_hidden_states`), which the model computes besides what it goes on with.
    """

    kernels: DepthKernels | None = None
    record_inputs: bool = False


class ResidualStream(NamedTuple):
    """The PreNorm residual stream `h` `[batch, seq, D]` (docs/design.md §2)."""

    hidden_states: torch.Tensor

    def at_positions(self, logits_to_keep: int | torch.Tensor) -> "ResidualStream":
        return ResidualStream(slice_logits_to_keep(self.hidden_states, logits_to_keep))


class DepthState(NamedTuple):
    """Block and Full AttnRes's state (docs/design.md §6).

    blocks: the completed block representations b_0 (the embedding), b_1, ..., each `[batch, seq, D]`, kept
        separate: re-stacking them per block would copy every earlier block (quadratic in depth for Full AttnRes).
    blocks_inv_rms: their inverse RMS `[N, batch, seq]`, fp32 (keys are normalised once per block).
    partial: the running sum of the current block's outputs, `None` before its first sublayer.
    queries: every step's pseudo-query folded with its key-norm gain, `[D]` fp32 each, in order (L + 1), or `None`
        where the queries cannot be read up front (sharded parameters, the ablations): each step then reads its own.
    phase1_rows: phase 1 for each step of the current block, `[batch, seq, D]` fp32 each, computed when the previous
        block closed; empty after the last sublayer and where there are no queries.
    lse: phase 1's log-sum-exp for those steps, `[batch, seq]` fp32 each: stacked `[S, batch, seq]`, or a tuple
        (what the kernels return, `kernel_dispatch.DepthKernels`).
    """

    blocks: tuple[torch.Tensor, ...]
    blocks_inv_rms: torch.Tensor
    partial: torch.Tensor | None = None
    queries: tuple[torch.Tensor, ...] | None = None
    phase1_rows: tuple[torch.Tensor, ...] = ()
    lse: torch.Tensor | tuple[torch.Tensor, ...] | None = None

    def at_positions(self, logits_to_keep: int | torch.Tensor) -> "DepthState":
        """The state after the last sublayer (complete blocks, no phase 1) at the positions `logits_to_keep` selects,
        as `slice_logits_to_keep` selects them from hidden states. Per position, the output is unchanged."""
        at = functools.partial(slice_logits_to_keep, logits_to_keep=logits_to_keep)
        blocks_inv_rms = at(self.blocks_inv_rms.movedim(0, -1)).movedim(-1, 0)  # the token axes of [N, *tokens] first
        return self._replace(blocks=tuple(map(at, self.blocks)), blocks_inv_rms=blocks_inv_rms)


class StateLayout(NamedTuple):
    """How to rebuild a state from `flatten_state`'s tensors: its type, and the length of each field that is a tuple
    of tensors (`None` for a single tensor)."""

    state_type: type
    lengths: tuple[int | None, ...]

    def unflatten(self, values: tuple) -> NamedTuple:
        fields, start = [], 0
        for length in self.lengths:
            if length is None:
                fields.append(values[start])
                start += 1
            else:
                fields.append(tuple(values[start : start + length]))
                start += length
        return self.state_type(*fields)


def flatten_state(state: NamedTuple) -> tuple[tuple, StateLayout]:
    """The state's tensors (and `None`s) in field order, tuples spread out, and the layout that rebuilds it."""
    values, lengths = [], []
    for field in state:
        if isinstance(field, tuple):
            values.extend(field)
            lengths.append(len(field))
        else:
            values.append(field)
            lengths.append(None)
    return tuple(values), StateLayout(type(state), tuple(lengths))


def _device_type(values: tuple) -> str:
    """The device type of the first tensor among `values`, looking into tuples (a state and its fields)."""
    for value in values:
        if isinstance(value, torch.Tensor):
            return value.device.type
        if isinstance(value, tuple) and value:
            return _device_type(value)
    raise TypeError("no tensor among a depth mixer's arguments")


def full_precision(method):
    """A mixer's `forward` or `absorb` that computes its coefficients in fp32, run with autocast off (docs/design.md
    §6, "Mixed precision"): under autocast its matrix products would otherwise run in bf16 / fp16. Depth attention's
    two phases are exempted where they are chosen (`kernel_dispatch.without_autocast`); this is for the mixers that
    compute their own (the comparison residuals, the ablations)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with autocast_off(_device_type(args)):
            return method(self, *args, **kwargs)

    return run


class DepthMixer(nn.Module):
    """A depth-mixing module: the residual connection in front of one sublayer (1..L) or of the output (L + 1).

    Subclasses implement `forward(state, context)` (the sublayer's input) and `absorb(output, state, context)` (the
    new state), and the mixer of their mode in front of the first sublayer builds the initial state and the forward
    pass's context. `two_phase`: whether the model gathers every step's query up front for the two-phase form
    (docs/design.md §6).
    """

    two_phase = False

    def initial_state(
        self, inputs_embeds: torch.Tensor, queries: torch.Tensor | None, record_inputs: bool
    ) -> tuple[NamedTuple, DepthContext]:
        """The state before the first sublayer, and the context of the forward pass it starts."""
        raise NotImplementedError(f"{type(self).__name__} does not start a depth state")
