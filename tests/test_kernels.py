"""Triton kernels (`attnres.kernels`) against the PyTorch reference (`attnres.two_phase`), and the model's dispatch.

The kernel cases run on CPU tensors in Triton's interpreter. Triton decides interpretation when it is first imported
(its standard library, `tl.sum` and friends, is decorated then), and any test session has imported it long before
this module (attnres imports transformers, whose torch._dynamo imports probe for Triton). So in a normal session this
module collects one test, `test_kernels_under_interpreter`, which runs the file again in a child pytest process
started with `TRITON_INTERPRET=1`; in that child (or in any session started with `TRITON_INTERPRET=1`) it collects
the cases in `TestKernels` instead. On a GPU, `ATTNRES_TEST_DEVICE=cuda` collects `TestKernels` with CUDA tensors,
compiled kernels and no interpreter (`scripts/gpu_checks.sh`).

Tolerances: see `kernel_cases.py`, shared with the fused CPU kernels' tests.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from attnres import AttnResForCausalLM
from attnres.kernel_dispatch import TORCH_KERNELS, DepthKernels, _remembered
from attnres.kernel_dispatch import depth_kernels
from attnres.kernels import common, cpu, phase1, phase2_rms_norm
from attnres.kernels import phase2 as phase2_module
from attnres.kernels.reference import inverse_rms
from attnres.kernels.reference import phase1 as reference_phase1
from attnres.kernels.reference import phase2_rms_norm as reference_phase2_rms_norm

from conftest import randomize_depth_parameters, tiny_config
from kernel_cases import (
    DTYPES,
    EPS,
    FP32_TOL,
    NORM_EPS,
    PHASE1_SHAPES,
    assert_matches,
    depth_operations,
    fused_phase2,
    logits_and_grads,
    phase1_gradient_scales,
    phase1_inputs,
    phase2_inputs,
    run_with_grads,
)


INTERPRETED = isinstance(tl.sum, InterpretedFunction)
# Where `TestKernels` runs: CPU tensors in the interpreter, or compiled kernels on a GPU.
DEVICE = "cuda" if os.environ.get("ATTNRES_TEST_DEVICE") == "cuda" and not INTERPRETED else "cpu"


class TestKernels:
    """The kernels against the reference, on `DEVICE` (see the module docstring for when this is collected)."""

    __test__ = INTERPRETED or DEVICE == "cuda"

    @pytest.fixture(autouse=True)
    def on_device(self):
        """Every tensor the case makes (the shared inputs, the tiny models) is made on `DEVICE`."""
        with torch.device(DEVICE):
            yield

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("shape", PHASE1_SHAPES, ids=str)
    def test_phase1_matches_reference(self, shape, dtype):
        inputs = phase1_inputs(*shape, dtype)
        num_queries, tokens, hidden = shape[1:]
        grads = (torch.randn(num_queries, *tokens, hidden), torch.randn(num_queries, *tokens))
        (obar, lse), kernel_grads = run_with_grads(phase1, inputs, grads)
        (ref_obar, ref_lse), ref_grads = run_with_grads(reference_phase1, tuple(x.float() for x in inputs), grads)
        assert obar.dtype == lse.dtype == torch.float32
        assert_matches(obar, ref_obar)
        assert_matches(lse, ref_lse)
        scales = phase1_gradient_scales(*inputs, grads[0])
        for x, grad, ref_grad, scale in zip(inputs, kernel_grads, ref_grads, scales, strict=True):
            assert grad.dtype == x.dtype
            assert_matches(grad, ref_grad, scale)

    @pytest.mark.parametrize("dtype", DTYPES, ids=str)
    @pytest.mark.parametrize("tokens, hidden", [((2, 3), 48), ((1,), 100), ((), 20), ((3,), 1100)], ids=str)
    def test_phase2_rms_norm_matches_reference(self, tokens, hidden, dtype):
        inputs = phase2_inputs(tokens, hidden, dtype)
        grad = torch.randn(*tokens, hidden).to(dtype)
        (out,), kernel_grads = run_with_grads(fused_phase2(phase2_rms_norm), inputs, (grad,))
        fp32_inputs = tuple(x.float() for x in inputs)
        (ref_out,), ref_grads = run_with_grads(fused_phase2(reference_phase2_rms_norm), fp32_inputs, (grad.float(),))
        assert out.dtype == dtype
        assert_matches(out, ref_out)
        for x, kernel_grad, ref_grad in zip(inputs, kernel_grads, ref_grads, strict=True):
            assert kernel_grad.dtype == x.dtype
            assert_matches(kernel_grad, ref_grad)

    @pytest.mark.parametrize("implementation", ["triton", "torch"])
    def test_gain_offset_is_added_to_the_weight(self, implementation, monkeypatch):
        """The fused norms' `gain_offset` (Gemma's `1 + w`) as the Triton kernels and `two_phase_torch` take it: the
        output and every gradient are those of the gain `norm_weight + gain_offset` given instead."""
        monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "triton")
        kernels = depth_kernels(torch.device(DEVICE), "auto") if implementation == "triton" else TORCH_KERNELS
        obar, lse, partial, query, norm_weight = phase2_inputs((2, 3), 48, torch.float32)
        grad = torch.randn(2, 3, 48)
        for operation, inputs, fixed in (
            (kernels.phase2_rms_norm, (obar, lse, partial, query), (EPS,)),
            (kernels.phase1_rms_norm, (obar,), (torch.float32,)),
        ):
            (out,), grads = run_with_grads(
                lambda *x: operation(*x[:-1], *fixed, x[-1], NORM_EPS, 1.0), (*inputs, norm_weight), (grad,)
            )
            (expected,), expected_grads = run_with_grads(
                lambda *x: operation(*x[:-1], *fixed, x[-1] + 1.0, NORM_EPS), (*inputs, norm_weight), (grad,)
            )
            assert torch.equal(out, expected)
            assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))

    def test_phase2_rms_norm_backward_loops_over_tokens(self, monkeypatch):
        """More token tiles than backward programs, so each program loops and sums several tiles into its share of
        the gain's gradient; 9 tokens also leave the last tile partly masked."""
        monkeypatch.setattr(phase2_module, "_BACKWARD_SPLITS", 2)
        inputs = phase2_inputs((9,), 40, torch.float32)
        grad = torch.randn(9, 40)
        _, kernel_grads = run_with_grads(fused_phase2(phase2_rms_norm), inputs, (grad,))
        _, ref_grads = run_with_grads(fused_phase2(reference_phase2_rms_norm), inputs, (grad,))
        for kernel_grad, ref_grad in zip(kernel_grads, ref_grads, strict=True):
            assert_matches(kernel_grad, ref_grad)

    def test_non_contiguous_inputs(self):
        blocks = torch.randn(3, 5, 2, 40).transpose(1, 2)
        queries = torch.randn(4, 40)
        obar, lse = phase1(blocks, inverse_rms(blocks, EPS), queries)
        ref_obar, ref_lse = reference_phase1(blocks, inverse_rms(blocks, EPS), queries)
        assert_matches(obar, ref_obar)
        partial = torch.randn(5, 2, 40).transpose(0, 1)
        norm_weight = torch.randn(80)[::2]
        args = (obar[1], lse[1], partial, queries[1], EPS, norm_weight, NORM_EPS)
        assert_matches(phase2_rms_norm(*args), reference_phase2_rms_norm(*args))

    def test_query_gradient_reduction_over_many_rows(self, monkeypatch):
        """More rows than the reduction has splits, so each program loops; bf16 rows, fp32 result."""
        monkeypatch.setattr(common, "_REDUCTION_SPLITS", 3)
        coef, rows = torch.randn(3, 200), torch.randn(200, 20).to(torch.bfloat16)
        expected = (coef.double() @ rows.double()).float()
        torch.testing.assert_close(common.weighted_row_sum(coef, rows), expected, rtol=FP32_TOL, atol=1e-4)

    @pytest.mark.parametrize("op_name", ["phase1", "phase2_rms_norm"])
    def test_custom_op_registration(self, op_name):
        """Schema, fake tensors, autograd registration and AOT tracing: what torch.compile relies on."""
        if op_name == "phase1":
            op, args = torch.ops.attnres.phase1.default, phase1_inputs(3, 2, (2, 3), 48, torch.bfloat16)
            args = (args[0].requires_grad_(), args[1].requires_grad_(), args[2].requires_grad_())
        else:
            op = torch.ops.attnres.phase2_rms_norm.default
            obar, lse, partial, query, norm_weight = (
                x.requires_grad_() for x in phase2_inputs((2, 3), 48, torch.float32)
            )
            args = (obar, lse, partial, query, EPS, norm_weight, NORM_EPS)
        torch.library.opcheck(op, args)

    @pytest.mark.parametrize("residual_mode", ["block", "full"])
    def test_model_uses_kernels_and_matches_reference(self, residual_mode, monkeypatch):
        model = AttnResForCausalLM(tiny_config(residual_mode=residual_mode))
        randomize_depth_parameters(model)
        ids = torch.randint(3, model.config.vocab_size, (2, 5))

        monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "triton")
        assert kernel_kind(depth_kernels(torch.device(DEVICE), "auto")) == "triton"

        logits, grads = logits_and_grads(model, ids, "triton", monkeypatch)
        ref_logits, ref_grads = logits_and_grads(model, ids, "reference", monkeypatch)
        assert_matches(logits, ref_logits)
        query_grads = [grad for name, grad in grads.items() if name.endswith("pseudo_query")]
        # The first sublayer attends over the embedding alone, so its softmax (and query gradient) is constant.
        assert query_grads[0].abs().max() == 0 and all(grad.abs().max() > 0 for grad in query_grads[1:])
        # Every weight, the pre-norm gains the fused phase 2 differentiates included.
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            assert_matches(grad, ref_grads[name])

        # Recording hidden states computes every step's input besides the fused path, which the logits still take.
        monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "triton")
        with torch.no_grad():
            recorded = model(ids, output_hidden_states=True)
            assert torch.equal(recorded.logits, model(ids).logits)
            last = model(ids, logits_to_keep=1).logits
            assert torch.equal(model(ids, logits_to_keep=1, output_hidden_states=True).logits, last)
            monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
            ref_recorded = model(ids, output_hidden_states=True)
        for hidden, ref_hidden in zip(recorded.hidden_states, ref_recorded.hidden_states, strict=True):
            assert isinstance(hidden, torch.Tensor)
            assert_matches(hidden, ref_hidden)


    @pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
    def test_autocast_changes_no_bit_of_the_kernels(self, dtype, monkeypatch):
        """The kernels' values and gradients on an fp32 stream are bit-identical with and without autocast
        (test_mixed_precision.py tests the other implementations alike), and a model on them trains under it."""
        monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "triton")
        (outputs, grads), (expected_outputs, expected_grads) = depth_operations(DEVICE, dtype), depth_operations(DEVICE)
        for actual, expected in zip([*outputs, *grads], [*expected_outputs, *expected_grads], strict=True):
            assert torch.equal(actual, expected)
        model = AttnResForCausalLM(tiny_config())
        randomize_depth_parameters(model)
        ids = torch.randint(3, model.config.vocab_size, (2, 5))
        with torch.autocast(DEVICE, dtype=dtype):
            loss = model(ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_kernels_under_interpreter():
    """Run this file in a child pytest process with `TRITON_INTERPRET=1`, where `TestKernels` is collected."""
    assert os.environ.get("TRITON_INTERPRET") != "1", "TRITON_INTERPRET=1 was set after triton had been imported"
    tests_dir = Path(__file__).resolve().parent
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(Path(__file__).resolve()), "-q", "-p", "no:cacheprovider"],
        cwd=tests_dir.parent,
        env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = result.stdout[-6000:] + result.stderr[-3000:]
    assert result.returncode == 0, report
    summary = result.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"=*\s*\d+ passed(, \d+ warnings?)? in .*", summary), report
    assert int(re.search(r"(\d+) passed", summary).group(1)) > len(DTYPES) * len(PHASE1_SHAPES), report


