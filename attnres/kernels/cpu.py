"""Fused CPU kernels for the two phases (`cpu.cpp`), compiled on first use, behind `two_phase_torch`'s API.

On a CPU, depth attention costs per-operation overhead and memory passes more than arithmetic: `two_phase_torch`
spends a dozen or more tensor operations per phase and pass, each a dispatch of microseconds when decoding one token
and a pass over the tensors in training (phase 1's backward pass alone makes several per block). `cpu.cpp` computes
each phase's forward and backward pass in one call, reading each token's rows once while they are in cache. It is
compiled with PyTorch's C++ extension builder, which needs a C++ compiler and `ninja`, the first time a process on a
machine needs it (about a minute, announced by one warning; `python -c "from attnres.kernels import cpu;
cpu.extension()"` builds it ahead of time), and cached per source and Python environment (`build.py`); where it
cannot be built the model logs why once and keeps `two_phase_torch`, which computes the same.

`implementations(differentiable)` gives the operations by their `kernel_dispatch.DepthKernels` names. With autograd,
each one runs `two_phase_torch` inside `torch.compile` (whose plain operations inductor fuses), its autograd Function
where autograd records the call, and the kernel directly otherwise; without autograd (a forward pass that starts with
gradients off, `kernel_dispatch.depth_kernels`) it is the kernel, called directly, skipping the checks that decoding
a token would otherwise run in each of the 2L + 1 steps. `operators()` gives them as operators of PyTorch's
dispatcher (`torch.ops.attnres_cpu.*`), for graphs that torch.compile captures without autograd. Where a gain's
dtype differs from the model's (the kernels keep one dtype throughout), `two_phase_torch` computes the operation,
with its own autograd.
"""

import functools
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

from .. import two_phase, two_phase_torch
from .build import compiled


logger = logging.getLogger(__name__)


# Vector instructions to compile for, by the level PyTorch itself dispatches to on this CPU
# (`torch.backends.cpu.get_cpu_capability()`): the kernels' loops are written for the compiler to vectorise.
_VECTOR_FLAGS = {
    "AVX2": ["-mavx2", "-mfma"],
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}


@functools.cache
def extension() -> ModuleType | None:
    """The compiled `cpu.cpp` module, or `None` (with one warning) where it cannot be built."""
    capability = torch.backends.cpu.get_cpu_capability()
    try:
        module = compiled(
            Path(__file__).with_name("cpu.cpp"),
            # OpenMP: ATen's thread pool (at::parallel_for) in the kernels.
            cflags=["-O3", "-fopenmp", *_VECTOR_FLAGS.get(capability, [])],
            ldflags=["-fopenmp"],
        )
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("attnres: fused CPU depth-attention kernels unavailable, using PyTorch ops (%s)", error)
        return None
    _register_fake_implementations()
    return module


class _Phase1(torch.autograd.Function):
    """Phase 1's rows as S separate outputs, so that each step's gradient for its row reaches the backward pass as it
    is; its queries stacked `[S, D]`, as the backward kernel returns their gradient. With `append_eps`
    (`close_block`), the kernel appends the newest block's inverse RMS to `blocks_inv_rms` and returns the
    `[N, *tokens]` first; its gradient then reaches the newest block in phase 1's backward pass."""

    @staticmethod
    def forward(
        ctx, blocks_inv_rms: torch.Tensor, queries: torch.Tensor, append_eps: float | None, *blocks: torch.Tensor
    ):
        inv_rms, lse, weights, raw, *obar = extension().phase1(
            list(blocks), blocks_inv_rms, list(queries), append_eps, True
        )
        ctx.appends = append_eps is not None
        ctx.save_for_backward(inv_rms, queries, weights, raw, *blocks)
        if ctx.appends:
            return inv_rms, lse, *obar
        return lse, *obar

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        grad_appended, (grad_lse, *grad_obar) = (grads[0], grads[1:]) if ctx.appends else (None, grads)
        blocks_inv_rms, queries, weights, raw, *blocks = ctx.saved_tensors
        saved = (blocks, blocks_inv_rms, queries, weights, raw, ctx.appends, grad_appended)
        grad_inv_rms, grad_queries, *grad_blocks = extension().phase1_backward(list(grad_obar), grad_lse, *saved)
        return grad_inv_rms, grad_queries, None, *grad_blocks


