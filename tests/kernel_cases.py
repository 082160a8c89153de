"""Inputs and tolerances shared by the tests of the Triton kernels (`test_kernels.py`) and of the fused CPU kernels
(`test_cpu_kernels.py`), which are both checked against the PyTorch reference (`attnres.two_phase`).

Tolerances: the expected values are the reference evaluated in fp32 on the same input values (bf16 and fp16 inputs
convert to fp32 exactly). fp32 results agree to 1e-5 of the tensor's largest magnitude: the kernels and torch only sum
in different orders, and sums such as a query gradient over every token cancel, so the error scales with the terms,
not the result. Results stored in bf16 / fp16 are such an fp32 value rounded once, which moves it by at most half a
unit in the last place, so those get `rtol = finfo(dtype).eps` (one unit) on top. The reference run in bf16 itself is
not the yardstick: it rounds more often (the partial sum's gradient reaches it along two paths, each cast to bf16
before they are added).

Phase 1's input gradients all go through `ds = p (go . b - delta + gl)`, a difference of dot products over the hidden
size that cancel (`delta = go . obar` is close to `go . b` for the block the softmax favours), so their error scales
with those dot products, not with the gradient: their tolerance is 1e-5 of the largest such term carried into each
gradient (`phase1_gradient_scales`). Measured against fp64, the kernels and the fp32 reference both stay within 1e-6
of it, where 1e-5 of the gradient's own largest value was exceeded by both at hidden size 1100.
"""

import functools

import torch

from attnres.kernel_dispatch import depth_kernels
from attnres.kernels.reference import inverse_rms


FP32_TOL = 1e-5
EPS = 1e-6
NORM_EPS = 1e-5

# (num_blocks N, num_queries Q, token layout, hidden D). Hidden sizes are not powers of two, so every load is masked;
# N=1 is the first block (the embedding alone), (1,) and () are one token (decode, and no token axes at all),
# N=5 x Q=6 makes the hidden size span two chunks in phase 1, D=1100 spans two chunks in phase 2.
PHASE1_SHAPES = [(3, 2, (2, 3), 48), (1, 1, (1,), 100), (4, 3, (), 20), (5, 6, (1, 3), 100), (2, 1, (3,), 1100)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, scale: float = 0.0) -> None:
    """`actual` is `expected` (fp32) up to summation order, plus one rounding if stored in bf16 / fp16; `scale`: the
    largest term that cancels in it, where that exceeds its largest value (docstring)."""
    assert actual.shape == expected.shape
    rtol = FP32_TOL if actual.dtype == torch.float32 else torch.finfo(actual.dtype).eps
    atol = FP32_TOL * max(1.0, expected.float().abs().max().item() if expected.numel() else 0.0, scale)
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


def run_with_grads(fn, inputs: tuple[torch.Tensor, ...], grad_outputs: tuple[torch.Tensor, ...], *args):
    """`fn(*inputs, *args)` and the gradients of `sum(output * grad_output)` w.r.t. every input."""
    leaves = tuple(x.detach().requires_grad_() for x in inputs)
    outputs = fn(*leaves, *args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, grad_outputs)
    return outputs, tuple(x.grad for x in leaves)


def phase1_inputs(num_blocks: int, num_queries: int, tokens: tuple[int, ...], hidden: int, dtype: torch.dtype):
    blocks = (3 * torch.randn(num_blocks, *tokens, hidden)).to(dtype)
    return blocks, inverse_rms(blocks, EPS), torch.randn(num_queries, hidden)