test_kernels_under_interpreter.__test__ = not INTERPRETED


def kernel_kind(kernels: DepthKernels) -> str:
    """Which implementations `depth_kernels` chose: `"triton"`, `"cpu"` (the fused C++ kernels) or `"torch"`."""
    if kernels.phase2_rms_norm is phase2_rms_norm:
        return "triton"
    cpu_tables = [cpu.implementations(differentiable) for differentiable in (True, False)]
    if kernels.phase2_rms_norm in (table["phase2_rms_norm"] for table in cpu_tables):
        assert {name: getattr(kernels, name) for name in cpu_tables[0]} in cpu_tables
        return "cpu"
    assert kernels._replace(differentiable=True) == TORCH_KERNELS
    return "torch"


@pytest.mark.parametrize(
    "device, config_kernel, env, kind",
    [
        ("cpu", "auto", None, "cpu"),
        ("cpu", "auto", "cpu", "cpu"),
        ("cpu", "reference", None, "torch"),
        ("cpu", "auto", "reference", "torch"),
        ("cuda", "auto", None, "triton"),
        ("cuda", "reference", None, "torch"),
        ("cuda", "auto", "reference", "torch"),
        ("cpu", "auto", "triton", "triton"),
        ("cpu", "reference", "triton", "torch"),
        ("meta", "auto", None, "torch"),
    ],
)
def test_depth_kernels_dispatch(device, config_kernel, env, kind, monkeypatch):
    """Triton kernels on CUDA and the fused C++ kernels on the CPU under `"auto"`, the PyTorch implementation
    otherwise; `ATTNRES_DEPTH_KERNEL` overrides. Only chooses: runs nothing, so a CUDA device object is enough."""
    if env is None:
        monkeypatch.delenv("ATTNRES_DEPTH_KERNEL", raising=False)
    else:
        monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", env)
    assert kernel_kind(depth_kernels(torch.device(device), config_kernel)) == kind
    assert depth_kernels(torch.device(device), config_kernel).differentiable
    # For a forward pass that autograd does not record, the same kind; on the CPU, the kernels without autograd.
    kernels = depth_kernels(torch.device(device), config_kernel, differentiable=False)
    assert kernel_kind(kernels) == kind and not kernels.differentiable
    without_autograd = DepthKernels(**cpu.implementations(differentiable=False), differentiable=False)
    assert (kernels == without_autograd) == (kind == "cpu")


