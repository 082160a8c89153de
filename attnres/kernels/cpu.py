"""Fused CPU kernels for the two phases (`cpu.cpp`), compiled on first use, behind `two_phase_torch`'s API.

On a CPU, depth attention costs per-operation overhead and memory passes more than arithmetic: `two_phase_torch`
spends a dozen or more tensor operations per phase and pass, each a dispatch of microseconds when decoding one token
and a pass over the tensors in training (phase 1's backward pass alone makes several per block). `cpu.cpp` computes
each phase's forward and backward pass in one call, reading each token's rows once while they are in cache. It is
compiled with PyTorch's C++ extension builder the first time a process needs it (about a minute; cached under
`TORCH_EXTENSIONS_DIR`, by default `~/.cache/torch_extensions`), which needs a C++ compiler and `ninja`; where it
cannot be built the model logs why once and keeps `two_phase_torch`, which computes the same.

Inside `torch.compile` the functions here defer to `two_phase_torch`, whose plain tensor operations inductor traces
and fuses itself. Their `*_without_autograd` variants skip that check and autograd's: the model chooses them for a
forward pass that starts with gradients off (`depth_mixing.two_phase_ops`), where decoding a token calls them 2L + 1
times and the checks cost a few Python calls each.
"""

import functools
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import torch

from .. import two_phase_torch


logger = logging.getLogger(__name__)


# Vector instructions to compile for, by the level PyTorch itself dispatches to on this CPU
# (`torch.backends.cpu.get_cpu_capability()`): the kernels' loops are written for the compiler to vectorise.
_VECTOR_FLAGS = {
    "AVX2": ["-mavx2", "-mfma"],
    "AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
}


@functools.cache
def extension():
    """The compiled `cpu.cpp` module, or `None` (with one warning) where it cannot be built."""
    from torch.utils import cpp_extension

    # One build per torch version (an extension compiled against another torch's headers must not be loaded) and
    # vector instruction set (a cache directory shared by different machines must not hand one another's build).
    capability = torch.backends.cpu.get_cpu_capability()
    name = "attnres_cpu_" + re.sub(r"\W", "_", f"{torch.__version__}_{capability}")
    try:
        return cpp_extension.load(
            name=name,
            sources=[str(Path(__file__).with_name("cpu.cpp"))],
            # OpenMP: ATen's thread pool (at::parallel_for) in the kernels.
            extra_cflags=["-O3", "-fopenmp", *_VECTOR_FLAGS.get(capability, [])],
            extra_ldflags=["-fopenmp"],
        )
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("attnres: fused CPU depth-attention kernels unavailable, using PyTorch ops (%s)", error)
        return None


class _Phase1(torch.autograd.Function):
    """`obar` as S separate outputs, so that each step's gradient for its row reaches the backward pass as it is.

    With `append_eps` (`close_block`), the kernel appends the newest block's inverse RMS to `blocks_inv_rms` and
    returns the `[N, *tokens]` first; its gradient then reaches the newest block in phase 1's backward pass."""

    @staticmethod
    def forward(
        ctx, blocks_inv_rms: torch.Tensor, queries: torch.Tensor, append_eps: float | None, *blocks: torch.Tensor
    ):
        inv_rms, lse, weights, raw, *obar = extension().phase1(list(blocks), blocks_inv_rms, queries, append_eps, True)
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


class _Phase2RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, obar, lse, partial, query, eps, norm_weight, norm_eps):
        out, stats = extension().phase2_rms_norm(obar, lse, partial, query, eps, norm_weight, norm_eps)
        ctx.save_for_backward(obar, partial, query, norm_weight, stats)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        obar, partial, query, norm_weight, stats = ctx.saved_tensors
        grad_obar, grad_lse, grad_partial, grad_query, grad_weight = extension().phase2_rms_norm_backward(
            grad_out, obar, partial, query, norm_weight, stats
        )
        return grad_obar, grad_lse, grad_partial, grad_query, None, grad_weight, None


