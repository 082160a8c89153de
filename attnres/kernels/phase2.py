"""Phase 2 of SPEC §6 in Triton: merge the running partial sum `P` of the current block into phase 1's result.

Reference: `attnres.two_phase.phase2` (re-exported as `attnres.kernels.reference.phase2`); same signature.

A row kernel: each program owns a few tokens and streams the hidden size twice, first for the two reductions the
merge needs (`w . P` and `P . P`, i.e. the logit `s = (w . P) * inv_rms(P)`), then for the elementwise merge
`h = obar + g (P - obar)` with `g = sigmoid(s - lse)`. The second sweep re-reads the rows from cache.

Backward, per token, with `gh` the gradient of `h`, `r = inv_rms(P)` and `D` the hidden size:

    dg = gh . (P - obar);   ds = dg g (1 - g);   d lse = -ds
    d obar = (1 - g) gh
    d P = g gh + ds r w - ds (w . P) r^3 P / D     # the merge, the logit, and the logit through inv_rms(P)
    d w = sum_tokens ds r P                          # a reduction over tokens: `common.weighted_row_sum`
"""

import torch
import triton
import triton.language as tl

from .common import device_guard, hidden_block, next_power_of_2, weighted_row_sum


# Tokens per program: rows are independent, so a few per program only amortise the query loads.
_BLOCK_T = 4


@triton.jit
def _lerp(start, end, weight):
    """`torch.lerp`'s formula: from the nearer end, so `weight` 0 and 1 give `start` and `end` exactly."""
    return tl.where(weight < 0.5, start + weight * (end - start), end - (end - start) * (1.0 - weight))