class _AppendInverseRMS(torch.autograd.Function):
    """The kernel's forward pass in training too, so that reentrant activation checkpointing, which runs the forward
    pass without gradients and recomputes it with them, recomputes exactly the same values."""

    @staticmethod
    def forward(ctx, blocks_inv_rms: torch.Tensor, block: torch.Tensor, eps: float):
        appended = extension().append_inverse_rms(blocks_inv_rms, block, eps)
        ctx.save_for_backward(block, appended[-1])
        return appended

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        """`r = (mean(x^2) + eps)^(-1/2)` per token, so `dr/dx = -r^3 x / D` (docs/design.md §7)."""
        block, inv_rms = ctx.saved_tensors
        coef = grad[-1] * inv_rms.pow(3) / block.shape[-1]
        return grad[:-1], (-coef.unsqueeze(-1) * block.float()).to(block.dtype), None


class _Phase2(torch.autograd.Function):
    """Phase 2 fused with the RMSNorm of gain `norm_weight + gain_offset`, or, with `norm_weight=None`, phase 2 alone
    times the step's output scale `scale` (a float: the 0-d buffer it comes from takes no gradient)."""

    @staticmethod
    def forward(ctx, obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset, scale):
        out, stats = extension().phase2(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset, scale)
        ctx.gain_offset, ctx.scale = gain_offset, scale
        ctx.save_for_backward(obar, partial, query, norm_weight, stats)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        obar, partial, query, norm_weight, stats = ctx.saved_tensors
        grad_obar, grad_lse, grad_partial, grad_query, grad_weight = extension().phase2_backward(
            grad_out, obar, partial, query, norm_weight, stats, ctx.gain_offset, ctx.scale
        )
        return grad_obar, grad_lse, grad_partial, grad_query, None, grad_weight, None, None, None


class _Phase1RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, obar: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float, gain_offset: float):
        out, norm_inv_rms = extension().phase1_rms_norm(obar, norm_weight, norm_eps, gain_offset)
        ctx.gain_offset = gain_offset
        ctx.save_for_backward(obar, norm_weight, norm_inv_rms)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_obar, grad_weight = extension().phase1_rms_norm_backward(grad_out, *ctx.saved_tensors, ctx.gain_offset)
        return grad_obar, grad_weight, None, None


# Each operation three ways, with `two_phase_torch`'s signature, except that phase 1 takes the S queries `[D]` as a
# sequence and returns its rows (`kernel_dispatch.DepthKernels`): (the kernel called directly, the kernel's autograd
# Function, the PyTorch fallback).


def _torch_phase1(blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor]):
    obar, lse = two_phase_torch.phase1(blocks, blocks_inv_rms, torch.stack(queries))
    return obar.unbind(0), lse


def _torch_close_block(
    blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor], eps: float
):
    blocks_inv_rms = two_phase_torch.append_inverse_rms(blocks_inv_rms, blocks[-1], eps)
    return blocks_inv_rms, *_torch_phase1(blocks, blocks_inv_rms, queries)


def _direct_phase1(blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor]):
    _, lse, _, _, *obar = extension().phase1(list(blocks), blocks_inv_rms, list(queries), None, False)
    return tuple(obar), lse


def _recorded_phase1(blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor]):
    lse, *obar = _Phase1.apply(blocks_inv_rms, torch.stack(queries), None, *blocks)
    return tuple(obar), lse


def _direct_close_block(
    blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor], eps: float
):
    """Appending the newest block's inverse RMS and phase 1 over all the blocks, in one pass over them."""
    blocks_inv_rms, lse, _, _, *obar = extension().phase1(list(blocks), blocks_inv_rms, list(queries), eps, False)
    return blocks_inv_rms, tuple(obar), lse


def _recorded_close_block(
    blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor], eps: float
):
    blocks_inv_rms, lse, *obar = _Phase1.apply(blocks_inv_rms, torch.stack(queries), eps, *blocks)
    return blocks_inv_rms, tuple(obar), lse


def _direct_append_inverse_rms(blocks_inv_rms: torch.Tensor, block: torch.Tensor, eps: float) -> torch.Tensor:
    return extension().append_inverse_rms(blocks_inv_rms, block, eps)


def _scale_value(scale: torch.Tensor | None) -> float:
    """The step's output scale k (`two_phase.phase2`'s 0-d buffer, or `None` for 1) as the kernel takes it."""
    return 1.0 if scale is None else scale.item()