def phase1(
    blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """`two_phase_torch.phase1` with `obar` as its S rows: `((obar_0, ..., obar_{S-1}), lse [S, *tokens])`, fp32,
    each row `[*tokens, D]` (see `depth_mixing.DepthKernels`)."""
    if torch.compiler.is_compiling():
        obar, lse = two_phase_torch.phase1(blocks, blocks_inv_rms, queries)
        return obar.unbind(0), lse
    if two_phase_torch.differentiating(blocks_inv_rms, queries, *blocks):
        lse, *obar = _Phase1.apply(blocks_inv_rms, queries, None, *blocks)
        return tuple(obar), lse
    return phase1_without_autograd(blocks, blocks_inv_rms, queries)


def phase1_without_autograd(
    blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """`phase1` where autograd records nothing and nothing is compiled: the kernel, called directly."""
    _, lse, _, _, *obar = extension().phase1(list(blocks), blocks_inv_rms, queries, None, False)
    return tuple(obar), lse


def close_block(
    blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: torch.Tensor, eps: float
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """`append_inverse_rms(blocks_inv_rms, blocks[-1], eps)`, then `phase1` over `blocks` with it, as one pass over
    the blocks: `(blocks_inv_rms [N, *tokens], obar rows, lse)` (see `depth_mixing.DepthKernels`)."""
    if torch.compiler.is_compiling():  # both fall back to `two_phase_torch`
        blocks_inv_rms = append_inverse_rms(blocks_inv_rms, blocks[-1], eps)
        return blocks_inv_rms, *phase1(blocks, blocks_inv_rms, queries)
    if two_phase_torch.differentiating(blocks_inv_rms, queries, *blocks):
        blocks_inv_rms, lse, *obar = _Phase1.apply(blocks_inv_rms, queries, eps, *blocks)
        return blocks_inv_rms, tuple(obar), lse
    return close_block_without_autograd(blocks, blocks_inv_rms, queries, eps)


def close_block_without_autograd(
    blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: torch.Tensor, eps: float
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], torch.Tensor]:
    """`close_block` where autograd records nothing and nothing is compiled: the kernel, called directly."""
    blocks_inv_rms, lse, _, _, *obar = extension().phase1(list(blocks), blocks_inv_rms, queries, eps, False)
    return blocks_inv_rms, tuple(obar), lse


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
        """`r = (mean(x^2) + eps)^(-1/2)` per token, so `dr/dx = -r^3 x / D`."""
        block, inv_rms = ctx.saved_tensors
        coef = grad[-1] * inv_rms.pow(3) / block.shape[-1]
        return grad[:-1], (-coef.unsqueeze(-1) * block.float()).to(block.dtype), None


def append_inverse_rms(blocks_inv_rms: torch.Tensor, block: torch.Tensor, eps: float) -> torch.Tensor:
    """`two_phase_torch.append_inverse_rms`: `[N + 1, *tokens]`."""
    if torch.compiler.is_compiling():
        return two_phase_torch.append_inverse_rms(blocks_inv_rms, block, eps)
    if two_phase_torch.differentiating(blocks_inv_rms, block):
        return _AppendInverseRMS.apply(blocks_inv_rms, block, eps)
    return append_inverse_rms_without_autograd(blocks_inv_rms, block, eps)


def append_inverse_rms_without_autograd(blocks_inv_rms: torch.Tensor, block: torch.Tensor, eps: float) -> torch.Tensor:
    """`append_inverse_rms` where autograd records nothing and nothing is compiled: the kernel, called directly."""
    return extension().append_inverse_rms(blocks_inv_rms, block, eps)


def phase2_rms_norm(
    obar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    eps: float,
    norm_weight: torch.Tensor,
    norm_eps: float,
) -> torch.Tensor:
    """`two_phase_torch.phase2_rms_norm`."""
    args = (obar, lse, partial, query, eps, norm_weight, norm_eps)
    if torch.compiler.is_compiling():
        return two_phase_torch.phase2_rms_norm(*args)
    if norm_weight.dtype == partial.dtype and two_phase_torch.differentiating(obar, lse, partial, query, norm_weight):
        return _Phase2RMSNorm.apply(*args)
    return phase2_rms_norm_without_autograd(*args)


def phase2_rms_norm_without_autograd(
    obar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    eps: float,
    norm_weight: torch.Tensor,
    norm_eps: float,
) -> torch.Tensor:
    """`phase2_rms_norm` where autograd records nothing and nothing is compiled. The kernel keeps the partial's dtype
    throughout, so a gain of another dtype (whose product the reference promotes) takes the PyTorch path, with
    autograd where it records."""
    args = (obar, lse, partial, query, eps, norm_weight, norm_eps)
    if norm_weight.dtype != partial.dtype:
        return two_phase_torch.phase2_rms_norm(*args)
    return extension().phase2_rms_norm(*args)[0]


class _Phase1RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, obar: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float):
        out, norm_inv_rms = extension().phase1_rms_norm(obar, norm_weight, norm_eps)
        ctx.save_for_backward(obar, norm_weight, norm_inv_rms)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        grad_obar, grad_weight = extension().phase1_rms_norm_backward(grad_out, *ctx.saved_tensors)
        return grad_obar, grad_weight, None


def phase1_rms_norm(
    obar: torch.Tensor, dtype: torch.dtype, norm_weight: torch.Tensor, norm_eps: float
) -> torch.Tensor:
    """`two_phase_torch.phase1_rms_norm`."""
    if torch.compiler.is_compiling():
        return two_phase_torch.phase1_rms_norm(obar, dtype, norm_weight, norm_eps)
    if norm_weight.dtype == dtype and two_phase_torch.differentiating(obar, norm_weight):
        return _Phase1RMSNorm.apply(obar, norm_weight, norm_eps)
    return phase1_rms_norm_without_autograd(obar, dtype, norm_weight, norm_eps)


def phase1_rms_norm_without_autograd(
    obar: torch.Tensor, dtype: torch.dtype, norm_weight: torch.Tensor, norm_eps: float
) -> torch.Tensor:
    """`phase1_rms_norm` where autograd records nothing and nothing is compiled. The kernel writes the gain's dtype,
    so a gain of another dtype than the model's takes the PyTorch path, with autograd where it records."""
    if norm_weight.dtype != dtype:
        return two_phase_torch.phase1_rms_norm(obar, dtype, norm_weight, norm_eps)
    return extension().phase1_rms_norm(obar, norm_weight, norm_eps)[0]


# The kernels in `depth_mixing.DepthKernels`' order: with autograd (and the PyTorch path inside `torch.compile`), and
# for a forward pass that autograd does not record, which skips both checks in each of the 2L + 1 steps' calls.
KERNELS = (phase1, phase1_rms_norm, phase2_rms_norm, append_inverse_rms, close_block)
KERNELS_WITHOUT_AUTOGRAD = (
    phase1_without_autograd,
    phase1_rms_norm_without_autograd,
    phase2_rms_norm_without_autograd,
    append_inverse_rms_without_autograd,
    close_block_without_autograd,
)
