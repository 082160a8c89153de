"""Phase 1 of docs/design.md §6 in Triton: all `Q` pseudo-queries of a block against the `N` completed blocks.

Reference: `attnres.two_phase.phase1` (re-exported as `attnres.kernels.reference.phase1`); same signature, same
fp32 outputs, tested against it.

One program per token. The depth axes are tiny (`N` is about 8 blocks, `Q` the block size), so a program holds all
`Q x N` logits of its token in registers and streams the hidden size in chunks: a first sweep accumulates the logits
`w_q . b_n` (each block chunk is loaded once for all queries), the softmax over blocks is taken in registers, and a
second sweep writes `obar_q = sum_n p_qn b_n`. The second sweep re-reads the token's blocks while they are still in
cache. Keys are never materialised: the logit is `(w . b) * inv_rms(b)`.

Backward, per token, with `p` the softmax weights, `go`/`gl` the gradients of `obar`/`lse` and
`delta_q = go_q . obar_q`:

    ds_qn = p_qn (go_q . b_n - delta_q + gl_q)          # softmax backward plus the lse term
    d b_n = sum_q p_qn go_q + ds_qn inv_rms_n w_q
    d inv_rms_n = sum_q ds_qn (w_q . b_n)
    d w_q = sum_{tokens, n} ds_qn inv_rms_n b_n          # a reduction over tokens: `common.weighted_row_sum`
"""

import torch
import triton
import triton.language as tl

from .common import device_guard, hidden_block, next_power_of_2, weighted_row_sum