def phase1_gradient_scales(
    blocks: torch.Tensor, blocks_inv_rms: torch.Tensor, queries: torch.Tensor, grad_obar: torch.Tensor
) -> tuple[float, float, float]:
    """The largest term `p_qn |go_q . b_n|` of `ds` as it is carried into the gradients of phase 1's inputs
    `(blocks, blocks_inv_rms, queries)`: times `inv_rms_n |w_q|`, times `|w_q . b_n|`, and times `inv_rms_n |b_n|`
    summed over tokens and blocks (docstring). In fp64."""
    blocks, inv_rms, queries, grad_obar = (x.double() for x in (blocks, blocks_inv_rms, queries, grad_obar))
    raw = (blocks @ queries.T).movedim(-1, 0)  # [Q, N, *tokens]: w_q . b_n
    weights = torch.softmax(raw * inv_rms, dim=1)
    terms = weights * torch.einsum("q...d,n...d->qn...", grad_obar, blocks).abs()
    to_blocks = torch.einsum("qn...,qd->n...d", terms * inv_rms, queries.abs())
    to_inv_rms = (terms * raw.abs()).sum(0)
    to_queries = torch.einsum("qn...,n...d->qd", terms * inv_rms, blocks.abs())
    return tuple(scale.max().item() if scale.numel() else 0.0 for scale in (to_blocks, to_inv_rms, to_queries))


def phase2_inputs(tokens: tuple[int, ...], hidden: int, dtype: torch.dtype):
    """`(obar, lse, partial, query, norm_weight)`: phase 2's inputs and the gain of the pre-norm it is fused with."""
    obar, lse = torch.randn(*tokens, hidden), 2 * torch.randn(tokens)
    norm_weight = (1 + 0.5 * torch.randn(hidden)).to(dtype)
    return obar, lse, (3 * torch.randn(*tokens, hidden)).to(dtype), torch.randn(hidden), norm_weight


def fused_phase2(op):
    """`op` (`phase2_rms_norm`) with the gain among the differentiated inputs and the scalars fixed."""
    return lambda obar, lse, partial, query, norm_weight: op(obar, lse, partial, query, EPS, norm_weight, NORM_EPS)


def logits_and_grads(model, ids: torch.Tensor, kernel: str, monkeypatch) -> tuple[torch.Tensor, dict]:
    """`model`'s logits for `ids` and every parameter's gradient of their mean square, computed with
    `ATTNRES_DEPTH_KERNEL=kernel`: a model on one implementation against the same model on another."""
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", kernel)
    model.zero_grad()
    logits = model(ids).logits
    logits.square().mean().backward()
    return logits.detach(), {name: p.grad for name, p in model.named_parameters()}


def depth_operations(device: str, autocast: torch.dtype | None = None):
    """Every operation of the two phases (`DepthKernels`, as the setting chooses them for `device`), run once on an
    fp32 stream of three blocks and a partial sum, optionally under autocast: `(outputs, gradients of their squares'
    sum w.r.t. every input)`, for the test that autocast changes no bit of them."""
    generator = torch.Generator().manual_seed(0)
    draw = functools.partial(torch.randn, generator=generator, device="cpu")  # the same values on any device
    leaves = [3 * draw(2, 5, 48) for _ in range(4)]  # three blocks and the partial sum
    leaves += [draw(2, 48), 1 + 0.5 * draw(48)]
    inputs = [x.to(device).requires_grad_() for x in leaves]
    *blocks, partial, queries, norm_weight = inputs
    with torch.autocast(device, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        kernels = depth_kernels(torch.device(device))
        blocks_inv_rms = partial.new_empty((0, 2, 5))
        for block in blocks[:-1]:
            blocks_inv_rms = kernels.append_inverse_rms(blocks_inv_rms, block, EPS)
        blocks_inv_rms, rows, lse = kernels.close_block(blocks, blocks_inv_rms, queries.unbind(0), EPS)
        first = kernels.phase1_rms_norm(rows[0], partial.dtype, norm_weight, NORM_EPS)
        merged = kernels.phase2_rms_norm(rows[1], lse[1], partial, queries[1], EPS, norm_weight, NORM_EPS)
        unfused = kernels.phase2(rows[1], lse[1], partial, queries[1], EPS)
    outputs = (first, merged, unfused)
    assert all(output.dtype == torch.float32 for output in outputs)
    sum(output.square().sum() for output in outputs).backward()
    return outputs, [x.grad for x in inputs]
