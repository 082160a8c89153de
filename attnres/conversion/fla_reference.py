"""FLA's AttnRes Transformer on torch alone, for the verification of FLA conversions and exports.

FLA's model computes with flash-attn and its own Triton kernels, which need a GPU (its attention refuses even to be
built without flash-attn), while verification runs both models on the CPU. So while `fla_on_torch()` is active, the
functions FLA's modules call are torch references: FLA's own where it has them (`naive_attnres`,
`rotary_embedding_ref`, `rms_norm_ref`), attention through SDPA with flash-attn's masking, and SwiGLU in plain torch.
FLA's model code (its layers, norms, residual order, generation) runs as written. On exit every function is put back.
"""

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import ModuleType

import torch
import torch.nn.functional as F


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    window_size: tuple[int, int],
    softmax_scale: float | None,
) -> torch.Tensor:
    """flash-attn's semantics on `[B, T, H, D]`: the causal mask aligned bottom-right, a `(left, right)` window
    (-1: unbounded), grouped-query heads shared by consecutive query heads."""
    heads, kv_heads = q.shape[2], k.shape[2]
    if kv_heads != heads:
        k, v = (x.repeat_interleave(heads // kv_heads, dim=2) for x in (k, v))
    q_len, k_len = q.shape[1], k.shape[1]
    i = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
    j = torch.arange(k_len, device=q.device)[None, :]
    allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=q.device)
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
    """flash-attn's packed form: the sequences lie one after another, bounded by the cumulative lengths."""
    out = torch.empty_like(q)
    bounds_q, bounds_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for (q0, q1), (k0, k1) in zip(zip(bounds_q, bounds_q[1:]), zip(bounds_k, bounds_k[1:])):
        if q1 > q0:
            out[q0:q1] = _attention(
                q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, tuple(window_size), softmax_scale
            )[0]
    return out


def rotary_embedding(x, cos, sin, interleaved=False, inplace=False, seqlen_offsets=0, cu_seqlens=None, **kwargs):
    """FLA's `rotary_embedding` on `[B, T, H, D]` through FLA's reference; verification never packs sequences."""
    from fla.modules.rotary import ops

    if cu_seqlens is not None:
        raise NotImplementedError("packed sequences have no torch reference here")
    offsets = seqlen_offsets.long()[:, None] if isinstance(seqlen_offsets, torch.Tensor) else int(seqlen_offsets)
    positions = (torch.arange(x.shape[1], device=x.device)[None] + offsets).expand(x.shape[0], -1)
    out = ops.rotary_embedding_ref(x, cos[positions], sin[positions], interleaved=interleaved)
    return x.copy_(out) if inplace else out


def rms_norm(x, weight, bias, residual=None, eps=1e-5, prenorm=False, residual_in_fp32=False):
    """FLA's fused RMSNorm through FLA's reference."""
    from fla.modules.norm import layernorm

    out, res = layernorm.rms_norm_ref(x, weight, bias, residual=residual, eps=eps, prenorm=True, upcast=True)
    if residual_in_fp32:
        res = res.float()
    return (out, res) if prenorm else out


def swiglu(x, y):
    return F.silu(x.float()).to(x.dtype) * y


def swiglu_linear(x, y, weight, bias):
    return F.linear(swiglu(x, y), weight, bias)


# The names FLA's attention module binds only when flash-attn imports; elsewhere they are None or absent.
_FLASH_ATTN_NAMES = ("flash_attn_func", "flash_attn_varlen_func")
_ABSENT = object()


def _replacements() -> list[tuple[ModuleType, str, Callable]]:
    """(module, name, torch reference) for every function FLA's Transformer looks up in a module when it runs."""
    import fla.layers.attn
    import fla.models  # imports every model module, those that hold `fused_attnres` included
    import fla.modules.mlp
    import fla.modules.norm.layernorm
    import fla.modules.rotary.ops
    from fla.ops.attnres.naive import naive_attnres

    replacements = [
        (fla.layers.attn, "flash_attn_func", flash_attn_func),
        (fla.layers.attn, "flash_attn_varlen_func", flash_attn_varlen_func),
        (fla.modules.rotary.ops, "rotary_embedding", rotary_embedding),
        (fla.modules.norm.layernorm, "rms_norm", rms_norm),
        (fla.modules.mlp, "swiglu", swiglu),
        (fla.modules.mlp, "swiglu_linear", swiglu_linear),
    ]
    for name, module in list(sys.modules.items()):
        if name.startswith("fla.models") and getattr(module, "fused_attnres", None) is not None:
            replacements.append((module, "fused_attnres", naive_attnres))
    return replacements


def fla_torch_problem() -> str | None:
    """Why FLA's model cannot run on the torch references here, or None when it can: the references replace FLA
    0.6's functions by name, so a version that moved one is not run half on kernels that cannot run."""
    try:
        replacements = _replacements()
    except ImportError as error:
        return f"FLA's modules are not where its torch references go ({error})"
    missing = [
        f"{module.__name__}.{name}"
        for module, name, _ in replacements
        if name not in _FLASH_ATTN_NAMES and not hasattr(module, name)
    ]
    if missing or not any(name == "fused_attnres" for _, name, _ in replacements):
        import fla

        where = ", ".join(missing) or "fused_attnres"
        return f"FLA {getattr(fla, '__version__', '')} has no {where}, where its torch references go"
    return None


@contextmanager
def fla_on_torch() -> Iterator[None]:
    """Within this block FLA's Transformer runs on torch alone (the module docstring); nests, and restores on exit."""
    replacements = _replacements()
    originals = [(module, name, getattr(module, name, _ABSENT)) for module, name, _ in replacements]
    try:
        for module, name, reference in replacements:
            setattr(module, name, reference)
        yield
    finally:
        for module, name, original in originals:
            if original is _ABSENT:
                delattr(module, name)
            else:
                setattr(module, name, original)
