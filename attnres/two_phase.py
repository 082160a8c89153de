"""PyTorch reference for depth attention: the naive form (docs/design.md §3) and the two-phase form (§6).

Shapes: a stack of depth sources or completed blocks is `[N, *tokens, D]`; `*tokens` is any token layout
(`[batch, seq]` in the model). All logits, softmax statistics and merges are computed in fp32 whatever the input
dtype, because depth logits are dot products over the whole hidden size and bf16 would round them coarsely.

The model computes the two-phase form (docs/design.md §6): `phase1` once per block for all of its pseudo-queries, and
`phase2` per sublayer, fused with the RMSNorm that reads its result (`phase2_rms_norm`; `phase1_rms_norm` for a
block's first sublayer, which has no partial sum to merge). Its implementations are the
Triton kernels (CUDA) and the fused C++ kernels (CPU) in `attnres.kernels` and, elsewhere, `two_phase_torch`
(PyTorch ops with hand-written backward); all have these functions' signatures and are tested against them.
"""

import torch


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """`x.float()` without the dispatch when `x` already is fp32: the model's PyTorch path runs these ops 2L + 1
    times per decoded token, and a no-op `.float()` still costs a dispatch of about a microsecond."""
    return x if x.dtype == torch.float32 else x.float()


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`x.to(dtype)` without the dispatch when `x` already has that dtype (see `as_float32`)."""
    return x if x.dtype == dtype else x.to(dtype)


def inverse_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """`rsqrt(mean(x**2) + eps)` over the last dimension, in fp32: the scale RMSNorm applies to `x`."""
    x = as_float32(x)
    # A dot product and in-place scalar steps: half the dispatch cost of pow + mean on decode-sized tensors.
    return torch.linalg.vecdot(x, x).div_(x.shape[-1]).add_(eps).rsqrt_()


def naive_depth_attention(
    sources: torch.Tensor, pseudo_query: torch.Tensor, key_norm_weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """docs/design.md §3 literally: `h = sum_i softmax_i(w . RMSNorm(v_i)) v_i` over the stacked `sources`
    `[K, *tokens, D]`.

    Returns `h` (in the dtype of `sources`) and the depth-attention weights `[*tokens, K]` (fp32). Slow and simple:
    it is the test reference for the two-phase form and the analysis path for depth-attention maps.
    """
    values = sources.float()
    keys = key_norm_weight.float() * values * inverse_rms(sources, eps).unsqueeze(-1)
    logits = keys @ pseudo_query.float()
    weights = torch.softmax(logits, dim=0)
    hidden = (weights.unsqueeze(-1) * values).sum(0)
    return hidden.to(sources.dtype), weights.movedim(0, -1)


def phase1(
    blocks: torch.Tensor, blocks_inv_rms: torch.Tensor, queries: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 1 (docs/design.md §6): attention of `Q` queries over the completed blocks, without the partial sum.

    Args:
        blocks: completed block representations `[N, *tokens, D]` (b_0 = embedding first).
        blocks_inv_rms: `inverse_rms(blocks)` `[N, *tokens]`, fp32, computed once when each block completed.
        queries: `[Q, D]` fp32 pseudo-queries with their key-norm gains folded in (`w * gamma`), which is exact
            because `w . (gamma * k) == (w * gamma) . k`; it lets every query share the same normalised keys.

    Returns:
        `obar` `[Q, *tokens, D]` fp32, the softmax-normalised mix of the blocks for each query, and
        `lse` `[Q, *tokens]` fp32, the log-sum-exp of each query's logits (the merge statistic for phase 2).
    """
    values = blocks.float()
    logits = (values @ queries.T).movedim(-1, 0) * blocks_inv_rms  # [Q, N, *tokens]: one pass over the blocks
    lse = torch.logsumexp(logits, dim=1)
    weights = torch.exp(logits - lse.unsqueeze(1)).unsqueeze(-1)
    # A short accumulation over the N blocks: einsum would batch this contraction over tokens as tiny matmuls,
    # which is several times slower on CPU than N fused multiply-adds over whole blocks.
    obar = weights[:, 0] * values[0]
    for n in range(1, blocks.shape[0]):
        obar.addcmul_(weights[:, n], values[n])
    return obar, lse


def phase2(
    obar: torch.Tensor,
    lse: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    eps: float,
    scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Phase 2 (docs/design.md §6): merge the running partial sum `P` of the current block into phase 1's result.

    With the partial's logit `s = w . RMSNorm(P)`, the softmax over [blocks..., P] equals the exact online-softmax
    merge `obar + sigmoid(s - lse) * (P - obar)`: the partial's weight is `e^s / (e^lse + e^s) = sigmoid(s - lse)`
    and the blocks keep the rest in their phase-1 proportions.

    Args:
        obar: `[*tokens, D]` fp32, phase 1's output for this query; lse: `[*tokens]` fp32.
        partial: `[*tokens, D]` the running sum of the current block, in the model dtype.
        query: `[D]` fp32 pseudo-query with the key-norm gain folded in.
        scale: the step's output scale k (a 0-d fp32 tensor, docs/design.md §5), or `None` for 1.

    Returns the sublayer input `k * h` in the dtype of `partial`.
    """
    values = partial.float()
    gate = torch.sigmoid((values @ query) * inverse_rms(values, eps) - lse).unsqueeze(-1)
    hidden = torch.lerp(obar, values, gate)
    return (hidden if scale is None else hidden * scale).to(partial.dtype)


def block_input(obar: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The input `k * h` of a block's first sublayer, which has no partial sum to merge: phase 1's row `obar` (fp32),
    times the step's output scale (`None` for 1), in the model `dtype`."""
    return cast(obar if scale is None else obar * scale, dtype)


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm, the pre-norm in front of every sublayer: normalised in fp32, rounded to the input dtype, then
    scaled by the gain (so the output has the promoted dtype of the two)."""
    normed = hidden.float() * torch.rsqrt(hidden.float().pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(hidden.dtype)


def norm_gain(norm_weight: torch.Tensor, gain_offset: float) -> torch.Tensor:
    """The gain `norm_weight + gain_offset` of a norm whose weight is stored relative to an offset (Gemma's `1 + w`,
    `modeling_attnres.FusableNorm`): the weight itself, without an operation, where the offset is 0."""
    return norm_weight + gain_offset if gain_offset else norm_weight


def phase1_rms_norm(
    obar: torch.Tensor, dtype: torch.dtype, norm_weight: torch.Tensor, norm_eps: float, gain_offset: float = 0.0
) -> torch.Tensor:
    """The input of a block's first sublayer, normalised: with no partial sum yet, phase 1 is the whole softmax, so
    `h` is phase 1's row `obar` (fp32) in the model `dtype`, followed by the sublayer's RMSNorm (`rms_norm`, gain
    `norm_weight + gain_offset`)."""
    return rms_norm(cast(obar, dtype), norm_gain(norm_weight, gain_offset), norm_eps)


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
    """`phase2` followed by the RMSNorm (gain `norm_weight + gain_offset`, eps `norm_eps`) of the sublayer that reads
    its result: what the fused kernels compute, without writing the sublayer input `h` to memory."""
    return rms_norm(phase2(obar, lse, partial, query, eps), norm_gain(norm_weight, gain_offset), norm_eps)
