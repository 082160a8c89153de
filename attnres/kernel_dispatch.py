"""Which implementation computes the two phases of depth attention (docs/design.md §8).

Every implementation provides the operations of `DepthKernels` with the signatures of `two_phase_torch`, and is
tested against the PyTorch reference (`two_phase.py`). `depth_kernels` chooses one, once per combination of device
type, setting and grad mode; the model asks once per forward pass.

This file is copied flat into remote-code checkpoints. A checkpoint's copy runs `two_phase_torch` alone and never
imports an installed `attnres`, whose kernels may have changed since the checkpoint was saved: a checkpoint computes
the same function under any later version, or none (`PACKAGED`). In the package, the kernels are imported here,
inside `try`, only when chosen.
"""

import contextlib
import functools
import os
from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .two_phase import phase2 as unfused_phase2
from .two_phase_torch import append_inverse_rms as torch_append_inverse_rms
from .two_phase_torch import padded_phase1
from .two_phase_torch import phase1 as torch_phase1
from .two_phase_torch import phase1_rms_norm as torch_phase1_rms_norm
from .two_phase_torch import phase2_rms_norm as torch_phase2_rms_norm


SETTINGS = ("auto", "reference", "triton", "cpu")
# Whether this is the package's module rather than a checkpoint's copy (`transformers_modules.<checkpoint>...`).
PACKAGED = __name__ == "attnres.kernel_dispatch"


class DepthKernels(NamedTuple):
    """The operations of the two-phase form (docs/design.md §6), as `two_phase_torch` defines them, except that
    `phase1` takes the S steps' queries `[D]` as a sequence and returns phase 1's output as a tuple of its S rows
    `[*tokens, D]` (both one per step, the form the depth state holds: stacking the queries would be one more
    operation per closed block and decoded token), and `close_block(blocks, blocks_inv_rms, queries, eps)` is what
    the step that closes a block computes:
    the newest block's inverse RMS appended to `blocks_inv_rms`, then phase 1 over all the blocks,
    `(blocks_inv_rms, rows, lse)`; `lse` is indexed by row too (stacked, or a tuple).

    `phase2` is phase 2 alone (`two_phase.phase2`, or the fused CPU kernel), for a sublayer input that a norm other
    than the model's reads.

    `differentiable`: whether autograd records the forward pass they were chosen for; when it does not, a step may
    update its own tensors in place.
    """

    phase1: Callable
    phase1_rms_norm: Callable
    phase2_rms_norm: Callable
    append_inverse_rms: Callable
    close_block: Callable
    differentiable: bool = True
    phase2: Callable = unfused_phase2


# The operations of `DepthKernels`.
OPERATIONS = ("phase1", "phase1_rms_norm", "phase2_rms_norm", "append_inverse_rms", "close_block", "phase2")


def without_autocast(kernels: DepthKernels, device_type: str) -> DepthKernels:
    """`kernels` with autocast off while each operation runs (docs/design.md §6, "Mixed precision"): under autocast
    the depth logits would otherwise be matrix products in bf16 / fp16, and their operands would arrive in dtypes
    the kernels do not mix. The operations keep the fp32 math of the reference and return the stream's dtype, which
    the sublayers after them read under autocast like the family's own residual stream."""

    def exempt(operation: Callable) -> Callable:
        @functools.wraps(operation)
        def run(*args, **kwargs):
            with torch.autocast(device_type, enabled=False):
                return operation(*args, **kwargs)

        return run

    return kernels._replace(**{name: exempt(getattr(kernels, name)) for name in OPERATIONS})


def autocast_enabled(device_type: str) -> bool:
    """Whether autocast is on for `device_type`; never for a device without autocast (`meta`, where models are built
    without memory)."""
    return torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)


def autocast_off(device_type: str) -> contextlib.AbstractContextManager:
    """A context with autocast off on `device_type` if it is on there (nothing to enter otherwise)."""
    if autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


def composed(
    phase1_rows: Callable, phase1_rms_norm: Callable, phase2_rms_norm: Callable, append_inverse_rms: Callable
) -> DepthKernels:
    """`DepthKernels` from `two_phase_torch`-style operations and a phase 1 that returns rows (`rows_of`), with
    `close_block` composed of `append_inverse_rms` and `phase1_rows`."""

    def close_block(
        blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor], eps: float
    ):
        blocks_inv_rms = append_inverse_rms(blocks_inv_rms, blocks[-1], eps)
        return blocks_inv_rms, *phase1_rows(blocks, blocks_inv_rms, queries)

    return DepthKernels(phase1_rows, phase1_rms_norm, phase2_rms_norm, append_inverse_rms, close_block)


