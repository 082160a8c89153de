"""The fused CPU kernels (`attnres.kernels.cpu`, C++) against the PyTorch reference (`attnres.two_phase`), and the
model on them against the model on `two_phase_torch`.

The kernels are built on first use (about a minute, once per machine); `ATTNRES_DEPTH_KERNEL=cpu` below makes a
failed build an error instead of the model's silent fallback. Tolerances: `kernel_cases.py`.
"""

import pytest
import torch

from attnres import AttnResForCausalLM, two_phase_torch
from attnres.kernels import cpu
from attnres.kernels.reference import inverse_rms
from attnres.kernels.reference import phase1 as reference_phase1
from attnres.kernels.reference import phase1_rms_norm as reference_phase1_rms_norm
from attnres.kernels.reference import phase2 as reference_phase2
from attnres.kernels.reference import phase2_rms_norm as reference_phase2_rms_norm

from conftest import randomize_depth_parameters, tiny_config
from kernel_cases import (
    DTYPES,
    EPS,
    NORM_EPS,
    PHASE1_SHAPES,
    assert_matches,
    fused_phase2,
    logits_and_grads,
    phase1_gradient_scales,
    phase1_inputs,
    phase2_inputs,
    run_with_grads,
)


# 70 tokens span several of the kernels' 16-token tasks, so sums over tokens (the query and gain gradients) add the
# shares of more than one chunk.
CPU_PHASE1_SHAPES = [*PHASE1_SHAPES, (3, 2, (70,), 36)]


@pytest.fixture(scope="module", autouse=True)
def built_extension():
    assert cpu.extension() is not None, "the fused CPU kernels did not build (see the warning logged above)"


def separate_blocks_phase1(blocks_inv_rms, queries, *blocks):
    """`cpu.phase1` with the reference's signature: blocks stacked, `obar` returned stacked (it comes in rows)."""
    obar, lse = cpu.phase1(blocks, blocks_inv_rms, queries.unbind(0))
    assert isinstance(obar, tuple) and len(obar) == queries.shape[0]
    return torch.stack(obar), lse


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_PHASE1_SHAPES, ids=str)
def test_phase1_matches_reference(shape, dtype):
    stacked, blocks_inv_rms, queries = phase1_inputs(*shape, dtype)
    inputs = (blocks_inv_rms, queries, *stacked.unbind(0))
    num_queries, tokens, hidden = shape[1:]
    grads = (torch.randn(num_queries, *tokens, hidden), torch.randn(num_queries, *tokens))
    (obar, lse), kernel_grads = run_with_grads(separate_blocks_phase1, inputs, grads)
    fp32 = (stacked.float(), blocks_inv_rms, queries)
    (ref_obar, ref_lse), (ref_grad_blocks, *ref_grads) = run_with_grads(reference_phase1, fp32, grads)
    assert obar.dtype == lse.dtype == torch.float32
    assert_matches(obar, ref_obar)
    assert_matches(lse, ref_lse)
    scale_blocks, scale_inv_rms, scale_queries = phase1_gradient_scales(stacked, blocks_inv_rms, queries, grads[0])
    scales = (scale_inv_rms, scale_queries, *[scale_blocks] * len(ref_grad_blocks))
    for x, grad, ref_grad, scale in zip(inputs, kernel_grads, (*ref_grads, *ref_grad_blocks), scales, strict=True):
        assert grad.dtype == x.dtype
        assert_matches(grad, ref_grad, scale)
    with torch.no_grad():  # inference takes the forward kernel alone, which computes the same
        no_grad_obar, no_grad_lse = separate_blocks_phase1(*inputs)
    assert torch.equal(no_grad_obar, obar) and torch.equal(no_grad_lse, lse)


