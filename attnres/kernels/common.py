"""Pieces shared by the phase-1 and phase-2 kernels: tile sizes, the device guard, and the token reduction that turns
per-token coefficients into a pseudo-query gradient.

Every kernel here is memory-bound: the depth dimension (N blocks, Q queries) is tiny and the hidden size is the
long axis, so tiles are `[small, BLOCK_D]` with fp32 register math and no tensor-core `tl.dot`.
"""

import contextlib

import torch
import triton
import triton.language as tl


# Elements of the largest fp32 temporary a program builds (e.g. `[BLOCK_Q, BLOCK_N, BLOCK_D]`). 4096 fp32 values are
# 32 registers per thread at 4 warps: large enough to keep the memory system busy, small enough not to spill.
TILE_ELEMENTS = 4096
# Widest hidden-size chunk one program loads at a time; wider rows are looped over.
MAX_BLOCK_D = 1024


def next_power_of_2(n: int) -> int:
    """Triton block shapes must be powers of two; padding lanes are masked."""
    return triton.next_power_of_2(max(n, 1))


def hidden_block(hidden: int, lanes: int) -> int:
    """Width of the hidden-size chunk when `lanes` rows (queries x blocks, or tokens) are processed together."""
    return max(16, min(next_power_of_2(hidden), MAX_BLOCK_D, TILE_ELEMENTS // lanes))


def device_guard(tensor: torch.Tensor) -> contextlib.AbstractContextManager:
    """Make `tensor`'s GPU the current one: Triton launches on the current device, and a model spread over several
    GPUs (`device_map="auto"`) calls the kernels with tensors on each of them."""
    return torch.cuda.device(tensor.device) if tensor.is_cuda else contextlib.nullcontext()


@triton.jit
def _weighted_row_sum_kernel(
    coef_ptr,
    rows_ptr,
    partial_ptr,
    num_rows,
    num_coef,
    hidden,
    rows_per_split,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """`partial[split, q, d] = sum_{m in split} coef[q, m] * rows[m, d]`, one hidden-size chunk per program."""
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    split = tl.program_id(1)
    q = tl.arange(0, BLOCK_Q)
    d_mask = d < hidden
    q_mask = q < num_coef
    start = split * rows_per_split
    end = tl.minimum(start + rows_per_split, num_rows)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    for m0 in range(start, end, BLOCK_M):
        m = (m0 + tl.arange(0, BLOCK_M)).to(tl.int64)
        m_mask = m < end
        x = tl.load(rows_ptr + m[:, None] * hidden + d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        c = tl.load(coef_ptr + q[:, None] * num_rows + m[None, :], mask=q_mask[:, None] & m_mask[None, :], other=0.0)
        acc += tl.sum(c[:, :, None] * x.to(tl.float32)[None, :, :], axis=1)
    out = partial_ptr + (split * num_coef + q[:, None]).to(tl.int64) * hidden + d[None, :]
    tl.store(out, acc, mask=q_mask[:, None] & d_mask[None, :])


# Programs along the token axis of the reduction: enough to fill a large GPU, few enough that the fp32 partials
# `[splits, Q, D]` stay a small fraction of the rows they summarise.
_REDUCTION_SPLITS = 256


def weighted_row_sum(coef: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`coef @ rows` in fp32 for fp32 `coef` `[Q, M]` and `rows` `[M, D]` of any float dtype, M large and Q small.

    It is the gradient of a pseudo-query: a sum over every token (and block) of a per-token coefficient times the
    row. A bf16 matmul would round the coefficients; an fp32 one would need an fp32 copy of `rows`. Deterministic:
    fixed splits of the rows are summed in registers, then the `[splits, Q, D]` partials by `torch.sum`.
    """
    num_coef, num_rows = coef.shape
    hidden = rows.shape[-1]
    block_q = next_power_of_2(num_coef)
    block_m = 16
    block_d = hidden_block(hidden, block_q * block_m)
    splits = min(triton.cdiv(num_rows, block_m), _REDUCTION_SPLITS)
    rows_per_split = triton.cdiv(triton.cdiv(num_rows, splits), block_m) * block_m
    splits = triton.cdiv(num_rows, rows_per_split)
    partial = torch.empty(splits, num_coef, hidden, device=rows.device, dtype=torch.float32)
    with device_guard(rows):
        _weighted_row_sum_kernel[(triton.cdiv(hidden, block_d), splits)](
            coef,
            rows,
            partial,
            num_rows,
            num_coef,
            hidden,
            rows_per_split,
            BLOCK_Q=block_q,
            BLOCK_M=block_m,
            BLOCK_D=block_d,
        )
    return partial.sum(0)