def rows_of(phase1: Callable) -> Callable:
    """`phase1` (`two_phase_torch.phase1`'s signature) taking its queries as a sequence, with its stacked output split
    into rows."""

    def phase1_rows(blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor]):
        obar, lse = phase1(blocks, blocks_inv_rms, torch.stack(queries))
        return obar.unbind(0), lse

    return phase1_rows


TORCH_KERNELS = composed(rows_of(torch_phase1), torch_phase1_rms_norm, torch_phase2_rms_norm, torch_append_inverse_rms)

# Where torch has no nested compile regions, a region is the plain function.
_region = getattr(torch.compiler, "nested_compile_region", lambda function: function)


@_region
def _padded_phase1_rows(valid: torch.Tensor, queries: torch.Tensor, eps: torch.Tensor, *blocks: torch.Tensor):
    """`two_phase_torch.padded_phase1` as one nested compile region, its rows of `obar` then of `lse`: each a tensor
    of its own, since as views of one tensor a row's offset in it would be a constant in the kernels of the step that
    reads it."""
    obar, lse = padded_phase1(valid, queries, eps, *blocks)
    return *obar, *lse


def compiled_torch_kernels(device: torch.device, num_blocks: int, num_queries: int, eps: float) -> DepthKernels:
    """What torch.compile traces on the CPU for a graph without autograd that does not call the fused kernels'
    operators (the `reference` setting, a checkpoint's remote code, kernels that did not build): `two_phase_torch`
    inlined, so that inductor fuses each step's phase 2 with the sum before it and the norm after it, and phase 1 as
    one nested compile region, traced and compiled once and called by every block. Inductor compiles each distinct
    kernel once: every step's kernels are the same code as long as they read no constant of their own, so what a
    step reads is a tensor of its own (its query, its row of phase 1, its output scale,
    `DepthAttention.output_scale_tensor`), never a row of a larger one at an offset that inductor would write into
    its code.

    Phase 1 reads the blocks padded to the number the state ends with, `num_blocks`
    (`two_phase_torch.padded_phase1`), and scores `num_queries` queries (a block's; fewer are padded with zeros), so
    it has the same shapes at every block and at the output step and one region serves them all: the number of
    blocks would otherwise be a shape of each block's kernels, and torch inlines a region that is called once. It
    recomputes the blocks' inverse RMS with `eps` (the state's `blocks_inv_rms` grows with every block), and the
    padding is uninitialised memory that it masks out: one distinct tensor per slot, since a region handed the same
    tensor twice computes the wrong result (torch 2.13).
    """
    # Which blocks count when phase 1 reads n of them: row n - 1, a view, so the region reads no constant of its own.
    valid = torch.ones(num_blocks, num_blocks, dtype=torch.bool, device=device).tril()
    # eps as a tensor: under `dynamic=True` it is a symbolic float, which a region does not take.
    eps_tensor = torch.full((), eps, device=device)

    def phase1_rows(blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor]):
        # `blocks_inv_rms` is not read: the state still appends to it, and the compiler drops what nothing reads.
        padding = [torch.empty_like(blocks[0]) for _ in range(num_blocks - len(blocks))]
        count = len(queries)
        zero_queries = [queries[0].new_zeros(queries[0].shape)] * (num_queries - count)
        queries = torch.stack([*queries, *zero_queries])
        rows = _padded_phase1_rows(valid[len(blocks) - 1], queries, eps_tensor, *blocks, *padding)
        return rows[:count], rows[num_queries : num_queries + count]  # obar's rows, then lse's

    return composed(phase1_rows, torch_phase1_rms_norm, torch_phase2_rms_norm, torch_append_inverse_rms)