def test_phase1_backward_with_rows_left_unused():
    """A row of `obar` that no loss reads gets no gradient (autograd hands the kernel zeros for it): the gradients
    equal the reference's with that row's gradient zero."""
    stacked, blocks_inv_rms, queries = phase1_inputs(3, 3, (2, 5), 40, torch.float32)
    inputs = (blocks_inv_rms, queries, *stacked.unbind(0))
    grad_obar, grad_lse = torch.randn(3, 2, 5, 40), torch.randn(3, 2, 5)
    grad_obar[1] = 0

    def rows_0_and_2(blocks_inv_rms, queries, *blocks):
        obar, lse = cpu.phase1(blocks, blocks_inv_rms, queries.unbind(0))
        return obar[0], obar[2], lse

    _, kernel_grads = run_with_grads(rows_0_and_2, inputs, (grad_obar[0], grad_obar[2], grad_lse))
    reference_inputs = (stacked, blocks_inv_rms, queries)
    _, (ref_grad_blocks, *ref_grads) = run_with_grads(reference_phase1, reference_inputs, (grad_obar, grad_lse))
    for grad, ref_grad in zip(kernel_grads, (*ref_grads, *ref_grad_blocks), strict=True):
        assert_matches(grad, ref_grad)


def closed_block(blocks_inv_rms, queries, *blocks):
    """`cpu.close_block` with `obar` stacked."""
    appended, obar, lse = cpu.close_block(blocks, blocks_inv_rms, queries.unbind(0), EPS)
    return appended, torch.stack(obar), lse


def reference_closed_block(blocks_inv_rms, queries, *blocks):
    """`close_block` as the reference's operations: `append_inverse_rms`, then phase 1 over all blocks."""
    appended = torch.cat([blocks_inv_rms, inverse_rms(blocks[-1], EPS).unsqueeze(0)])
    return appended, *reference_phase1(torch.stack(blocks), appended, queries)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", CPU_PHASE1_SHAPES, ids=str)
def test_close_block_matches_append_then_phase1(shape, dtype):
    """The newest block's inverse RMS, computed in phase 1's pass over the blocks and appended; in the backward pass
    its gradient (from the steps that read the returned `blocks_inv_rms`, and from phase 1's own scores) reaches the
    newest block in the pass that writes that block's gradient."""
    stacked, blocks_inv_rms, queries = phase1_inputs(*shape, dtype)
    inputs = (blocks_inv_rms[:-1], queries, *stacked.unbind(0))
    num_blocks, num_queries, tokens, hidden = shape
    grads = (
        torch.randn(num_blocks, *tokens),
        torch.randn(num_queries, *tokens, hidden),
        torch.randn(num_queries, *tokens),
    )
    outputs, kernel_grads = run_with_grads(closed_block, inputs, grads)
    fp32 = (blocks_inv_rms[:-1], queries, *stacked.float().unbind(0))
    ref_outputs, ref_grads = run_with_grads(reference_closed_block, fp32, grads)
    for output, ref_output in zip(outputs, ref_outputs, strict=True):
        assert_matches(output, ref_output)
    for x, grad, ref_grad in zip(inputs, kernel_grads, ref_grads, strict=True):
        assert grad.dtype == x.dtype
        assert_matches(grad, ref_grad)
    with torch.no_grad():
        no_grad_outputs = closed_block(*inputs)
    assert all(torch.equal(x, y) for x, y in zip(no_grad_outputs, outputs, strict=True))


