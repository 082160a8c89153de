"""Phase 2 of docs/design.md §6 in Triton, fused with the pre-norm of the sublayer that reads its result.

Phase 2 merges the running partial sum `P` of the current block into phase 1's result for one pseudo-query `w`:
`h = obar + g (P - obar)` with `g = sigmoid(s - lse)` and the partial's logit `s = (w . P) * inv_rms(P)`. In the model
`h` is only ever read by the RMSNorm in front of a sublayer (Llama's: `gamma * (h * inv_rms(h))`), so the kernel
returns that norm's output instead of `h`: `h` is never written to memory and read back, and in training it is not
kept for the backward pass but recomputed from `obar` and `P`, which the backward needs anyway.

Reference: `attnres.two_phase.phase2_rms_norm` (re-exported as `attnres.kernels.reference.phase2_rms_norm`), same
signature. Everything is computed in fp32 and the output rounded once to its dtype; with bf16 / fp16 inputs the
unfused model rounds twice more (`h`, and the normalised value before the gain, as Llama's RMSNorm does), so the two
differ there by about a unit in the last place.

A row kernel: each program owns a few tokens and streams the hidden size three times (the partial's two reductions
`w . P` and `P . P`; then `h . h`; then the output), the later sweeps re-reading the rows from cache.

Backward, per token, with `gy` the output gradient, `n = h * r_h` (`r_h = inv_rms(h)`, `r = inv_rms(P)`, `D` the
hidden size):

    d gamma = sum_tokens gy n;   dn = gamma gy;   gh = r_h dn - r_h^3 (h . dn) h / D      # the RMSNorm
    dg = gh . (P - obar);   ds = dg g (1 - g);   d lse = -ds
    d obar = (1 - g) gh
    d P = g gh + ds r w - ds (w . P) r^3 P / D     # the merge, the logit, and the logit through inv_rms(P)
    d w = sum_tokens ds r P                          # a reduction over tokens: `common.weighted_row_sum`

`dg` needs `gh` summed over the whole row before the elementwise sweep, so it is expanded into four row sums taken in
one sweep: `dg = r_h (dn . (P - obar)) - r_h^3 (h . dn) (h . (P - obar)) / D`. The gain's gradient is a sum over
tokens: each program owns a contiguous range of tokens and accumulates its share in a private fp32 row, and the rows
are summed by `torch.sum` (deterministic).
"""

import torch
import triton
import triton.language as tl

from ..two_phase import norm_gain
from .common import device_guard, hidden_block, weighted_row_sum


# Tokens per tile: rows are independent, so a few per program only amortise the loads of the query and the gain.
_BLOCK_T = 4
# Programs of the backward pass, each owning a contiguous range of tokens and one private row of the gain gradient.
_BACKWARD_SPLITS = 256


@triton.jit
def _lerp(start, end, weight):
    """`torch.lerp`'s formula: from the nearer end, so `weight` 0 and 1 give `start` and `end` exactly."""
    return tl.where(weight < 0.5, start + weight * (end - start), end - (end - start) * (1.0 - weight))


