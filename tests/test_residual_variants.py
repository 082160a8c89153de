"""Comparison residuals and AttnRes ablations (docs/design.md §9): each against its paper's definition, against the
baseline where the paper says it starts as one, and the Transformers features (generation, save / load,
checkpointing)."""

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers.masking_utils import create_causal_mask

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.depth_state import DepthContext, DepthState
from attnres.kernel_dispatch import TORCH_KERNELS
from attnres.residual_variants import HyperStreams
from attnres.residual_variants import ManifoldHyperConnection, RecomputedSinkhornKnopp, sinkhorn_knopp
from attnres.two_phase import inverse_rms

from conftest import disable_activation_checkpointing, enable_activation_checkpointing, max_diff, tiny_config


VARIANTS = {
    "denseformer": dict(residual_mode="denseformer"),
    "denseformer_k2_p2": dict(residual_mode="denseformer", dwa_dilation=2, dwa_period=2),
    "hc": dict(residual_mode="hc"),
    "mhc": dict(residual_mode="mhc"),
    "input_query": dict(residual_mode="full", depth_ablation="input_query"),
    "sigmoid": dict(residual_mode="block", block_size=2, depth_ablation="sigmoid"),
    "no_key_norm": dict(residual_mode="full", depth_ablation="no_key_norm"),
    "sliding_window": dict(residual_mode="full", depth_ablation="sliding_window", depth_window=2),
    "block_sliding_window": dict(residual_mode="block", block_size=2, depth_ablation="sliding_window", depth_window=1),
    "multi_head": dict(residual_mode="block", block_size=3, depth_ablation="multi_head", depth_heads=4),
}


def input_batch(config, batch: int = 2, length: int = 11, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (batch, length), generator=generator)


