"""The two phases of docs/design.md §6 in plain PyTorch, with hand-written backward passes: what the model runs where
neither the Triton kernels (CUDA) nor the fused C++ kernels (CPU; `attnres.kernels`) do: where they cannot be loaded, in
remote-code checkpoints without the package, and inside `torch.compile` on the CPU. Also the API those kernels
implement.

Same signatures and numerics as the reference (`two_phase.phase1` / `two_phase.phase2_rms_norm`, which these are
tested against), but built for the model's two costs on a CPU:

- memory in training: autograd through the reference would keep a stacked copy of the completed blocks for phase 1
  and, for phase 2, both the merged sublayer input `h` and the norm's intermediates. These functions keep only what
  the model holds anyway (the blocks, the partial sum, phase 1's output) plus per-token scalars, and recompute the
  rest in the backward pass;
- per-op dispatch at decode (one token): under `no_grad` they skip `autograd.Function` (whose own overhead is
  several tensor ops' worth) and run the forward ops directly.

Phase 1 for a block's many queries works on the blocks stacked token-major (`[*tokens, N, D]`, a temporary), so
mixing them for every query is one batched matmul over tokens rather than N passes of multiply-adds over S outputs;
for one or two queries (Full AttnRes, the output step, blocks of two sublayers) it works block by block, as
stacking would copy every block for products too small to pay for it (`BLOCKWISE_MAX_QUERIES`).
"""

from collections.abc import Sequence

import torch

from .two_phase import as_float32, cast, inverse_rms, norm_gain
from .two_phase import phase1_rms_norm as phase1_rms_norm  # the reference's ops are already what the model runs


def differentiating(*tensors: torch.Tensor) -> bool:
    """Whether autograd records an operation on `tensors`: the hand-written backward passes are needed only then."""
    return torch.is_grad_enabled() and any(x.requires_grad for x in tensors)