@pytest.fixture
def fresh_kernel_choice():
    """`depth_kernels` remembers its choices; tests that change what can be imported or built choose afresh."""
    _remembered.cache_clear()
    yield
    _remembered.cache_clear()


def test_depth_kernels_without_triton_fall_back_unless_demanded(monkeypatch, fresh_kernel_choice):
    """Where `attnres.kernels` cannot be imported (remote code without the package, or no Triton)."""
    monkeypatch.setitem(sys.modules, "attnres.kernels", None)
    monkeypatch.delenv("ATTNRES_DEPTH_KERNEL", raising=False)
    assert kernel_kind(depth_kernels(torch.device("cuda"), "auto")) == "torch"
    assert kernel_kind(depth_kernels(torch.device("cpu"), "auto")) == "torch"
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "triton")
    with pytest.raises(ImportError):
        depth_kernels(torch.device("cuda"), "auto")
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "fast")
    with pytest.raises(ValueError, match="ATTNRES_DEPTH_KERNEL"):
        depth_kernels(torch.device("cuda"), "auto")


def test_depth_kernels_without_cpu_kernels_fall_back_unless_demanded(monkeypatch, fresh_kernel_choice):
    """Where the C++ kernels cannot be built (no compiler or ninja): `cpu.extension()` is `None`."""
    monkeypatch.setattr(cpu, "extension", lambda: None)
    monkeypatch.delenv("ATTNRES_DEPTH_KERNEL", raising=False)
    assert kernel_kind(depth_kernels(torch.device("cpu"), "auto")) == "torch"
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "cpu")
    with pytest.raises(RuntimeError, match="ATTNRES_DEPTH_KERNEL=cpu"):
        depth_kernels(torch.device("cpu"), "auto")