def randomize_residual_parameters(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every depth-mixing parameter away from its initialisation, as training would."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_residual." in name:
                scale = 0.5 if parameter.dim() <= 1 else 0.5 / math.sqrt(parameter.shape[0])
                parameter.add_(scale * torch.randn(parameter.shape, generator=generator))


def variant_and_baseline(rms_norm_eps: float = 1e-2, **overrides) -> tuple[AttnResForCausalLM, AttnResForCausalLM]:
    """A freshly initialised variant and the standard model holding the same shared weights. A large eps makes any
    mistake in a variant's scale visible through the pre-norms."""
    model = AttnResForCausalLM(tiny_config(rms_norm_eps=rms_norm_eps, **overrides)).eval()
    baseline = AttnResForCausalLM(tiny_config(rms_norm_eps=rms_norm_eps, residual_mode="standard")).eval()
    missing, unexpected = baseline.load_state_dict(model.state_dict(), strict=False)
    assert not missing
    assert all("_residual." in name for name in unexpected)
    return model, baseline


def trained(name: str) -> AttnResForCausalLM:
    model = AttnResForCausalLM(tiny_config(**VARIANTS[name])).eval()
    randomize_residual_parameters(model)
    return model


# ------------------------------------------------------------------------------- baseline at initialisation


@pytest.mark.parametrize("name", ["denseformer", "denseformer_k2_p2", "hc"])
def test_paper_claim_equal_to_prenorm_baseline_at_init(name):
    """DenseFormer (a_ii = 1, others 0) and HC (A_m = e_{l mod n}, A_r = I, B = 1, dynamic weights 0) say a fresh
    model is the PreNorm baseline."""
    model, baseline = variant_and_baseline(**VARIANTS[name])
    ids = input_batch(model.config)
    with torch.no_grad():
        expected = baseline(ids).logits
        assert max_diff(model(ids).logits, expected) <= 1e-5
        randomize_residual_parameters(model)
        assert max_diff(model(ids).logits, expected) > 1e-3, "the residual parameters must change the model"


def test_mhc_static_part_is_the_baseline():
    """(derived) mHC's biases are initialised to the PreNorm residual; only its gated dynamic part (alpha = 0.01)
    moves a fresh model off the baseline."""
    model, baseline = variant_and_baseline(residual_mode="mhc")
    ids = input_batch(model.config)
    with torch.no_grad():
        expected = baseline(ids).logits
        assert 0 < max_diff(model(ids).logits, expected) < 0.05
        for name, parameter in model.named_parameters():
            if name.endswith("_gate"):
                assert parameter.item() == pytest.approx(0.01)
                parameter.zero_()
        assert max_diff(model(ids).logits, expected) <= 1e-5


@pytest.mark.parametrize(
    "overrides",
    [
        dict(residual_mode="full", depth_ablation="input_query"),
        dict(residual_mode="block", block_size=2, depth_ablation="sigmoid"),
        dict(residual_mode="full", depth_ablation="no_key_norm"),
        dict(residual_mode="block", block_size=3, depth_ablation="multi_head", depth_heads=4),
    ],
    ids=lambda o: o["depth_ablation"],
)
def test_zero_query_ablations_equal_baseline_with_exact_retrofit(overrides):
    """(docs/design.md §5) Zero queries make every ablation but the window average (or, for sigmoid, halve) the sum
    of the sources; with each pre-norm's eps divided by the square of that factor the model is the baseline."""
    exact, baseline = variant_and_baseline(exact_retrofit=True, **overrides)
    plain, _ = variant_and_baseline(**overrides)
    plain.load_state_dict(exact.state_dict())
    ids = input_batch(exact.config)
    with torch.no_grad():
        expected = baseline(ids).logits
        assert max_diff(exact(ids).logits, expected) <= 1e-5
        assert max_diff(plain(ids).logits, expected) > 1e-3


# ------------------------------------------------------------------------- each mode against its definition


def rms_normalized(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_denseformer_follows_its_definition_with_dilation_and_period():
    """After block i, y_i = sum_j a_ij x_j over j = i, i - k, ... >= 0, only for i % p == 0 and the last block."""
    config = tiny_config(residual_mode="denseformer", num_hidden_layers=5, dwa_dilation=2, dwa_period=2)
    model = AttnResForCausalLM(config).eval()
    randomize_residual_parameters(model)
    ids = input_batch(config)
    decoder = model.model
    with torch.no_grad():
        stream = decoder.embed_tokens(ids)
        position_ids = torch.arange(ids.shape[1])[None]
        rope = decoder.rotary_emb(stream, position_ids)
        mask = create_causal_mask(config, stream, None, None, position_ids=position_ids)
        block_outputs = [stream]
        averaged_after = []
        for i, layer in enumerate(decoder.layers, start=1):
            stream = stream + layer.self_attn(layer.input_layernorm(stream), rope, mask)[0]
            stream = stream + layer.mlp(layer.post_attention_layernorm(stream))
            block_outputs.append(stream)
            if i % 2 == 0 or i == config.num_hidden_layers:
                averaged_after.append(i)
                sources = [j for j in range(i + 1) if (i - j) % 2 == 0]
                weights = layer.mlp_residual.dwa_weights
                assert len(weights) == len(sources)
                stream = sum(w * block_outputs[j] for w, j in zip(weights, sources))
            else:
                assert layer.mlp_residual.dwa_weights is None
        expected = model.lm_head(decoder.norm(stream))
        assert max_diff(model(ids).logits, expected) <= 1e-5
    assert averaged_after == [2, 4, 5]
    assert all(layer.attn_residual.dwa_weights is None for layer in decoder.layers)


def random_streams(n: int = 4, d: int = 48, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 2, 3, d, generator=generator), torch.randn(2, 3, d, generator=generator)


def test_hyper_connection_follows_its_definition():
    """h = sum_j A_m[j] H_j; H'_i = B_i f(h) + sum_j A_r[j, i] H_j, each matrix static + s * tanh(norm(H) W)."""
    model = trained("hc")
    module = model.model.layers[1].mlp_residual
    streams, output = random_streams()
    n, eps = streams.shape[0], module.eps
    normed = [rms_normalized(streams[j], eps) for j in range(n)]
    s_alpha, s_beta = module.input_scale, module.output_scale
    a_m = [module.static_input[j] + s_alpha * torch.tanh(normed[j] @ module.dynamic_input) for j in range(n)]
    expected_input = sum(a_m[j][..., None] * streams[j] for j in range(n))
    expected_streams = []
    for i in range(n):
        b_i = module.static_output[i] + s_beta * torch.tanh(normed[i] @ module.dynamic_output)
        carried = sum(
            (module.static_residual[j, i] + s_alpha * torch.tanh(normed[j] @ module.dynamic_residual[:, i]))[..., None]
            * streams[j]
            for j in range(n)
        )
        expected_streams.append(b_i[..., None] * output + carried)
    with torch.no_grad():
        assert max_diff(module(HyperStreams(streams)), expected_input) <= 1e-5
        assert max_diff(module.absorb(output, HyperStreams(streams)).streams, torch.stack(expected_streams)) <= 1e-5


def test_mhc_follows_its_definition():
    """x = RMSNorm(vec(H)); H_pre = sigmoid(a x phi + b), H_post = 2 sigmoid(.), H_res = SinkhornKnopp(.), and
    H'_i = sum_j H_res[i, j] H_j + H_post[i] f(sum_j H_pre[j] H_j)."""
    model = trained("mhc")
    module = model.model.layers[2].attn_residual
    streams, output = random_streams()
    n = streams.shape[0]
    x = rms_normalized(torch.cat(list(streams), dim=-1), module.eps)  # stream-major flattening: [H_0 | H_1 | ...]
    pre = torch.sigmoid(module.input_gate * (x @ module.input_proj) + module.input_bias)
    post = 2 * torch.sigmoid(module.output_gate * (x @ module.output_proj) + module.output_bias)
    res_logits = module.residual_gate * (x @ module.residual_proj).reshape(*x.shape[:-1], n, n) + module.residual_bias
    res = eq9_sinkhorn(res_logits, 20).float()
    expected_input = sum(pre[..., j, None] * streams[j] for j in range(n))
    expected_streams = [
        sum(res[..., i, j, None] * streams[j] for j in range(n)) + post[..., i, None] * output for i in range(n)
    ]
    with torch.no_grad():
        assert max_diff(module(HyperStreams(streams)), expected_input) <= 1e-5
        assert max_diff(module.absorb(output, HyperStreams(streams)).streams, torch.stack(expected_streams)) <= 1e-5
        assert ((pre > 0) & (pre < 1)).all() and ((post > 0) & (post < 2)).all()


def eq9_sinkhorn(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """mHC's Eq. 9 in float64, as written: M^(0) = exp(logits), M^(t) = T_r(T_c(M^(t - 1)))."""
    matrix = torch.exp(logits.double())
    for _ in range(iterations):
        matrix = matrix / matrix.sum(-2, keepdim=True)  # T_c: every column sums to 1
        matrix = matrix / matrix.sum(-1, keepdim=True)  # T_r: every row sums to 1
    return matrix


@pytest.mark.parametrize("std", [0.5, 2.0, 4.0])
def test_sinkhorn_knopp_follows_eq9(std):
    """Columns first, rows last, 20 times; so H_res @ 1 = 1 (each new stream a convex combination of the old)."""
    generator = torch.Generator().manual_seed(0)
    logits = std * torch.randn(64, 4, 4, generator=generator)
    expected = eq9_sinkhorn(logits, 20)
    assert max_diff(sinkhorn_knopp(logits, 20), expected) <= 1e-6
    exact = sinkhorn_knopp(logits.double(), 20)
    assert max_diff(exact, expected) <= 1e-14
    assert torch.allclose(exact.sum(-1), torch.ones(64, 4, dtype=torch.float64), atol=1e-14)
    if std >= 2:  # trained-like logits: the rows-last matrix is not the columns-last one
        columns_last = torch.exp(logits.double())
        for _ in range(20):
            columns_last = columns_last / columns_last.sum(-1, keepdim=True)
            columns_last = columns_last / columns_last.sum(-2, keepdim=True)
        assert max_diff(columns_last, expected) > 1e-2


def log_domain_eq9(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """Eq. 9 in float64 on log M: the same normalisations, each a log-sum-exp subtracted, exact at any logit."""
    log_matrix = logits.double()
    for _ in range(iterations):
        log_matrix = log_matrix - torch.logsumexp(log_matrix, -2, keepdim=True)
        log_matrix = log_matrix - torch.logsumexp(log_matrix, -1, keepdim=True)
    return log_matrix.exp()


@pytest.mark.parametrize("std", [8.0, 24.0, 32.0])
def test_sinkhorn_knopp_stays_finite_and_exact_at_large_logits(std):
    """Where the linear-domain Eq. 9 in fp32 underflows whole columns (0.5% of matrices wrong at std 24, 1% NaN at
    32), values and gradients stay within 1e-4 of float64 Eq. 9 in the log domain, finite everywhere."""
    generator = torch.Generator().manual_seed(0)
    logits = (std * torch.randn(20000, 4, 4, generator=generator)).requires_grad_()
    weights = torch.randn(4, 4, generator=generator)
    matrix = RecomputedSinkhornKnopp.apply(logits, 20)
    (grad,) = torch.autograd.grad((matrix * weights).sum(), logits)
    exact_logits = logits.detach().double().requires_grad_()
    exact = log_domain_eq9(exact_logits, 20)
    (exact_grad,) = torch.autograd.grad((exact * weights.double()).sum(), exact_logits)
    assert torch.isfinite(matrix).all() and torch.isfinite(grad).all()
    assert max_diff(matrix, exact) <= 1e-4 and max_diff(grad, exact_grad) <= 1e-4
    linear = torch.exp(logits.detach() - logits.detach().amax((-2, -1), keepdim=True))
    for _ in range(20):
        linear = linear / linear.sum(-2, keepdim=True)
        linear = linear / linear.sum(-1, keepdim=True)
    if std >= 24:  # what the log domain fixes: the linear domain's fp32 answer is wrong or NaN for some matrices
        wrong = ((linear.double() - exact.detach()).abs() > 1e-3) | linear.isnan()
        assert wrong.any()


def test_sinkhorn_knopp_is_doubly_stochastic_and_recomputes_in_backward():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 7, 4, 4, generator=generator, dtype=torch.float64)  # mHC-like spread
    matrix = sinkhorn_knopp(logits, 20)
    assert (matrix >= 0).all()
    assert torch.allclose(matrix.sum(-1), torch.ones(5, 7, 4, dtype=torch.float64), atol=1e-12)
    assert torch.allclose(matrix.sum(-2), torch.ones(5, 7, 4, dtype=torch.float64), atol=1e-3)

    def saved_numel(function) -> tuple[int, torch.Tensor]:
        leaf = logits.clone().requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
            out = function(leaf)
        (out * torch.arange(16.0, dtype=out.dtype).view(4, 4)).sum().backward()
        return sum(saved), leaf.grad

    plain_numel, plain_grad = saved_numel(lambda x: sinkhorn_knopp(x, 20))
    recomputed_numel, recomputed_grad = saved_numel(lambda x: RecomputedSinkhornKnopp.apply(x, 20))
    assert torch.allclose(recomputed_grad, plain_grad, atol=1e-12)
    assert recomputed_numel == logits.numel()  # only the input is kept for backward ...
    assert plain_numel >= 40 * logits.numel()  # ... where plain autograd keeps every iteration


def test_mhc_matches_deepseek_v4_hyper_connection():
    """Against Transformers' DeepSeek-V4 mHC with its eps floors at 0 and our weights mapped onto its own: the
    coefficients, the projected matrix (DeepSeek mixes with comb^T), one sublayer step and every gradient."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    n, d, eps = 4, 48, 1e-6
    generator = torch.Generator().manual_seed(7)
    ours = ManifoldHyperConnection(d, position=3, num_streams=n, eps=eps, sinkhorn_iterations=20)
    with torch.no_grad():  # trained-like: logits of std about 2, where the two Sinkhorn orders differ by 1e-2
        for projection in (ours.input_proj, ours.output_proj, ours.residual_proj):
            projection.copy_(torch.randn(projection.shape, generator=generator) / math.sqrt(n * d))
        for bias in (ours.input_bias, ours.output_bias, ours.residual_bias):
            bias.copy_(torch.randn(bias.shape, generator=generator))
        for gate in (ours.input_gate, ours.output_gate, ours.residual_gate):
            gate.copy_(2 * torch.rand((), generator=generator))
    config = DeepseekV4Config(hidden_size=d, hc_mult=n, hc_sinkhorn_iters=20, hc_eps=0.0, rms_norm_eps=eps)
    theirs = DeepseekV4HyperConnection(config)
    # Their comb is indexed [from stream, to stream], our H_res [to, from]: the residual logits' n x n layout and
    # its bias are transposed. `fn` holds the projections as rows, in the order pre, post, comb.
    residual_proj = ours.residual_proj.detach().view(n * d, n, n).transpose(1, 2).reshape(n * d, n * n)
    with torch.no_grad():
        theirs.fn.copy_(torch.cat([ours.input_proj, ours.output_proj, residual_proj], dim=1).T)
        theirs.base.copy_(torch.cat([ours.input_bias, ours.output_bias, ours.residual_bias.T.reshape(-1)]))
        theirs.scale.copy_(torch.stack([ours.input_gate, ours.output_gate, ours.residual_gate]))
    sublayer = torch.nn.Linear(d, d)
    their_sublayer = torch.nn.Linear(d, d)
    their_sublayer.load_state_dict(sublayer.state_dict())

    streams = torch.randn(n, 2, 5, d, generator=generator).requires_grad_()  # ours: [n, batch, seq, D]
    their_streams = streams.detach().permute(1, 2, 0, 3).contiguous().requires_grad_()  # theirs: [batch, seq, n, D]
    post, residual = ours.output_and_residual_weights(streams)
    new_streams = ours.absorb(sublayer(ours(HyperStreams(streams))), HyperStreams(streams)).streams
    their_post, comb, collapsed = theirs(their_streams)
    # DeepseekV4DecoderLayer's update, without its pre-norm (a part of the sublayer, not of mHC).
    their_new = their_post.unsqueeze(-1) * their_sublayer(collapsed).unsqueeze(-2) + comb.transpose(-1, -2) @ their_streams

    def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
        return max_diff(a, b) / b.abs().max().item()

    # fp32 on both sides, the same operations in a different order: a few units of fp32's 1.2e-7.
    assert relative_error(post, their_post) <= 1e-6
    assert relative_error(residual, comb.transpose(-1, -2)) <= 1e-6
    assert (residual - 1 / n).abs().max() > 0.2  # far from uniform, where the order of Sinkhorn's steps matters
    assert relative_error(ours(HyperStreams(streams)), collapsed) <= 1e-6
    assert relative_error(new_streams.permute(1, 2, 0, 3), their_new) <= 1e-6

    weights = torch.randn(new_streams.shape, generator=generator)
    (new_streams * weights).sum().backward()
    (their_new * weights.permute(1, 2, 0, 3)).sum().backward()
    grad_fn = theirs.fn.grad.T
    their_grads = {
        "input_proj": grad_fn[:, :n],
        "output_proj": grad_fn[:, n : 2 * n],
        "residual_proj": grad_fn[:, 2 * n :].reshape(n * d, n, n).transpose(1, 2).reshape(n * d, n * n),
        "input_bias": theirs.base.grad[:n],
        "output_bias": theirs.base.grad[n : 2 * n],
        "residual_bias": theirs.base.grad[2 * n :].view(n, n).T,
        "input_gate": theirs.scale.grad[0],
        "output_gate": theirs.scale.grad[1],
        "residual_gate": theirs.scale.grad[2],
    }
    for name, grad in their_grads.items():
        assert relative_error(getattr(ours, name).grad, grad) <= 2e-6, name
    assert relative_error(streams.grad.permute(1, 2, 0, 3), their_streams.grad) <= 2e-6
    assert relative_error(sublayer.weight.grad, their_sublayer.weight.grad) <= 2e-6


def test_mhc_coefficients_stay_fp32_in_bf16():
    model = trained("mhc").to(torch.bfloat16)
    module = model.model.layers[0].mlp_residual
    streams = random_streams()[0].to(torch.bfloat16)
    post, res = module.output_and_residual_weights(streams)
    assert module.input_weights(streams).dtype == post.dtype == res.dtype == torch.float32
    assert torch.allclose(res.sum(-1), torch.ones(res.shape[:-1]), atol=1e-6)
    ids = input_batch(model.config)
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def random_depth_state(num_blocks: int, with_partial: bool, d: int = 48, seed: int = 3):
    generator = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.5, 3, num_blocks).view(-1, 1, 1, 1)  # sources of different magnitudes
    blocks = torch.randn(num_blocks, 2, 5, d, generator=generator) * scales
    partial = torch.randn(2, 5, d, generator=generator) if with_partial else None
    return blocks, inverse_rms(blocks, 1e-6), partial


@pytest.mark.parametrize("ablation", ["input_query", "sigmoid", "no_key_norm", "sliding_window", "multi_head"])
@pytest.mark.parametrize("with_partial", [False, True])
def test_ablation_step_follows_its_definition(ablation, with_partial):
    config = tiny_config(residual_mode="full", depth_ablation=ablation, depth_window=2, depth_heads=4)
    model = AttnResForCausalLM(config).eval()
    randomize_residual_parameters(model)
    module = model.model.output_residual
    blocks, blocks_inv_rms, partial = random_depth_state(5, with_partial)
    sources = torch.cat([blocks] + ([partial[None]] if with_partial else []))
    eps = module.eps
    w = module.query.pseudo_query
    if ablation == "sliding_window":
        sources = torch.cat([sources[:1], sources[-2:]])
    if ablation == "multi_head":
        heads = sources.unflatten(-1, (4, 12))
        logits = (rms_normalized(heads, eps) * (w * module.query.key_norm_weight).unflatten(-1, (4, 12))).sum(-1)
        expected = (torch.softmax(logits, 0)[..., None] * heads).sum(0).flatten(-2)
    else:
        if ablation == "no_key_norm":
            logits = sources @ w
        elif ablation == "input_query":
            query = w + rms_normalized(sources[-1], eps) @ module.query_proj.T  # per token
            logits = (rms_normalized(sources, eps) * module.query.key_norm_weight * query).sum(-1)
        else:
            logits = rms_normalized(sources, eps) @ (w * module.query.key_norm_weight)
        weights = torch.sigmoid(logits) if ablation == "sigmoid" else torch.softmax(logits, 0)
        expected = (weights[..., None] * sources).sum(0)
    with torch.no_grad():
        # The ablations' state: no gathered queries and no phase 1 (`DepthState`).
        state, context = DepthState(tuple(blocks), blocks_inv_rms, partial), DepthContext(TORCH_KERNELS)
        assert max_diff(module(state, context), expected) <= 1e-5
        weights = module.attention_weights(state, context)
    if ablation == "sliding_window":  # a column for every source of the unwindowed step, 0 outside the window
        assert weights.shape[-1] == module.num_unwindowed_sources and (weights[..., 1:-2] == 0).all()
    else:
        assert weights.shape[-1] == blocks.shape[0] + with_partial
    if ablation == "sigmoid":
        assert ((weights > 0) & (weights < 1)).all() and not torch.allclose(weights.sum(-1), torch.ones(2, 5))
    else:
        assert torch.allclose(weights.sum(-1), torch.ones(2, 5), atol=1e-6)
    if ablation == "no_key_norm":
        assert module.query.key_norm_weight is None


@pytest.mark.parametrize("name", ["sliding_window", "block_sliding_window"])
def test_sliding_window_keeps_only_the_window_in_the_depth_state(name):
    model = trained(name)
    window = model.config.depth_window
    sizes = []
    hooks = [
        # args: (state, context): a row of blocks_inv_rms per block the state keeps
        module.register_forward_pre_hook(lambda m, args: sizes.append(args[0].blocks_inv_rms.shape[0]))
        for module in model.modules()
        if type(module).__name__ == "SlidingWindowDepthAttention"
    ]
    ids = input_batch(model.config)
    weights = model.model.depth_attention_weights(ids)
    for hook in hooks:
        hook.remove()
    assert len(sizes) == model.config.num_sublayers + 1 and max(sizes) == window + 1
    output_weights = weights["output_residual"]
    num_blocks = math.ceil(model.config.num_sublayers / model.config.depth_block_size)
    assert output_weights.shape[-1] == num_blocks + 1  # every block has a column, the hidden ones hold 0
    assert (output_weights[..., 1 : num_blocks + 1 - window] == 0).all()
    assert torch.allclose(output_weights.sum(-1), torch.ones(ids.shape))


# ------------------------------------------------------------------------------------- Transformers features


@pytest.mark.parametrize("name", list(VARIANTS))
def test_cached_generation_equals_uncached(name):
    model = trained(name)
    prompt = input_batch(model.config, batch=1, length=6)
    kwargs = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert cached.shape[1] == prompt.shape[1] + 12
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_save_load_round_trip_is_bit_identical(name, tmp_path):
    model = trained(name)
    model.save_pretrained(tmp_path)
    for filename in ("modeling_attnres.py", "depth_mixing.py", "residual_variants.py", "two_phase.py"):
        assert (tmp_path / filename).is_file(), filename
    loaded = AttnResForCausalLM.from_pretrained(tmp_path).eval()
    for key, value in VARIANTS[name].items():
        assert getattr(loaded.config, key) == value
    assert model.state_dict().keys() == loaded.state_dict().keys()
    for key, value in model.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key
    ids = input_batch(model.config)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("name", list(VARIANTS))
def test_gradient_checkpointing_gives_the_same_gradients(name, use_reentrant):
    model = trained(name)
    model.train()
    ids = input_batch(model.config)

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {key: p.grad.clone() for key, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    enable_activation_checkpointing(model, use_reentrant)
    checkpointed = gradients()
    disable_activation_checkpointing(model)
    assert plain.keys() == checkpointed.keys()
    residual_parameters = [key for key, p in model.named_parameters() if "_residual." in key and p.requires_grad]
    assert residual_parameters and set(residual_parameters) <= plain.keys()
    for key in plain:
        assert max_diff(plain[key], checkpointed[key]) <= 1e-6, key


def test_remote_code_loads_the_variants_without_the_package(tmp_path):
    names = ["denseformer_k2_p2", "mhc", "multi_head"]
    expected = {}
    for name in names:
        model = trained(name)
        model.save_pretrained(tmp_path / name)
        with torch.no_grad():
            expected[name] = model(input_batch(model.config)).logits
    torch.save({"ids": input_batch(model.config), "logits": expected}, tmp_path / "expected.pt")
    script = textwrap.dedent(
        f"""
        import importlib.abc, sys
        class HideAttnRes(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "attnres" or name.startswith("attnres."):
                    raise ModuleNotFoundError(name)
        sys.meta_path.insert(0, HideAttnRes())
        import torch
        from transformers import AutoModelForCausalLM
        data = torch.load({str(tmp_path / "expected.pt")!r})
        for name in {names!r}:
            model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r} + "/" + name, trust_remote_code=True)
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            with torch.no_grad():
                assert torch.equal(model.eval()(data["ids"]).logits, data["logits"][name]), name
        print("REMOTE_OK")
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "REMOTE_OK" in result.stdout


@pytest.mark.parametrize("name", ["mhc", "block_sliding_window"])
def test_torch_compile_fullgraph_traces(name):
    """The riskiest variants for tracing: mHC's custom autograd Function, and a depth state that shrinks."""
    model = trained(name)
    ids = input_batch(model.config)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, backend="eager")
    with torch.no_grad():
        assert max_diff(compiled(ids).logits, model(ids).logits) <= 1e-6


# ------------------------------------------------------------------------------------------------ config errors


@pytest.mark.parametrize(
    "overrides,field,message",
    [
        (dict(residual_mode="dwa"), "residual_mode", "'denseformer' | 'hc' | 'mhc'"),
        (dict(depth_ablation="gated"), "depth_ablation", "'input_query' | 'sigmoid' | 'no_key_norm'"),
        (dict(residual_mode="hc", depth_ablation="sigmoid"), "depth_ablation", "residual_mode 'full' or 'block'"),
        (dict(depth_window=0), "depth_window", "positive integer"),
        (dict(depth_heads=5), "depth_heads", "divisor of hidden_size = 48"),
        (dict(dwa_dilation=0), "dwa_dilation", "positive integer"),
        (dict(dwa_period=-1), "dwa_period", "positive integer"),
        (dict(hc_streams=1), "hc_streams", ">= 2"),
        (dict(sinkhorn_iterations=0), "sinkhorn_iterations", "positive integer"),
    ],
)
def test_invalid_variant_field_raises_naming_it(overrides, field, message):
    with pytest.raises(ValueError) as error:
        tiny_config(**overrides)
    assert f"AttnResConfig.{field}=" in str(error.value)
    assert message in str(error.value)


def test_variant_config_round_trips_through_json(tmp_path):
    config = tiny_config(residual_mode="denseformer", dwa_dilation=3, dwa_period=2)
    config.save_pretrained(tmp_path)
    loaded = AttnResConfig.from_pretrained(tmp_path)
    assert (loaded.residual_mode, loaded.dwa_dilation, loaded.dwa_period) == ("denseformer", 3, 2)
