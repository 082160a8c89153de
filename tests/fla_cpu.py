"""FLA 0.6.0's model on a CPU, for the tests that run it (tests/test_fla.py): FLA's AttnRes Transformer needs
flash-attn and its Triton kernels, which do not run here, so `install()` puts torch stand-ins where FLA's modules look
them up. FLA's own torch references serve where it has them (`naive_attnres`, `rotary_embedding_ref`,
`rms_norm_ref`); attention is SDPA with flash-attn's masking; SwiGLU and the loss are plain torch.

In the test process only: nothing is patched on disk, and `import fla.models` needs Triton importable (never run).
"""

import sys

import torch
import torch.nn.functional as F


def _attention(q, k, v, causal: bool, window_size, softmax_scale):
    """flash-attn's semantics on `[B, T, H, D]`: the causal mask aligned bottom-right, a `(left, right)` window
    (-1: unbounded), grouped-query heads shared by consecutive query heads."""
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads != heads:
        k, v = (x.repeat_interleave(heads // kv_heads, dim=2) for x in (k, v))
    q_len, k_len = q.shape[1], k.shape[1]
    i = torch.arange(q_len)[:, None] + (k_len - q_len)
    j = torch.arange(k_len)[None, :]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool)
    left, right = window_size
    if causal:
        allowed &= j <= i
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    out = F.scaled_dot_product_attention(
        *(x.transpose(1, 2) for x in (q, k, v)), attn_mask=allowed, scale=softmax_scale
    )
    return out.transpose(1, 2)


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), **kwargs):
    return _attention(q, k, v, causal, tuple(window_size), softmax_scale)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q=None,
    max_seqlen_k=None,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    **kwargs,
):
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        if q1 > q0:
            out[q0:q1] = _attention(
                q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, tuple(window_size), softmax_scale
            )[0]
    return out


def rotary_embedding(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, **kwargs):
    """FLA's `rotary_embedding` on `[B, T, H, D]` through its reference, for the unpacked inputs the tests give."""
    from fla.modules.rotary import ops

    if cu_seqlens is not None:
        raise NotImplementedError("packed sequences: not needed by the tests")
    positions = torch.arange(x.shape[1])[None] + (
        seqlen_offsets.long()[:, None] if isinstance(seqlen_offsets, torch.Tensor) else int(seqlen_offsets)
    )
    positions = positions.expand(x.shape[0], -1)
    out = ops.rotary_embedding_ref(x, cos[positions], sin[positions], interleaved=interleaved)
    return x.copy_(out) if inplace else out


def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    from fla.modules.norm import layernorm

    out, res = layernorm.rms_norm_ref(x, weight, bias, residual=residual, eps=eps, prenorm=True, upcast=True)
    if residual_in_fp32:
        res = res.float()
    return (out, res) if prenorm else out


def swiglu(x, y):
    return F.silu(x.float()).to(x.dtype) * y


def swiglu_linear(x, y, weight, bias):
    return F.linear(swiglu(x, y), weight, bias)


class CrossEntropyLoss(torch.nn.CrossEntropyLoss):
    """FLA's `FusedCrossEntropyLoss` arguments, torch's loss."""

    def __init__(self, ignore_index=-100, reduction="mean", label_smoothing=0.0, inplace_backward=False, **kwargs):
        super().__init__(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)


def install() -> None:
    """Put the stand-ins where FLA's modules look them up; before any FLA model is built (its attention refuses to
    be built without `flash_attn_func`)."""
    import fla.layers.attn
    import fla.models  # registers FLA's configs and models with the Auto classes
    import fla.models.modeling_utils
    import fla.modules.mlp
    import fla.modules.norm.layernorm
    import fla.modules.rotary.ops
    from fla.ops.attnres.naive import naive_attnres

    fla.layers.attn.flash_attn_func = flash_attn_func
    fla.layers.attn.flash_attn_varlen_func = flash_attn_varlen_func
    fla.modules.rotary.ops.rotary_embedding = rotary_embedding
    fla.modules.norm.layernorm.rms_norm = rms_norm
    fla.modules.mlp.swiglu = swiglu
    fla.modules.mlp.swiglu_linear = swiglu_linear
    fla.models.modeling_utils.FusedCrossEntropyLoss = CrossEntropyLoss
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.models") and getattr(module, "fused_attnres", None) is not None:
            module.fused_attnres = naive_attnres