def _direct_phase2(obar, lse, partial, query, eps, scale=None) -> torch.Tensor:
    return extension().phase2(obar, lse, partial, query, eps, None, 0.0, 0.0, _scale_value(scale))[0]


def _recorded_phase2(obar, lse, partial, query, eps, scale=None) -> torch.Tensor:
    return _Phase2.apply(obar, lse, partial, query, eps, None, 0.0, 0.0, _scale_value(scale))


def _direct_phase2_rms_norm(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset=0.0) -> torch.Tensor:
    if norm_weight.dtype != partial.dtype:
        return two_phase_torch.phase2_rms_norm(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset)
    return extension().phase2(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset, 1.0)[0]


def _recorded_phase2_rms_norm(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset=0.0) -> torch.Tensor:
    if norm_weight.dtype != partial.dtype:
        return two_phase_torch.phase2_rms_norm(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset)
    return _Phase2.apply(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset, 1.0)


def _direct_phase1_rms_norm(obar, dtype, norm_weight, norm_eps, gain_offset=0.0) -> torch.Tensor:
    if norm_weight.dtype != dtype:
        return two_phase_torch.phase1_rms_norm(obar, dtype, norm_weight, norm_eps, gain_offset)
    return extension().phase1_rms_norm(obar, norm_weight, norm_eps, gain_offset)[0]


def _recorded_phase1_rms_norm(obar, dtype, norm_weight, norm_eps, gain_offset=0.0) -> torch.Tensor:
    if norm_weight.dtype != dtype:
        return two_phase_torch.phase1_rms_norm(obar, dtype, norm_weight, norm_eps, gain_offset)
    return _Phase1RMSNorm.apply(obar, norm_weight, norm_eps, gain_offset)


_OPERATIONS = {
    "phase1": (_direct_phase1, _recorded_phase1, _torch_phase1),
    "phase1_rms_norm": (_direct_phase1_rms_norm, _recorded_phase1_rms_norm, two_phase_torch.phase1_rms_norm),
    "phase2_rms_norm": (_direct_phase2_rms_norm, _recorded_phase2_rms_norm, two_phase_torch.phase2_rms_norm),
    "phase2": (_direct_phase2, _recorded_phase2, two_phase.phase2),
    "append_inverse_rms": (
        _direct_append_inverse_rms,
        _AppendInverseRMS.apply,
        two_phase_torch.append_inverse_rms,
    ),
    "close_block": (_direct_close_block, _recorded_close_block, _torch_close_block),
}


def _tensors(args: tuple) -> list[torch.Tensor]:
    """The tensors among `args`, those inside a sequence (the blocks) included."""
    found = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            found.append(arg)
        elif isinstance(arg, (list, tuple)):
            found.extend(arg)
    return found


def _with_autograd(direct: Callable, recorded: Callable, fallback: Callable) -> Callable:
    """One operation where autograd may record: `fallback` while compiling, `recorded` where autograd records the
    call, `direct` otherwise."""

    def operation(*args, **kwargs):
        if torch.compiler.is_compiling():
            return fallback(*args, **kwargs)
        if two_phase_torch.differentiating(*_tensors(args)):
            return recorded(*args, **kwargs)
        return direct(*args, **kwargs)

    return operation


_WITH_AUTOGRAD = {name: _with_autograd(*ways) for name, ways in _OPERATIONS.items()}
_WITHOUT_AUTOGRAD = {name: direct for name, (direct, _, _) in _OPERATIONS.items()}

# The operations as `kernel_dispatch.DepthKernels` defines them, for callers outside the model.
phase1 = _WITH_AUTOGRAD["phase1"]
phase1_rms_norm = _WITH_AUTOGRAD["phase1_rms_norm"]
phase2_rms_norm = _WITH_AUTOGRAD["phase2_rms_norm"]
append_inverse_rms = _WITH_AUTOGRAD["append_inverse_rms"]
close_block = _WITH_AUTOGRAD["close_block"]
phase2 = _WITH_AUTOGRAD["phase2"]


def implementations(differentiable: bool) -> dict[str, Callable]:
    """The kernels by their `kernel_dispatch.DepthKernels` names: with autograd where the forward pass may be recorded
    (`differentiable`), or called directly."""
    return _WITH_AUTOGRAD if differentiable else _WITHOUT_AUTOGRAD