def test_close_block_with_its_blocks_inv_rms_left_unused():
    """Where nothing reads the returned `blocks_inv_rms` (autograd hands the backward pass `None` for it)."""
    stacked, blocks_inv_rms, queries = phase1_inputs(3, 2, (2, 5), 40, torch.float32)
    inputs = (blocks_inv_rms[:-1], queries, *stacked.unbind(0))
    grads = (torch.randn(2, 2, 5, 40), torch.randn(2, 2, 5))
    _, kernel_grads = run_with_grads(lambda *x: closed_block(*x)[1:], inputs, grads)
    _, ref_grads = run_with_grads(lambda *x: reference_closed_block(*x)[1:], inputs, grads)
    for grad, ref_grad in zip(kernel_grads, ref_grads, strict=True):
        assert_matches(grad, ref_grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, hidden", [((2, 3), 48), ((1,), 100), ((), 20), ((3,), 1100), ((70,), 36)], ids=str)
def test_phase2_rms_norm_matches_reference(tokens, hidden, dtype):
    inputs = phase2_inputs(tokens, hidden, dtype)
    grad = torch.randn(*tokens, hidden).to(dtype)
    (out,), kernel_grads = run_with_grads(fused_phase2(cpu.phase2_rms_norm), inputs, (grad,))
    fp32_inputs = tuple(x.float() for x in inputs)
    (ref_out,), ref_grads = run_with_grads(fused_phase2(reference_phase2_rms_norm), fp32_inputs, (grad.float(),))
    assert out.dtype == dtype
    assert_matches(out, ref_out)
    for x, kernel_grad, ref_grad in zip(inputs, kernel_grads, ref_grads, strict=True):
        assert kernel_grad.dtype == x.dtype
        assert_matches(kernel_grad, ref_grad)
    with torch.no_grad():
        assert torch.equal(fused_phase2(cpu.phase2_rms_norm)(*inputs), out)


@pytest.mark.parametrize("scale", [None, 3.0], ids=["k=1", "k=3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, hidden", [((2, 3), 48), ((1,), 100), ((), 20), ((3,), 1100), ((70,), 36)], ids=str)
def test_phase2_matches_reference(tokens, hidden, dtype, scale):
    """Phase 2 alone, the input of a sublayer whose pre-norm is the family's own (Gemma's), times the step's output
    scale k (a 0-d buffer, `None` for 1)."""
    obar, lse, partial, query, _ = phase2_inputs(tokens, hidden, dtype)
    grad = torch.randn(*tokens, hidden).to(dtype)
    k = None if scale is None else torch.tensor(scale)

    def kernel(obar, lse, partial, query):
        return cpu.phase2(obar, lse, partial, query, EPS, scale=k)

    def reference(obar, lse, partial, query):
        return reference_phase2(obar, lse, partial, query, EPS, scale=k)

    inputs = (obar, lse, partial, query)
    (out,), kernel_grads = run_with_grads(kernel, inputs, (grad,))
    (ref_out,), ref_grads = run_with_grads(reference, tuple(x.float() for x in inputs), (grad.float(),))
    assert out.dtype == dtype
    assert_matches(out, ref_out)
    for x, kernel_grad, ref_grad in zip(inputs, kernel_grads, ref_grads, strict=True):
        assert kernel_grad.dtype == x.dtype
        assert_matches(kernel_grad, ref_grad)
    with torch.no_grad():  # inference takes the forward kernel alone, which computes the same
        assert torch.equal(cpu.implementations(differentiable=False)["phase2"](*inputs, EPS, scale=k), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, hidden", [((2, 3), 48), ((1,), 100), ((), 20), ((3,), 1100), ((70,), 36)], ids=str)
def test_phase1_rms_norm_matches_reference(tokens, hidden, dtype):
    """A block's first sublayer input (phase 1's fp32 row) normalised by its pre-norm, in the gain's dtype."""
    obar, norm_weight = 3 * torch.randn(*tokens, hidden), (1 + 0.5 * torch.randn(hidden)).to(dtype)
    grad = torch.randn(*tokens, hidden).to(dtype)

    def kernel(obar, norm_weight):
        return cpu.phase1_rms_norm(obar, dtype, norm_weight, NORM_EPS)

    def reference(obar, norm_weight):
        return reference_phase1_rms_norm(obar, torch.float32, norm_weight, NORM_EPS)

    (out,), kernel_grads = run_with_grads(kernel, (obar, norm_weight), (grad,))
    (ref_out,), ref_grads = run_with_grads(reference, (obar, norm_weight.float()), (grad.float(),))
    assert out.dtype == dtype
    assert_matches(out, ref_out)
    for x, kernel_grad, ref_grad in zip((obar, norm_weight), kernel_grads, ref_grads, strict=True):
        assert kernel_grad.dtype == x.dtype
        assert_matches(kernel_grad, ref_grad)
    with torch.no_grad():
        assert torch.equal(kernel(obar, norm_weight), out)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_append_inverse_rms_matches_reference(dtype):
    blocks_inv_rms = torch.rand(3, 2, 5)
    block = (3 * torch.randn(2, 5, 40)).to(dtype)
    with torch.no_grad():
        appended = cpu.append_inverse_rms(blocks_inv_rms, block, EPS)
    assert appended.shape == (4, 2, 5) and torch.equal(appended[:3], blocks_inv_rms)
    assert_matches(appended[3], inverse_rms(block.float(), EPS))


def test_non_contiguous_inputs():
    blocks = torch.randn(3, 5, 2, 40).transpose(1, 2)
    queries = torch.randn(40, 4).T
    with torch.no_grad():
        obar, lse = separate_blocks_phase1(inverse_rms(blocks, EPS), queries, *blocks.unbind(0))
        ref_obar, ref_lse = reference_phase1(blocks, inverse_rms(blocks, EPS), queries)
        assert_matches(obar, ref_obar)
        assert_matches(lse, ref_lse)
        partial = torch.randn(5, 2, 40).transpose(0, 1)
        norm_weight = torch.randn(80)[::2]
        args = (obar[1], lse[1], partial, queries[1], EPS, norm_weight, NORM_EPS)
        assert_matches(cpu.phase2_rms_norm(*args), reference_phase2_rms_norm(*args))
        args = (partial, torch.float32, norm_weight, NORM_EPS)
        assert_matches(cpu.phase1_rms_norm(*args), reference_phase1_rms_norm(*args))


def test_gain_of_another_dtype_takes_the_pytorch_path():
    """A bf16 model with an fp32 gain (as under autocast): the reference promotes the product to fp32, which the
    kernels (one dtype throughout) do not, so the PyTorch implementation computes it, with autograd and without."""
    obar, lse, partial, query, norm_weight = phase2_inputs((2, 3), 48, torch.bfloat16)
    gain = norm_weight.float().requires_grad_()
    for phase2_rms_norm in (cpu.phase2_rms_norm, cpu.implementations(differentiable=False)["phase2_rms_norm"]):
        args = (obar, lse, partial, query, EPS, gain, NORM_EPS)
        out = phase2_rms_norm(*args)
        assert out.dtype == torch.float32 and out.requires_grad
        assert torch.equal(out, two_phase_torch.phase2_rms_norm(*args))
    for phase1_rms_norm in (cpu.phase1_rms_norm, cpu.implementations(differentiable=False)["phase1_rms_norm"]):
        args = (obar, torch.bfloat16, gain, NORM_EPS)
        out = phase1_rms_norm(*args)
        assert out.dtype == torch.float32 and out.requires_grad
        assert torch.equal(out, two_phase_torch.phase1_rms_norm(*args))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gain_offset_is_added_to_the_weight(dtype):
    """The fused norms' `gain_offset` (Gemma's and Qwen3-Next's `1 + w`, `FusableNorm`), which the kernels add to the
    weight row themselves, computes what the kernel given the gain `norm_weight + gain_offset` computes, bit for bit,
    forward and backward, in every form: with autograd, without, and as the dispatcher's operators. The gradient of
    the weight is the gain's (the offset's derivative is 1)."""
    obar, lse, partial, query, norm_weight = phase2_inputs((70,), 36, dtype)
    norm_weight = norm_weight - 1  # stored relative to the offset, as Gemma's
    grad = torch.randn(70, 36).to(dtype)
    forms = (cpu.implementations(differentiable=False), cpu.operators())
    cases = [
        (cpu.phase2_rms_norm, (obar, lse, partial, query), (EPS,), [form["phase2_rms_norm"] for form in forms]),
        (cpu.phase1_rms_norm, (obar,), (dtype,), [form["phase1_rms_norm"] for form in forms]),
    ]
    for operation, inputs, fixed, inference_forms in cases:

        def with_offset(*leaves):
            return operation(*leaves[:-1], *fixed, leaves[-1], NORM_EPS, 1.0)

        def with_gain(*leaves):
            return operation(*leaves[:-1], *fixed, leaves[-1] + 1.0, NORM_EPS)

        (out, *_), grads = run_with_grads(with_offset, (*inputs, norm_weight), (grad,))
        (expected, *_), expected_grads = run_with_grads(with_gain, (*inputs, norm_weight), (grad,))
        assert torch.equal(out, expected)
        assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
        with torch.no_grad():
            for form in inference_forms:
                assert torch.equal(form(*inputs, *fixed, norm_weight, NORM_EPS, 1.0), expected)


# Llama's steps fused with its norm (Full AttnRes has no phase 2), Gemma 3's with its own `1 + w` norm on this fp32
# stream (the gain's offset differentiated through), OLMo 2's sublayers, which read no pre-norm, running phase 2
# alone (`cpu.phase2`).
@pytest.mark.parametrize(
    "residual_mode, family", [("block", "llama"), ("full", "llama"), ("block", "gemma3_text"), ("block", "olmo2")]
)
def test_model_on_cpu_kernels_matches_pytorch_path(residual_mode, family, monkeypatch):
    """Logits and every parameter's gradient, and greedy decoding with the KV cache, against `two_phase_torch`."""
    model = AttnResForCausalLM(tiny_config(residual_mode=residual_mode, family=family))
    randomize_depth_parameters(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 5))
    logits, grads = logits_and_grads(model, ids, "cpu", monkeypatch)
    ref_logits, ref_grads = logits_and_grads(model, ids, "reference", monkeypatch)
    assert_matches(logits, ref_logits)
    assert grads.keys() == ref_grads.keys()
    assert all(grads[name].abs().max() > 0 for name in grads if name.endswith("pseudo_query") and ".0.attn" not in name)
    for name, grad in grads.items():
        assert_matches(grad, ref_grads[name])

    with torch.no_grad():
        assert_matches(model(ids).logits, ref_logits)  # inference: the forward kernels alone
        generated = {}
        for kernel in ("cpu", "reference"):
            monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", kernel)
            generated[kernel] = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(generated["cpu"], generated["reference"])


def test_bf16_model_on_cpu_kernels_tracks_fp32(monkeypatch):
    """A bf16 model on the kernels against the same model in fp32 on the PyTorch path: logits within bf16's own
    error (a few units of bf16's epsilon on the logits' scale, as the reference's own bf16 run)."""
    model = AttnResForCausalLM(tiny_config())
    randomize_depth_parameters(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
        fp32_logits = model(ids).logits
        reference_bf16 = model.to(torch.bfloat16)(ids).logits.float()
        monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "cpu")
        kernel_bf16 = model(ids).logits.float()
    reference_error = (reference_bf16 - fp32_logits).abs().max()
    kernel_error = (kernel_bf16 - fp32_logits).abs().max()
    assert reference_error > 0
    assert kernel_error <= 2 * reference_error


def test_append_inverse_rms_gradient_matches_reference():
    """Differentiated through the kernel's own forward pass (what reentrant checkpointing recomputes)."""
    blocks_inv_rms, block = torch.rand(2, 3, 4), 3 * torch.randn(3, 4, 40)
    grad = torch.randn(3, 3, 4)
    inputs = (blocks_inv_rms, block)
    appended, kernel_grads = run_with_grads(lambda r, b: cpu.append_inverse_rms(r, b, EPS), inputs, (grad,))
    expected, ref_grads = run_with_grads(lambda r, b: torch.cat([r, inverse_rms(b, EPS).unsqueeze(0)]), inputs, (grad,))
    assert_matches(appended[0], expected[0])
    for kernel_grad, ref_grad in zip(kernel_grads, ref_grads, strict=True):
        assert_matches(kernel_grad, ref_grad)


def operation_cases(dtype: torch.dtype) -> list[tuple[str, tuple, tuple | None]]:
    """Each operation of `cpu.operators()` with inputs in `dtype`, and the arguments of the operator it calls (`None`
    where none: a gain of another dtype takes the PyTorch path): phase 2 with and without an output scale, and the
    fused norms with a gain of another dtype where `dtype` is not fp32."""
    stacked, blocks_inv_rms, queries = phase1_inputs(3, 2, (2, 5), 40, dtype)
    blocks, queries = list(stacked.unbind(0)), list(queries.unbind(0))
    obar, lse, partial, query, norm_weight = phase2_inputs((2, 5), 40, dtype)
    phase2_args = (obar, lse, partial, query, EPS)
    cases = [
        ("phase1", (blocks, blocks_inv_rms, queries)),
        ("close_block", (blocks, blocks_inv_rms[:-1], queries, EPS)),
        ("phase2", (*phase2_args, None)),
        ("phase2", (*phase2_args, torch.tensor(3.0))),
        ("phase2_rms_norm", (*phase2_args, norm_weight, NORM_EPS)),
        ("phase2_rms_norm", (*phase2_args, norm_weight, NORM_EPS, 1.0)),
        ("append_inverse_rms", (blocks_inv_rms, blocks[0], EPS)),
    ]
    cases = [(name, args, args) for name, args in cases]
    # the operator takes the output dtype from the gain
    cases.append(("phase1_rms_norm", (obar, dtype, norm_weight, NORM_EPS), (obar, norm_weight, NORM_EPS)))
    cases.append(("phase1_rms_norm", (obar, dtype, norm_weight, NORM_EPS, 1.0), (obar, norm_weight, NORM_EPS, 1.0)))
    if dtype != torch.float32:
        cases.append(("phase2_rms_norm", (*phase2_args, norm_weight.float(), NORM_EPS), None))
        cases.append(("phase1_rms_norm", (obar, dtype, norm_weight.float(), NORM_EPS), None))
    return cases


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_operators_compute_what_the_kernels_compute(dtype):
    """The kernels as the dispatcher's operators (what compiled graphs without autograd call) compute the directly
    called kernels' outputs, bit for bit, and `torch.library.opcheck` finds each operator's schema and fake
    implementation (the shapes, dtypes and strides compiled graphs are built with) consistent with it, eager and
    traced."""
    direct, operators = cpu.implementations(differentiable=False), cpu.operators()
    for name, args, operator_args in operation_cases(dtype):
        expected, computed = direct[name](*args), operators[name](*args)
        flat = [torch.utils._pytree.tree_leaves(outputs) for outputs in (expected, computed)]
        assert len(flat[0]) == len(flat[1]) and all(torch.equal(a, b) for a, b in zip(*flat)), name
        if operator_args is not None:
            torch.library.opcheck(getattr(torch.ops.attnres_cpu, name), operator_args)


# What each model's steps call besides phase 1 (`close_block`, and for the output step `append_inverse_rms` and
# `phase1`): the first step of a block its pre-norm fused with phase 1's row, the others phase 2 fused with it (Full
# has none), Gemma's `1 + w` norm too on this fp32 stream (`FusableNorm`), or, where a sublayer reads the step's
# result without a norm (OLMo 2's), phase 2 alone, the output step's (final) norm still fused.
COMPILED_OPERATORS = [
    ("block", "llama", False, {"phase1_rms_norm", "phase2_rms_norm"}),
    ("full", "llama", False, {"phase1_rms_norm"}),
    ("block", "gemma3_text", True, {"phase1_rms_norm", "phase2_rms_norm"}),
    ("block", "olmo2", True, {"phase1_rms_norm", "phase2"}),
]


@pytest.mark.parametrize("residual_mode, family, retrofit, expected", COMPILED_OPERATORS)
def test_compiled_inference_calls_the_kernels_as_operators(residual_mode, family, retrofit, expected, monkeypatch):
    """Compiled without autograd (vLLM's compiled model, compiled decoding), the graph calls the kernels as the
    dispatcher's operators and computes the eager model's logits bit for bit (the graph run as traced); a graph that
    records gradients runs `two_phase_torch`, as the operators have no autograd formula. Under an exact retrofit
    (output scales): Gemma 3's fused norms fold them into their eps, OLMo 2's unnormalised sublayers read them through
    phase 2 alone."""
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "cpu")
    model = AttnResForCausalLM(tiny_config(residual_mode=residual_mode, family=family, exact_retrofit=retrofit))
    randomize_depth_parameters(model)
    ids = torch.randint(3, model.config.vocab_size, (2, 5))
    graphs = []

    def keep_graph(graph_module: torch.fx.GraphModule, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    def operators_called() -> set[str]:
        (graph,) = graphs
        targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
        return {target.name() for target in targets if isinstance(target, torch._ops.OpOverload)} & names

    names = {f"attnres_cpu::{name}" for name in cpu.operators()}
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend=keep_graph)
    with torch.no_grad():
        assert torch.equal(compiled(ids).logits, model(ids).logits)
    expected = {"close_block", "append_inverse_rms", "phase1", *expected}
    assert operators_called() == {f"attnres_cpu::{name}" for name in expected}
    graphs.clear()
    torch._dynamo.reset()
    compiled(ids).logits.sum().backward()
    assert operators_called() == set()