@triton.jit
def _partial_logit(partial_ptr, query_ptr, rows, t_mask, hidden, eps, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """`(w . P, inv_rms(P))` per token of the tile: one sweep over the partial sums' rows."""
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
    return raw, tl.rsqrt(square_sum / hidden + eps)


@triton.jit
def _merged(obar_ptr, partial_ptr, offsets, mask, gate):
    """`(h, P, obar)` in fp32 for one chunk of the tile."""
    x = tl.load(partial_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(obar_ptr + offsets, mask=mask, other=0.0)
    return _lerp(ob, x, gate), x, ob


@triton.jit
def _phase2_rms_norm_forward_kernel(
    obar_ptr,
    lse_ptr,
    partial_ptr,
    query_ptr,
    norm_weight_ptr,
    out_ptr,
    num_tokens,
    hidden,
    eps,
    norm_eps,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_mask = tokens < num_tokens
    rows = tokens.to(tl.int64)[:, None] * hidden
    cols = tl.arange(0, BLOCK_D)

    raw, inv_rms = _partial_logit(partial_ptr, query_ptr, rows, t_mask, hidden, eps, BLOCK_T, BLOCK_D)
    lse = tl.load(lse_ptr + tokens, mask=t_mask, other=0.0)
    gate = tl.sigmoid(raw * inv_rms - lse)[:, None]

    square_sum = tl.zeros([BLOCK_T], tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        h, _, _ = _merged(obar_ptr, partial_ptr, rows + d[None, :], t_mask[:, None] & (d < hidden)[None, :], gate)
        square_sum += tl.sum(h * h, axis=1)
    norm_inv_rms = tl.rsqrt(square_sum / hidden + norm_eps)[:, None]

    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        d_mask = d < hidden
        mask = t_mask[:, None] & d_mask[None, :]
        h, _, _ = _merged(obar_ptr, partial_ptr, rows + d[None, :], mask, gate)
        gain = tl.load(norm_weight_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
        out = gain[None, :] * h * norm_inv_rms
        tl.store(out_ptr + rows + d[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _phase2_rms_norm_backward_kernel(
    obar_ptr,
    lse_ptr,
    partial_ptr,
    query_ptr,
    norm_weight_ptr,
    grad_out_ptr,
    grad_obar_ptr,
    grad_lse_ptr,
    grad_partial_ptr,
    query_coef_ptr,
    grad_weight_rows_ptr,
    num_tokens,
    hidden,
    tokens_per_program,
    eps,
    norm_eps,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    program = tl.program_id(0)
    cols = tl.arange(0, BLOCK_D)
    grad_weight_row = grad_weight_rows_ptr + program.to(tl.int64) * hidden
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + cols
        tl.store(grad_weight_row + d, tl.zeros([BLOCK_D], tl.float32), mask=d < hidden)

    start = program * tokens_per_program
    for t0 in range(start, tl.minimum(start + tokens_per_program, num_tokens), BLOCK_T):
        tokens = t0 + tl.arange(0, BLOCK_T)
        t_mask = tokens < num_tokens
        rows = tokens.to(tl.int64)[:, None] * hidden

        raw, inv_rms = _partial_logit(partial_ptr, query_ptr, rows, t_mask, hidden, eps, BLOCK_T, BLOCK_D)
        lse = tl.load(lse_ptr + tokens, mask=t_mask, other=0.0)
        gate = tl.sigmoid(raw * inv_rms - lse)

        # The four row sums of the merge and norm backward (module docstring).
        h_h = tl.zeros([BLOCK_T], tl.float32)
        h_dn = tl.zeros([BLOCK_T], tl.float32)
        dn_diff = tl.zeros([BLOCK_T], tl.float32)
        h_diff = tl.zeros([BLOCK_T], tl.float32)
        for d0 in range(0, hidden, BLOCK_D):
            d = d0 + cols
            d_mask = d < hidden
            mask = t_mask[:, None] & d_mask[None, :]
            h, x, ob = _merged(obar_ptr, partial_ptr, rows + d[None, :], mask, gate[:, None])
            gy = tl.load(grad_out_ptr + rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
            gain = tl.load(norm_weight_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
            dn = gy * gain[None, :]
            h_h += tl.sum(h * h, axis=1)
            h_dn += tl.sum(h * dn, axis=1)
            dn_diff += tl.sum(dn * (x - ob), axis=1)
            h_diff += tl.sum(h * (x - ob), axis=1)

        norm_inv_rms = tl.rsqrt(h_h / hidden + norm_eps)
        norm_coef = norm_inv_rms * norm_inv_rms * norm_inv_rms * h_dn / hidden
        grad_gate = norm_inv_rms * dn_diff - norm_coef * h_diff
        grad_logit = grad_gate * gate * (1.0 - gate)
        tl.store(grad_lse_ptr + tokens, -grad_logit, mask=t_mask)
        coef = grad_logit * inv_rms
        tl.store(query_coef_ptr + tokens, coef, mask=t_mask)
        partial_norm_coef = (grad_logit * raw * inv_rms * inv_rms * inv_rms / hidden)[:, None]
        norm_inv_rms = norm_inv_rms[:, None]
        norm_coef = norm_coef[:, None]
        gate = gate[:, None]
        coef = coef[:, None]

        # The elementwise gradients, and this tile's share of the gain's gradient.
        for d0 in range(0, hidden, BLOCK_D):
            d = d0 + cols
            d_mask = d < hidden
            mask = t_mask[:, None] & d_mask[None, :]
            h, x, ob = _merged(obar_ptr, partial_ptr, rows + d[None, :], mask, gate)
            gy = tl.load(grad_out_ptr + rows + d[None, :], mask=mask, other=0.0).to(tl.float32)
            gain = tl.load(norm_weight_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
            w = tl.load(query_ptr + d, mask=d_mask, other=0.0).to(tl.float32)
            grad_h = norm_inv_rms * gy * gain[None, :] - norm_coef * h
            tl.store(grad_obar_ptr + rows + d[None, :], (1.0 - gate) * grad_h, mask=mask)
            grad_x = gate * grad_h + coef * w[None, :] - partial_norm_coef * x
            tl.store(grad_partial_ptr + rows + d[None, :], grad_x.to(grad_partial_ptr.dtype.element_ty), mask=mask)
            share = tl.load(grad_weight_row + d, mask=d_mask, other=0.0) + tl.sum(gy * h * norm_inv_rms, axis=0)
            tl.store(grad_weight_row + d, share, mask=d_mask)


def _tiles(hidden: int) -> dict[str, int]:
    return {"BLOCK_T": _BLOCK_T, "BLOCK_D": hidden_block(hidden, _BLOCK_T)}


def _output_dtype(partial: torch.Tensor, norm_weight: torch.Tensor) -> torch.dtype:
    """The dtype of `norm_weight * normed` in Llama's RMSNorm, `normed` having the partial's dtype."""
    return torch.promote_types(partial.dtype, norm_weight.dtype)


@torch.library.custom_op("attnres::phase2_rms_norm", mutates_args=())
def phase2_rms_norm(
    obar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    eps: float,
    norm_weight: torch.Tensor,
    norm_eps: float,
    gain_offset: float = 0.0,
) -> torch.Tensor:
    """Triton `attnres.two_phase.phase2_rms_norm`: the normalised sublayer input `[*tokens, D]`. The kernel reads the
    gain itself, `norm_weight + gain_offset`."""
    hidden = partial.shape[-1]
    torch._check(obar.shape == partial.shape, lambda: "obar and partial must have the same shape")
    torch._check(lse.shape == partial.shape[:-1], lambda: "lse must be partial.shape[:-1]")
    torch._check(tuple(query.shape) == (hidden,), lambda: "query must be [partial.shape[-1]]")
    torch._check(tuple(norm_weight.shape) == (hidden,), lambda: "norm_weight must be [partial.shape[-1]]")
    num_tokens = lse.numel()
    out = torch.empty_like(partial, dtype=_output_dtype(partial, norm_weight), memory_format=torch.contiguous_format)
    with device_guard(partial):
        _phase2_rms_norm_forward_kernel[(triton.cdiv(num_tokens, _BLOCK_T),)](
            obar.float().contiguous(),
            lse.float().contiguous(),
            partial.contiguous(),
            query.contiguous(),
            norm_gain(norm_weight, gain_offset).contiguous(),
            out,
            num_tokens,
            hidden,
            eps,
            norm_eps,
            **_tiles(hidden),
        )
    return out


@phase2_rms_norm.register_fake
def _(obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset=0.0):
    return torch.empty_like(partial, dtype=_output_dtype(partial, norm_weight), memory_format=torch.contiguous_format)


@torch.library.custom_op("attnres::phase2_rms_norm_backward", mutates_args=())
def phase2_rms_norm_backward(
    obar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    norm_weight: torch.Tensor,
    grad_out: torch.Tensor,
    eps: float,
    norm_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of `phase2_rms_norm` w.r.t. `(obar, lse, partial, query, norm_weight)`, each in its input's dtype."""
    hidden = partial.shape[-1]
    num_tokens = lse.numel()
    partial = partial.contiguous()
    grad_obar = torch.empty_like(obar, dtype=torch.float32, memory_format=torch.contiguous_format)
    grad_lse = torch.empty_like(lse, dtype=torch.float32, memory_format=torch.contiguous_format)
    grad_partial = torch.empty_like(partial)
    query_coef = partial.new_empty((1, num_tokens), dtype=torch.float32)
    tiles = _tiles(hidden)
    programs = min(triton.cdiv(num_tokens, tiles["BLOCK_T"]), _BACKWARD_SPLITS)
    tokens_per_program = triton.cdiv(triton.cdiv(num_tokens, programs), tiles["BLOCK_T"]) * tiles["BLOCK_T"]
    programs = triton.cdiv(num_tokens, tokens_per_program)
    grad_weight_rows = partial.new_empty((programs, hidden), dtype=torch.float32)
    with device_guard(partial):
        _phase2_rms_norm_backward_kernel[(programs,)](
            obar.float().contiguous(),
            lse.float().contiguous(),
            partial,
            query.contiguous(),
            norm_weight.contiguous(),
            grad_out.contiguous(),
            grad_obar,
            grad_lse,
            grad_partial,
            query_coef,
            grad_weight_rows,
            num_tokens,
            hidden,
            tokens_per_program,
            eps,
            norm_eps,
            **tiles,
        )
    grad_query = weighted_row_sum(query_coef, partial.view(num_tokens, hidden))[0]
    grad_weight = grad_weight_rows.sum(0)
    return (
        grad_obar.to(obar.dtype),
        grad_lse.to(lse.dtype),
        grad_partial,
        grad_query.to(query.dtype),
        grad_weight.to(norm_weight.dtype),
    )


@phase2_rms_norm_backward.register_fake
def _(obar, lse, partial, query, norm_weight, grad_out, eps, norm_eps):
    return (
        torch.empty_like(obar, memory_format=torch.contiguous_format),
        torch.empty_like(lse, memory_format=torch.contiguous_format),
        torch.empty_like(partial, memory_format=torch.contiguous_format),
        torch.empty_like(query, memory_format=torch.contiguous_format),
        torch.empty_like(norm_weight, memory_format=torch.contiguous_format),
    )


def _setup_context(ctx, inputs: tuple, output: torch.Tensor) -> None:
    obar, lse, partial, query, eps, norm_weight, norm_eps, gain_offset = inputs
    # The backward pass reads the gain; its gradient is the weight's.
    ctx.save_for_backward(obar, lse, partial, query, norm_gain(norm_weight, gain_offset))
    ctx.eps, ctx.norm_eps = eps, norm_eps


def _backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    grad_obar, grad_lse, grad_partial, grad_query, grad_weight = phase2_rms_norm_backward(
        *ctx.saved_tensors, grad_out, ctx.eps, ctx.norm_eps
    )
    return grad_obar, grad_lse, grad_partial, grad_query, None, grad_weight, None, None


phase2_rms_norm.register_autograd(_backward, setup_context=_setup_context)