def _softmax_and_lse(logits: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`softmax(logits, dim)` and `logsumexp(logits, dim)` from one exponential (`torch.logsumexp` followed by an
    `exp` costs about twice the dispatches, which dominate at decode)."""
    peak = logits.amax(dim, keepdim=True)
    exponentials = (logits - peak).exp_()
    total = exponentials.sum(dim, keepdim=True)
    return exponentials.div_(total), (peak + total.log_()).squeeze(dim)


def _stacked_values(blocks: Sequence[torch.Tensor]) -> torch.Tensor:
    """The blocks as one fp32 tensor `[*tokens, N, D]`: token-major, so each token's N x D slab is contiguous."""
    return as_float32(torch.stack(blocks, dim=-2))


def _phase1_forward(
    values: torch.Tensor, blocks_inv_rms: torch.Tensor, queries: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(obar [*tokens, S, D], lse [*tokens, S], weights [*tokens, N, S], raw [*tokens, N, S])` from stacked values."""
    raw = values @ queries.T  # [*tokens, N, S]: w_s . b_n
    weights, lse = _softmax_and_lse(raw * blocks_inv_rms.movedim(0, -1).unsqueeze(-1), dim=-2)
    obar = weights.transpose(-1, -2) @ values  # [*tokens, S, N] @ [*tokens, N, D]
    return obar, lse, weights, raw


class _Phase1(torch.autograd.Function):
    """Phase 1 for a block's S > 1 queries on the blocks stacked token-major (a temporary, rebuilt in backward)."""

    @staticmethod
    def forward(ctx, blocks_inv_rms: torch.Tensor, queries: torch.Tensor, *blocks: torch.Tensor):
        obar, lse, weights, raw = _phase1_forward(_stacked_values(blocks), blocks_inv_rms, queries)
        obar, lse = obar.movedim(-2, 0), lse.movedim(-1, 0)
        ctx.save_for_backward(blocks_inv_rms, queries, obar, weights, raw, *blocks)
        return obar, lse

    @staticmethod
    def backward(ctx, grad_obar: torch.Tensor, grad_lse: torch.Tensor):
        """Per token, with p the weights and `delta_s = go_s . obar_s` (the Triton phase-1 kernel's derivation):
        `ds = p (go . b - delta + gl)`, `d b_n = sum_s p_ns go_s + ds_ns r_n w_s`, `d r_n = sum_s ds_ns (w_s . b_n)`,
        `d w_s = sum_{tokens, n} ds_ns r_n b_n`."""
        blocks_inv_rms, queries, obar, weights, raw, *blocks = ctx.saved_tensors
        values = _stacked_values(blocks)
        go = grad_obar.movedim(0, -2)  # [*tokens, S, D]
        delta = torch.linalg.vecdot(go, obar.movedim(0, -2))  # [*tokens, S]
        grad_weights = values @ go.transpose(-1, -2)  # [*tokens, N, S]: go_s . b_n
        grad_logits = weights * (grad_weights - delta.unsqueeze(-2) + grad_lse.movedim(0, -1).unsqueeze(-2))
        inv_rms = blocks_inv_rms.movedim(0, -1).unsqueeze(-1)  # [*tokens, N, 1]
        query_coef = grad_logits * inv_rms  # [*tokens, N, S]
        grad_values = weights @ go + query_coef @ queries  # [*tokens, N, D]
        grad_inv_rms = (grad_logits * raw).sum(-1).movedim(-1, 0)
        grad_queries = query_coef.reshape(-1, queries.shape[0]).T @ values.reshape(-1, values.shape[-1])
        grad_blocks = (grad.to(block.dtype) for grad, block in zip(grad_values.unbind(-2), blocks, strict=True))
        return grad_inv_rms, grad_queries, *grad_blocks


class _Phase1Blockwise(torch.autograd.Function):
    """Phase 1 for a few queries (Full AttnRes, the output step, small blocks) on the blocks one by one: N fused
    multiply-adds over whole blocks. With few queries, stacking the blocks would copy them all for products over
    tokens too small for a batched matmul to pay off."""

    @staticmethod
    def forward(ctx, blocks_inv_rms: torch.Tensor, queries: torch.Tensor, *blocks: torch.Tensor):
        obar, lse, weights, raw = _blockwise_forward(blocks, blocks_inv_rms, queries)
        ctx.save_for_backward(blocks_inv_rms, queries, obar, weights, raw, *blocks)
        return obar, lse

    @staticmethod
    def backward(ctx, grad_obar: torch.Tensor, grad_lse: torch.Tensor):
        """`_Phase1.backward` block by block, with p and the scores `[N, S, *tokens]`."""
        blocks_inv_rms, queries, obar, weights, raw, *blocks = ctx.saved_tensors
        values = [as_float32(block) for block in blocks]
        query_rows = queries.view(queries.shape[0], *(1,) * (obar.dim() - 2), -1)  # [S, 1, ..., 1, D]
        delta = torch.linalg.vecdot(grad_obar, obar)  # [S, *tokens]
        grad_weights = torch.stack([torch.linalg.vecdot(grad_obar, value) for value in values])  # go_s . b_n
        grad_logits = weights * (grad_weights - delta + grad_lse)
        query_coef = grad_logits * blocks_inv_rms.unsqueeze(1)  # [N, S, *tokens]
        grad_blocks = [
            torch.addcmul(p.unsqueeze(-1) * grad_obar, coef.unsqueeze(-1), query_rows).sum(0).to(block.dtype)
            for p, coef, block in zip(weights, query_coef, blocks, strict=True)
        ]
        num_queries, hidden_size = queries.shape
        grad_queries = sum(
            coef.reshape(num_queries, -1) @ value.reshape(-1, hidden_size)
            for coef, value in zip(query_coef, values, strict=True)
        )
        return (grad_logits * raw).sum(1), grad_queries, *grad_blocks


def _blockwise_forward(
    blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`(obar [S, *tokens, D], lse [S, *tokens], weights [N, S, *tokens], raw [N, S, *tokens])`."""
    values = [as_float32(block) for block in blocks]
    raw = torch.stack([value @ queries.T for value in values]).movedim(-1, 1)
    weights, lse = _softmax_and_lse(raw * blocks_inv_rms.unsqueeze(1), dim=0)
    terms = zip(weights.unsqueeze(-1).unbind(0), values, strict=True)  # unbind: one dispatch, not one per block
    weight, value = next(terms)
    obar = weight * value
    for weight, value in terms:
        obar.addcmul_(weight, value)
    return obar, lse, weights, raw


# Up to this many queries, phase 1 goes block by block (`_Phase1Blockwise`); beyond, over the stacked blocks
# (`_Phase1`), whose batched matmul reads each block once for all S outputs: stacking copies every block, which pays
# off only when enough queries share the copy.
BLOCKWISE_MAX_QUERIES = 2


def phase1(
    blocks: Sequence[torch.Tensor], blocks_inv_rms: torch.Tensor, queries: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`two_phase.phase1` over the completed blocks given as separate tensors (the model never stacks them).

    Returns `obar` `[S, *tokens, D]` and `lse` `[S, *tokens]`, fp32.
    """
    blockwise = queries.shape[0] <= BLOCKWISE_MAX_QUERIES
    if differentiating(blocks_inv_rms, queries, *blocks):
        return (_Phase1Blockwise if blockwise else _Phase1).apply(blocks_inv_rms, queries, *blocks)
    if blockwise:
        return _blockwise_forward(blocks, blocks_inv_rms, queries)[:2]
    obar, lse, _, _ = _phase1_forward(_stacked_values(blocks), blocks_inv_rms, queries)
    return obar.movedim(-2, 0), lse.movedim(-1, 0)


def padded_phase1(
    valid: torch.Tensor, queries: torch.Tensor, eps: float | torch.Tensor, *blocks: torch.Tensor
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """`phase1` over `blocks` of which only the first ones count: `valid` `[M]` (bool, a prefix) says which; the rest
    is padding, whatever it holds. The inverse RMS of the blocks is computed here, from the blocks themselves, with
    `eps` (a float or a 0-d fp32 tensor).

    What torch.compile runs (kernel_dispatch.py): with the blocks padded to their final number M, every block's
    phase 1 has the same shapes and reads no constant of its own, so inductor compiles it once rather than once per
    number of blocks. Differentiated by autograd, not by hand: it runs only inside torch.compile.

    Returns each query's row of `obar` `[*tokens, D]` and of `lse` `[*tokens]`, fp32, each a reduction of its own:
    rows of one stacked result would be views into it, and a region's output that is a view is mistaken by inductor
    for a buffer of its own, which the graph around the region reuses for larger ones (torch 2.13, at one token, where
    a row's view is contiguous and its copy is dropped: out-of-bounds writes).
    """
    values = torch.where(valid.unsqueeze(-1), torch.stack(blocks, dim=-2).float(), 0.0)  # [*tokens, M, D]
    inv_rms = torch.rsqrt(values.pow(2).mean(-1) + eps)  # [*tokens, M]
    # Both contractions as sums of products, not matmuls: inductor fuses them into its own loops, where a library
    # matmul's call costs more than the few multiply-adds of a decoded token (a few blocks, a block's queries).
    raw = (values.unsqueeze(-2) * queries).sum(-1)  # [*tokens, M, S]
    logits = torch.where(valid.unsqueeze(-1), raw * inv_rms.unsqueeze(-1), -torch.inf).unbind(-1)  # S x [*tokens, M]
    lse = tuple(torch.logsumexp(scores, dim=-1) for scores in logits)
    weights = (torch.exp(scores - total.unsqueeze(-1)) for scores, total in zip(logits, lse, strict=True))
    obar = tuple((weight.unsqueeze(-1) * values).sum(-2) for weight in weights)
    return obar, lse


def append_inverse_rms(blocks_inv_rms: torch.Tensor, block: torch.Tensor, eps: float) -> torch.Tensor:
    """`blocks_inv_rms` `[N, *tokens]` with the inverse RMS of the newly completed `block` appended (its keys are
    normalised once, here, and reused by every later query): `[N + 1, *tokens]`."""
    return torch.cat([blocks_inv_rms, inverse_rms(block, eps).unsqueeze(0)])


def _phase2_rms_norm_forward(obar, lse, partial, query, eps, norm_weight, norm_eps):
    """`(y, gate, raw, inv_rms, norm_inv_rms)`: the output and the per-token scalars the backward pass reuses.

    The operations are exactly those of `two_phase.phase2` followed by Llama's RMSNorm (`two_phase.rms_norm`), in
    the same order, so the result is bit-identical to the model computing `h` and then normalising it.
    """
    values = as_float32(partial)
    raw = values @ query
    inv_rms = inverse_rms(values, eps)
    gate = torch.sigmoid(raw * inv_rms - lse)
    hidden = as_float32(cast(torch.lerp(obar, values, gate.unsqueeze(-1)), partial.dtype))
    norm_inv_rms = torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm_eps)
    out = norm_weight * cast(hidden * norm_inv_rms, partial.dtype)
    return out, gate, raw, inv_rms, norm_inv_rms.squeeze(-1)


class _Phase2RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, obar, lse, partial, query, eps, norm_weight, norm_eps):
        out, gate, raw, inv_rms, norm_inv_rms = _phase2_rms_norm_forward(
            obar, lse, partial, query, eps, norm_weight, norm_eps
        )
        ctx.save_for_backward(obar, partial, query, norm_weight, gate, raw, inv_rms, norm_inv_rms)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        """The Triton phase-2 kernel's derivation (`attnres/kernels/phase2.py`), with `h` recomputed as the forward
        pass rounded it; the roundings to the partial's dtype (no-ops in fp32) are treated as the identity."""
        obar, partial, query, norm_weight, gate, raw, inv_rms, norm_inv_rms = ctx.saved_tensors
        hidden_size = partial.shape[-1]
        values = as_float32(partial)
        hidden = as_float32(torch.lerp(obar, values, gate.unsqueeze(-1)).to(partial.dtype))
        normed = hidden * norm_inv_rms.unsqueeze(-1)
        grad_out = as_float32(grad_out)
        grad_weight = (grad_out * normed.to(partial.dtype)).reshape(-1, hidden_size).sum(0)
        grad_normed = grad_out * as_float32(norm_weight)
        norm_coef = norm_inv_rms.pow(3) * torch.linalg.vecdot(hidden, grad_normed) / hidden_size
        grad_hidden = grad_normed * norm_inv_rms.unsqueeze(-1) - norm_coef.unsqueeze(-1) * hidden
        grad_logit = torch.linalg.vecdot(grad_hidden, values - obar) * gate * (1 - gate)
        query_coef = grad_logit * inv_rms
        grad_obar = grad_hidden * (1 - gate).unsqueeze(-1)
        grad_values = (
            grad_hidden * gate.unsqueeze(-1)
            + query_coef.unsqueeze(-1) * query
            - (grad_logit * raw * inv_rms.pow(3) / hidden_size).unsqueeze(-1) * values
        )
        grad_query = query_coef.reshape(-1) @ values.reshape(-1, hidden_size)
        return (
            grad_obar,
            -grad_logit,
            grad_values.to(partial.dtype),
            grad_query,
            None,
            grad_weight.to(norm_weight.dtype),
            None,
        )


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
    """`two_phase.phase2_rms_norm`: phase 2 fused with the RMSNorm of the sublayer that reads its result."""
    norm_weight = norm_gain(norm_weight, gain_offset)
    if differentiating(obar, lse, partial, query, norm_weight):
        return _Phase2RMSNorm.apply(obar, lse, partial, query, eps, norm_weight, norm_eps)
    return _phase2_rms_norm_forward(obar, lse, partial, query, eps, norm_weight, norm_eps)[0]