# The forward kernels as operators of PyTorch's dispatcher (`torch.ops.attnres_cpu.*`, registered by `cpu.cpp`), for
# graphs that torch.compile captures without autograd (`operators()`): the compiler keeps each call whole, so
# inductor generates no code for depth mixing and a model compiles in about its family's time (docs/design.md §8).
# They have no autograd formula: a graph that records gradients runs `two_phase_torch` inlined instead
# (`kernel_dispatch.depth_kernels`). Under tracing, an operator's outputs are those of `two_phase_torch` computed on
# fake tensors, made contiguous as the kernels write them (`_register_fake_implementations`).


def _phase1_by_operator(blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor]):
    lse, *rows = torch.ops.attnres_cpu.phase1.default(list(blocks), blocks_inv_rms, list(queries))
    return tuple(rows), lse


def _close_block_by_operator(
    blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: Sequence[torch.Tensor], eps: float
):
    operator = torch.ops.attnres_cpu.close_block.default
    blocks_inv_rms, lse, *rows = operator(list(blocks), blocks_inv_rms, list(queries), eps)
    return blocks_inv_rms, tuple(rows), lse


def _phase2_by_operator(obar, lse, partial, query, eps, scale=None) -> torch.Tensor:
    return torch.ops.attnres_cpu.phase2.default(obar, lse, partial, query, eps, scale)


def _phase2_rms_norm_by_operator(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset=0.0):
    if norm_weight.dtype != partial.dtype:
        return two_phase_torch.phase2_rms_norm(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset)
    operator = torch.ops.attnres_cpu.phase2_rms_norm.default
    return operator(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset)


def _phase1_rms_norm_by_operator(obar, dtype, norm_weight, norm_eps, gain_offset=0.0) -> torch.Tensor:
    if norm_weight.dtype != dtype:
        return two_phase_torch.phase1_rms_norm(obar, dtype, norm_weight, norm_eps, gain_offset)
    return torch.ops.attnres_cpu.phase1_rms_norm.default(obar, norm_weight, norm_eps, gain_offset)


def _append_inverse_rms_by_operator(blocks_inv_rms: torch.Tensor, block: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.ops.attnres_cpu.append_inverse_rms.default(blocks_inv_rms, block, eps)


def _fresh(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format)


def _fake_phase1(blocks, blocks_inv_rms, queries):
    rows, lse = _torch_phase1(blocks, blocks_inv_rms, queries)
    return [_fresh(lse), *map(_fresh, rows)]


def _fake_close_block(blocks, blocks_inv_rms, queries, eps):
    blocks_inv_rms, rows, lse = _torch_close_block(blocks, blocks_inv_rms, queries, eps)
    return [_fresh(blocks_inv_rms), _fresh(lse), *map(_fresh, rows)]


def _fake_phase2(obar, lse, partial, query, eps, scale):
    return _fresh(two_phase.phase2(obar, lse, partial, query, eps, scale))


def _fake_phase2_rms_norm(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset=0.0):
    return _fresh(two_phase_torch.phase2_rms_norm(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset))


def _fake_phase1_rms_norm(obar, norm_weight, norm_eps, gain_offset=0.0):
    return _fresh(two_phase_torch.phase1_rms_norm(obar, norm_weight.dtype, norm_weight, norm_eps, gain_offset))


def _fake_append_inverse_rms(blocks_inv_rms, block, eps):
    return _fresh(two_phase_torch.append_inverse_rms(blocks_inv_rms, block, eps))


def _register_fake_implementations() -> None:
    """The operators' fake implementations, once their library (the built extension) is loaded."""
    fakes = {
        "phase1": _fake_phase1,
        "close_block": _fake_close_block,
        "phase2": _fake_phase2,
        "phase2_rms_norm": _fake_phase2_rms_norm,
        "phase1_rms_norm": _fake_phase1_rms_norm,
        "append_inverse_rms": _fake_append_inverse_rms,
    }
    for name, fake in fakes.items():
        torch.library.register_fake(f"attnres_cpu::{name}", fake)


def operators() -> dict[str, Callable]:
    """The kernels by their `kernel_dispatch.DepthKernels` names as the dispatcher's operators, for compiled graphs
    without autograd."""
    return {
        "phase1": _phase1_by_operator,
        "phase1_rms_norm": _phase1_rms_norm_by_operator,
        "phase2_rms_norm": _phase2_rms_norm_by_operator,
        "append_inverse_rms": _append_inverse_rms_by_operator,
        "close_block": _close_block_by_operator,
        "phase2": _phase2_by_operator,
    }