def test_depth_kernel_config_reaches_the_depth_state(monkeypatch):
    """The model chooses the kernels once per forward pass, into the depth state every step reads."""
    monkeypatch.delenv("ATTNRES_DEPTH_KERNEL", raising=False)
    embeddings = torch.randn(1, 3, 32)
    def initial_state(config):
        return AttnResForCausalLM(config).model.layers[0].attn_residual.initial_state

    kernels = initial_state(tiny_config(depth_kernel="reference"))(embeddings, None, False)[1].kernels
    assert kernel_kind(kernels) == "torch"
    kernels = initial_state(tiny_config())(embeddings, None, False)[1].kernels
    assert kernels == DepthKernels(**cpu.implementations(differentiable=True), differentiable=True)
    with torch.no_grad():
        kernels = initial_state(tiny_config())(embeddings, None, False)[1].kernels
    assert kernels == DepthKernels(**cpu.implementations(differentiable=False), differentiable=False)


def test_kernel_benchmark_runs_under_interpreter(tmp_path):
    """`benchmarks/kernels.py` end to end on the interpreter (its GPU shapes need a GPU): every implementation runs,
    forward and backward, and in fp32 the kernels and the compiled reference agree with the eager one."""
    output = tmp_path / "kernels.json"
    command = [sys.executable, "-m", "benchmarks.kernels", "--interpret", "--tiny", "--dtype", "float32", "--reps", "1"]
    result = subprocess.run(
        [*command, "--output", str(output)],
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = json.loads(output.read_text())["results"]
    assert {(row["implementation"], row["mode"]) for row in rows} >= {
        (name, mode) for name in ("eager", "triton", "pytorch", "compiled") for mode in ("fwd", "fwd+bwd")
    }
    for row in rows:
        assert "error" not in row, row
        assert row["median_ms"] > 0 and row["max_rel_error_vs_eager"] <= FP32_TOL, row


test_kernel_benchmark_runs_under_interpreter.__test__ = not INTERPRETED
