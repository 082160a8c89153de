"""Inputs and tolerances shared by the tests of the Triton kernels (`test_kernels.py`) and of the fused CPU kernels
(`test_cpu_kernels.py`), which are both checked against the PyTorch reference (`attnres.two_phase`).

Tolerances: the expected values are the reference evaluated in fp32 on the same input values (bf16 and fp16 inputs
convert to fp32 exactly). fp32 results agree to 1e-5 of the tensor's largest magnitude: the kernels and torch only sum
in different orders, and sums such as a query gradient over every token cancel, so the error scales with the terms,
not the result. Results stored in bf16 / fp16 are such an fp32 value rounded once, which moves it by at most half a
unit in the last place, so those get `rtol = finfo(dtype).eps` (one unit) on top. The reference run in bf16 itself is
not the yardstick: it rounds more often (the partial sum's gradient reaches it along two paths, each cast to bf16
before they are added).
"""

import torch

from attnres.kernels.reference import inverse_rms


FP32_TOL = 1e-5
EPS = 1e-6
NORM_EPS = 1e-5

# (num_blocks N, num_queries Q, token layout, hidden D). Hidden sizes are not powers of two, so every load is masked;
# N=1 is the first block (the embedding alone), (1,) and () are one token (decode, and no token axes at all),
# N=5 x Q=6 makes the hidden size span two chunks in phase 1, D=1100 spans two chunks in phase 2.
PHASE1_SHAPES = [(3, 2, (2, 3), 48), (1, 1, (1,), 100), (4, 3, (), 20), (5, 6, (1, 3), 100), (2, 1, (3,), 1100)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """`actual` is `expected` (fp32) up to summation order, plus one rounding if stored in bf16 / fp16 (docstring)."""
    assert actual.shape == expected.shape
    rtol = FP32_TOL if actual.dtype == torch.float32 else torch.finfo(actual.dtype).eps
    atol = FP32_TOL * max(1.0, expected.float().abs().max().item() if expected.numel() else 0.0)
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