@triton.jit
def _phase1_forward_kernel(
    blocks_ptr,
    inv_rms_ptr,
    queries_ptr,
    obar_ptr,
    lse_ptr,
    num_blocks,
    num_tokens,
    num_queries,
    hidden,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    q = tl.arange(0, BLOCK_Q)
    n_mask = n < num_blocks
    q_mask = q < num_queries
    rows = n.to(tl.int64) * num_tokens + token
    cols = tl.arange(0, BLOCK_D)

    raw = tl.zeros([BLOCK_Q, BLOCK_N], tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        d_mask = d < hidden
        b = tl.load(blocks_ptr + rows[:, None] * hidden + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        w = tl.load(queries_ptr + q[:, None] * hidden + d[None, :], mask=q_mask[:, None] & d_mask[None, :], other=0.0)
        raw += tl.sum(w.to(tl.float32)[:, None, :] * b.to(tl.float32)[None, :, :], axis=2)

    inv_rms = tl.load(inv_rms_ptr + rows, mask=n_mask, other=0.0)
    logits = tl.where(n_mask[None, :], raw * inv_rms[None, :], float("-inf"))
    row_max = tl.max(logits, axis=1)
    lse = row_max + tl.log(tl.sum(tl.exp(logits - row_max[:, None]), axis=1))
    p = tl.exp(logits - lse[:, None])
    out_rows = q.to(tl.int64) * num_tokens + token
    tl.store(lse_ptr + out_rows, lse, mask=q_mask)

    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        d_mask = d < hidden
        b = tl.load(blocks_ptr + rows[:, None] * hidden + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        obar = tl.sum(p[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
        tl.store(obar_ptr + out_rows[:, None] * hidden + d[None, :], obar, mask=q_mask[:, None] & d_mask[None, :])


@triton.jit
def _phase1_backward_kernel(
    blocks_ptr,
    inv_rms_ptr,
    queries_ptr,
    obar_ptr,
    lse_ptr,
    grad_obar_ptr,
    grad_lse_ptr,
    grad_blocks_ptr,
    grad_inv_rms_ptr,
    query_coef_ptr,
    num_blocks,
    num_tokens,
    num_queries,
    hidden,
    BLOCK_N: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    n = tl.arange(0, BLOCK_N)
    q = tl.arange(0, BLOCK_Q)
    n_mask = n < num_blocks
    q_mask = q < num_queries
    rows = n.to(tl.int64) * num_tokens + token
    out_rows = q.to(tl.int64) * num_tokens + token
    cols = tl.arange(0, BLOCK_D)

    # Sweep 1: the logits, go_q . b_n and delta_q = go_q . obar_q.
    raw = tl.zeros([BLOCK_Q, BLOCK_N], tl.float32)
    grad_p = tl.zeros([BLOCK_Q, BLOCK_N], tl.float32)
    delta = tl.zeros([BLOCK_Q], tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        d_mask = d < hidden
        qd_mask = q_mask[:, None] & d_mask[None, :]
        b = tl.load(blocks_ptr + rows[:, None] * hidden + d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
        b = b.to(tl.float32)
        w = tl.load(queries_ptr + q[:, None] * hidden + d[None, :], mask=qd_mask, other=0.0).to(tl.float32)
        go = tl.load(grad_obar_ptr + out_rows[:, None] * hidden + d[None, :], mask=qd_mask, other=0.0).to(tl.float32)
        ob = tl.load(obar_ptr + out_rows[:, None] * hidden + d[None, :], mask=qd_mask, other=0.0)
        raw += tl.sum(w[:, None, :] * b[None, :, :], axis=2)
        grad_p += tl.sum(go[:, None, :] * b[None, :, :], axis=2)
        delta += tl.sum(go * ob, axis=1)

    inv_rms = tl.load(inv_rms_ptr + rows, mask=n_mask, other=0.0)
    lse = tl.load(lse_ptr + out_rows, mask=q_mask, other=0.0)
    grad_lse = tl.load(grad_lse_ptr + out_rows, mask=q_mask, other=0.0)
    valid = q_mask[:, None] & n_mask[None, :]
    p = tl.where(valid, tl.exp(raw * inv_rms[None, :] - lse[:, None]), 0.0)
    grad_logits = p * (grad_p - delta[:, None] + grad_lse[:, None])
    tl.store(grad_inv_rms_ptr + rows, tl.sum(grad_logits * raw, axis=0), mask=n_mask)
    # d logit / d w_q = inv_rms_n b_n: the coefficient of b_n in the query gradient, reduced over tokens later.
    coef = grad_logits * inv_rms[None, :]
    coef_offsets = (q[:, None] * num_blocks + n[None, :]).to(tl.int64) * num_tokens + token
    tl.store(query_coef_ptr + coef_offsets, coef, mask=valid)

    # Sweep 2: d b_n = sum_q p_qn go_q + coef_qn w_q.
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        d_mask = d < hidden
        qd_mask = q_mask[:, None] & d_mask[None, :]
        w = tl.load(queries_ptr + q[:, None] * hidden + d[None, :], mask=qd_mask, other=0.0).to(tl.float32)
        go = tl.load(grad_obar_ptr + out_rows[:, None] * hidden + d[None, :], mask=qd_mask, other=0.0).to(tl.float32)
        grad_b = tl.sum(p[:, :, None] * go[:, None, :] + coef[:, :, None] * w[:, None, :], axis=0)
        grad_b_ptrs = grad_blocks_ptr + rows[:, None] * hidden + d[None, :]
        tl.store(grad_b_ptrs, grad_b.to(grad_blocks_ptr.dtype.element_ty), mask=n_mask[:, None] & d_mask[None, :])


def _tiles(num_blocks: int, num_queries: int, hidden: int) -> dict[str, int]:
    block_n, block_q = next_power_of_2(num_blocks), next_power_of_2(num_queries)
    return {"BLOCK_N": block_n, "BLOCK_Q": block_q, "BLOCK_D": hidden_block(hidden, block_n * block_q)}


@torch.library.custom_op("attnres::phase1", mutates_args=())
def phase1(
    blocks: torch.Tensor, blocks_inv_rms: torch.Tensor, queries: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `attnres.two_phase.phase1`: `(obar [Q, *tokens, D] fp32, lse [Q, *tokens] fp32)`."""
    num_blocks, *tokens, hidden = blocks.shape
    num_queries = queries.shape[0]
    torch._check(
        tuple(blocks_inv_rms.shape) == (num_blocks, *tokens), lambda: "blocks_inv_rms must be blocks.shape[:-1]"
    )
    torch._check(tuple(queries.shape) == (num_queries, hidden), lambda: "queries must be [Q, blocks.shape[-1]]")
    num_tokens = blocks_inv_rms[0].numel()
    obar = blocks.new_empty((num_queries, *tokens, hidden), dtype=torch.float32)
    lse = blocks.new_empty((num_queries, *tokens), dtype=torch.float32)
    with device_guard(blocks):
        _phase1_forward_kernel[(num_tokens,)](
            blocks.contiguous(),
            blocks_inv_rms.float().contiguous(),
            queries.contiguous(),
            obar,
            lse,
            num_blocks,
            num_tokens,
            num_queries,
            hidden,
            **_tiles(num_blocks, num_queries, hidden),
        )
    return obar, lse


@phase1.register_fake
def _(blocks: torch.Tensor, blocks_inv_rms: torch.Tensor, queries: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = blocks.shape[1:-1]
    num_queries = queries.shape[0]
    obar = blocks.new_empty((num_queries, *tokens, blocks.shape[-1]), dtype=torch.float32)
    return obar, blocks.new_empty((num_queries, *tokens), dtype=torch.float32)


@torch.library.custom_op("attnres::phase1_backward", mutates_args=())
def phase1_backward(
    blocks: torch.Tensor,
    blocks_inv_rms: torch.Tensor,
    queries: torch.Tensor,
    obar: torch.Tensor,
    lse: torch.Tensor,
    grad_obar: torch.Tensor,
    grad_lse: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `phase1` w.r.t. `(blocks, blocks_inv_rms, queries)`, each in its input's dtype."""
    num_blocks, hidden = blocks.shape[0], blocks.shape[-1]
    num_queries = queries.shape[0]
    num_tokens = blocks_inv_rms[0].numel()
    blocks = blocks.contiguous()
    grad_blocks = torch.empty_like(blocks)
    grad_inv_rms = torch.empty_like(blocks_inv_rms, dtype=torch.float32)
    query_coef = blocks.new_empty((num_queries, num_blocks * num_tokens), dtype=torch.float32)
    with device_guard(blocks):
        _phase1_backward_kernel[(num_tokens,)](
            blocks,
            blocks_inv_rms.float().contiguous(),
            queries.contiguous(),
            obar.contiguous(),
            lse.contiguous(),
            grad_obar.float().contiguous(),
            grad_lse.float().contiguous(),
            grad_blocks,
            grad_inv_rms,
            query_coef,
            num_blocks,
            num_tokens,
            num_queries,
            hidden,
            **_tiles(num_blocks, num_queries, hidden),
        )
    grad_queries = weighted_row_sum(query_coef, blocks.view(num_blocks * num_tokens, hidden))
    return grad_blocks, grad_inv_rms.to(blocks_inv_rms.dtype), grad_queries.to(queries.dtype)


@phase1_backward.register_fake
def _(blocks, blocks_inv_rms, queries, obar, lse, grad_obar, grad_lse):
    return torch.empty_like(blocks), torch.empty_like(blocks_inv_rms), torch.empty_like(queries)


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    blocks, blocks_inv_rms, queries = inputs
    obar, lse = output
    ctx.save_for_backward(blocks, blocks_inv_rms, queries, obar, lse)


def _backward(ctx, grad_obar: torch.Tensor, grad_lse: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return phase1_backward(*ctx.saved_tensors, grad_obar, grad_lse)


phase1.register_autograd(_backward, setup_context=_setup_context)