def depth_kernels(
    device: torch.device,
    depth_kernel: str = "auto",
    differentiable: bool = True,
    num_blocks: int = 1,
    num_queries: int = 1,
    eps: float = 1e-6,
) -> DepthKernels:
    """The implementations for tensors on `device` under the setting: the config's `depth_kernel` (`auto` or
    `reference`), else the environment variable `ATTNRES_DEPTH_KERNEL`, either of which can say `reference`:

    - `auto`: the Triton kernels on CUDA when Triton is importable, the fused C++ kernels on the CPU when they build,
      `two_phase_torch` otherwise, and always in a checkpoint's remote code;
    - `reference`: `two_phase_torch` everywhere;
    - `triton` / `cpu`: those kernels, or an error if they cannot be loaded (`triton` on a CPU means Triton's
      interpreter, `TRITON_INTERPRET=1`, for tests), or in a checkpoint's remote code.

    With `differentiable=False` (autograd records nothing), the C++ kernels are called without their autograd
    wrappers. Inside `torch.compile` on the CPU, a graph without autograd calls them as operators of PyTorch's
    dispatcher (`attnres.kernels.cpu.operators`), which the compiler keeps whole; a graph that records gradients gets
    `two_phase_torch` (the operators have no autograd formula), and one without autograd that does not call them
    (`reference`) `two_phase_torch` with phase 1 in a nested compile region (`compiled_torch_kernels`, for a state
    of `num_blocks` blocks whose inverse RMS takes `eps`, and blocks of up to `num_queries` steps), whose plain
    operations inductor fuses.

    Under autocast on `device`, every operation runs with it off (`without_autocast`).
    """
    override = os.environ.get("ATTNRES_DEPTH_KERNEL", "auto")
    if override not in SETTINGS:
        raise ValueError(f"ATTNRES_DEPTH_KERNEL={override!r} is invalid: allowed values are {', '.join(SETTINGS)}")
    setting = "reference" if depth_kernel == "reference" else override
    autocast = autocast_enabled(device.type)
    if torch.compiler.is_compiling():  # dynamo does not trace into the cache; the choice is traced instead
        # Phase 1's region serves every block while its inputs are alike; where autograd records, the blocks require
        # gradients and the padding does not, a pattern of its own at every block, and torch keeps at most 8 traces
        # of a region: such a graph traces phase 1 block by block.
        def compiled() -> DepthKernels:
            return TORCH_KERNELS if differentiable else compiled_torch_kernels(device, num_blocks, num_queries, eps)

        kernels = _choose(device.type, setting, differentiable, compiled)
        return without_autocast(kernels, device.type) if autocast else kernels
    return _remembered(device.type, setting, differentiable, autocast)


def _choose(
    device_type: str, setting: str, differentiable: bool, compiled: Callable[[], DepthKernels] | None = None
) -> DepthKernels:
    """The choice of `depth_kernels`; `compiled` builds the PyTorch implementation for a graph being traced, only
    where it is chosen (the operators take its place otherwise)."""
    compiling = compiled is not None

    def torch_kernels() -> DepthKernels:
        return (compiled() if compiling else TORCH_KERNELS)._replace(differentiable=differentiable)

    if setting == "reference":
        return torch_kernels()
    if not PACKAGED:
        if setting in ("cpu", "triton"):
            raise RuntimeError(
                f"ATTNRES_DEPTH_KERNEL={setting}: a checkpoint's remote code runs the PyTorch implementation only; "
                "load the model with the attnres package (without trust_remote_code) for its kernels"
            )
        return torch_kernels()
    # A compiled graph that records gradients runs `two_phase_torch` inlined: the kernels' operators have no autograd
    # formula.
    if device_type == "cpu" and setting in ("auto", "cpu") and not (compiling and differentiable):
        if _fused_cpu_kernels_built():
            from attnres.kernels import cpu

            kernels = cpu.operators() if compiling else cpu.implementations(differentiable)
            return DepthKernels(**kernels, differentiable=differentiable)
        if setting == "cpu":
            raise RuntimeError("ATTNRES_DEPTH_KERNEL=cpu, but the fused CPU kernels could not be built (log above)")
        return torch_kernels()
    if device_type != "cuda" and setting != "triton":
        return torch_kernels()
    try:
        from attnres.kernels import phase1, phase2_rms_norm
    except ImportError:
        if setting == "triton":
            raise
        return torch_kernels()

    def stacked_phase1(blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: torch.Tensor):
        # The Triton kernel reads the blocks stacked: one extra pass over them per block, not per sublayer.
        return phase1(torch.stack(blocks), blocks_inv_rms, queries)

    kernels = composed(rows_of(stacked_phase1), torch_phase1_rms_norm, phase2_rms_norm, torch_append_inverse_rms)
    return kernels._replace(differentiable=differentiable)


@torch.compiler.assume_constant_result
def _fused_cpu_kernels_built() -> bool:
    """Whether the fused CPU kernels (`attnres.kernels.cpu`) are there, building them on the first call (about a
    minute); under torch.compile asked outside the graph, whose constant the answer is."""
    try:
        from attnres.kernels import cpu
    except ImportError:
        return False
    return cpu.extension() is not None


@functools.cache
def _remembered(device_type: str, setting: str, differentiable: bool, autocast: bool) -> DepthKernels:
    """`_choose`, once per combination: decoding one token calls for a choice on every forward pass, and importing
    and checking again would cost more than phase 2 on a CPU."""
    kernels = _choose(device_type, setting, differentiable)
    return without_autocast(kernels, device_type) if autocast else kernels