@triton.jit
def _phase2_forward_kernel(
    obar_ptr,
    lse_ptr,
    partial_ptr,
    query_ptr,
    out_ptr,
    num_tokens,
    hidden,
    eps,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    rows = tokens.to(tl.int64)[:, None] * hidden
    cols = tl.arange(0, BLOCK_D)

    raw = tl.zeros([BLOCK_T], tl.float32)
    square_sum = tl.zeros([BLOCK_T], tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        d_mask = d < hidden
        x = tl.load(partial_ptr + rows + d[None, :], mask=t_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
        w = tl.load(query_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        raw += tl.sum(x * w[None, :], axis=1)
        square_sum += tl.sum(x * x, axis=1)

    inv_rms = tl.rsqrt(square_sum / hidden + eps)
    lse = tl.load(lse_ptr + tokens, mask=t_mask, other=0.0)
    gate = tl.sigmoid(raw * inv_rms - lse)[:, None]

    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        mask = t_mask[:, None] & (d < hidden)[None, :]
        x = tl.load(partial_ptr + rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        ob = tl.load(obar_ptr + rows + d[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + rows + d[None, :], _lerp(ob, x, gate).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _phase2_backward_kernel(
    obar_ptr,
    lse_ptr,
    partial_ptr,
    query_ptr,
    grad_out_ptr,
    grad_obar_ptr,
    grad_lse_ptr,
    grad_partial_ptr,
    query_coef_ptr,
    num_tokens,
    hidden,
    eps,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    rows = tokens.to(tl.int64)[:, None] * hidden
    cols = tl.arange(0, BLOCK_D)

    # Sweep 1: w . P, P . P and gh . (P - obar).
    raw = tl.zeros([BLOCK_T], tl.float32)
    square_sum = tl.zeros([BLOCK_T], tl.float32)
    grad_gate = tl.zeros([BLOCK_T], tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        d_mask = d < hidden
        mask = t_mask[:, None] & d_mask[None, :]
        x = tl.load(partial_ptr + rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        ob = tl.load(obar_ptr + rows + d[None, :], mask=mask, other=0.0)
        gh = tl.load(grad_out_ptr + rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(query_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        raw += tl.sum(x * w[None, :], axis=1)
        square_sum += tl.sum(x * x, axis=1)
        grad_gate += tl.sum(gh * (x - ob), axis=1)

    inv_rms = tl.rsqrt(square_sum / hidden + eps)
    lse = tl.load(lse_ptr + tokens, mask=t_mask, other=0.0)
    gate = tl.sigmoid(raw * inv_rms - lse)
    grad_logit = grad_gate * gate * (1.0 - gate)
    tl.store(grad_lse_ptr + tokens, -grad_logit, mask=t_mask)
    coef = grad_logit * inv_rms
    tl.store(query_coef_ptr + tokens, coef, mask=t_mask)
    norm_coef = (grad_logit * raw * inv_rms * inv_rms * inv_rms / hidden)[:, None]
    gate = gate[:, None]
    coef = coef[:, None]

    # Sweep 2: the elementwise gradients.
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        d_mask = d < hidden
        mask = t_mask[:, None] & d_mask[None, :]
        x = tl.load(partial_ptr + rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        gh = tl.load(grad_out_ptr + rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
        w = tl.load(query_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        tl.store(grad_obar_ptr + rows + d[None, :], (1.0 - gate) * gh, mask=mask)
        grad_x = gate * gh + coef * w[None, :] - norm_coef * x
        tl.store(grad_partial_ptr + rows + d[None, :], grad_x.to(grad_partial_ptr.dtype.element_ty), mask=mask)


def _tiles(hidden: int) -> dict[str, int]:
    return {"BLOCK_T": _BLOCK_T, "BLOCK_D": hidden_block(hidden, _BLOCK_T)}


@torch.library.custom_op("attnres::phase2", mutates_args=())
def phase2(
    obar: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor, eps: float
) -> torch.Tensor:
    """Triton `attnres.two_phase.phase2`: the sublayer input `h` `[*tokens, D]` in `partial.dtype`."""
    hidden = partial.shape[-1]
    torch._check(obar.shape == partial.shape, lambda: "obar and partial must have the same shape")
    torch._check(lse.shape == partial.shape[:-1], lambda: "lse must be partial.shape[:-1]")
    torch._check(tuple(query.shape) == (hidden,), lambda: "query must be [partial.shape[-1]]")
    num_tokens = lse.numel()
    out = torch.empty_like(partial, memory_format=torch.contiguous_format)
    with device_guard(partial):
        _phase2_forward_kernel[(triton.cdiv(num_tokens, _BLOCK_T),)](
            obar.float().contiguous(),
            lse.float().contiguous(),
            partial.contiguous(),
            query.contiguous(),
            out,
            num_tokens,
            hidden,
            eps,
            **_tiles(hidden),
        )
    return out


@phase2.register_fake
def _(obar: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor, query: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.empty_like(partial, memory_format=torch.contiguous_format)


@torch.library.custom_op("attnres::phase2_backward", mutates_args=())
def phase2_backward(
    obar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    grad_out: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `phase2` w.r.t. `(obar, lse, partial, query)`, each in its input's dtype."""
    hidden = partial.shape[-1]
    num_tokens = lse.numel()
    partial = partial.contiguous()
    grad_obar = torch.empty_like(obar, dtype=torch.float32, memory_format=torch.contiguous_format)
    grad_lse = torch.empty_like(lse, dtype=torch.float32, memory_format=torch.contiguous_format)
    grad_partial = torch.empty_like(partial)
    query_coef = partial.new_empty((1, num_tokens), dtype=torch.float32)
    with device_guard(partial):
        _phase2_backward_kernel[(triton.cdiv(num_tokens, _BLOCK_T),)](
            obar.float().contiguous(),
            lse.float().contiguous(),
            partial,
            query.contiguous(),
            grad_out.contiguous(),
            grad_obar,
            grad_lse,
            grad_partial,
            query_coef,
            num_tokens,
            hidden,
            eps,
            **_tiles(hidden),
        )
    grad_query = weighted_row_sum(query_coef, partial.view(num_tokens, hidden))[0]
    return grad_obar.to(obar.dtype), grad_lse.to(lse.dtype), grad_partial, grad_query.to(query.dtype)


@phase2_backward.register_fake
def _(obar, lse, partial, query, grad_out, eps):
    return (
        torch.empty_like(obar, memory_format=torch.contiguous_format),
        torch.empty_like(lse, memory_format=torch.contiguous_format),
        torch.empty_like(partial, memory_format=torch.contiguous_format),
        torch.empty_like(query, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    obar, lse, partial, query, eps = inputs
    ctx.save_for_backward(obar, lse, partial, query)
    ctx.eps = eps


def _backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    return *phase2_backward(*ctx.saved_tensors, grad_out, ctx.eps), None


phase2.register_autograd(_backward, setup_context=_setup_context)
