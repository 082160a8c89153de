"""Core model invariants (docs/design.md §2-§6): every mode against its exact reference; the Transformers features."""

import math
from collections.abc import Callable

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    StaticCache,
)
from transformers.masking_utils import create_causal_mask
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from attnres import AttnResConfig, AttnResForCausalLM, AttnResModel
from attnres.depth_mixing import PendingInput, num_depth_sources
from attnres.modeling_attnres import AttnResRMSNorm
from attnres import two_phase, two_phase_torch
from attnres.two_phase import inverse_rms, naive_depth_attention, phase1, phase2

from conftest import (
    disable_activation_checkpointing,
    enable_activation_checkpointing,
    max_diff,
    randomize_depth_parameters,
    tiny_config,
)


LLAMA_FIELDS = (
    "vocab_size hidden_size intermediate_size num_hidden_layers num_attention_heads num_key_value_heads head_dim "
    "max_position_embeddings rms_norm_eps pad_token_id bos_token_id eos_token_id tie_word_embeddings"
).split()


def llama_twin(config: AttnResConfig) -> LlamaForCausalLM:
    fields = {name: getattr(config, name) for name in LLAMA_FIELDS}
    return LlamaForCausalLM(LlamaConfig(**fields, rope_parameters=dict(config.rope_parameters))).eval()


def attnres_from(reference: torch.nn.Module, **overrides) -> AttnResForCausalLM:
    """An AttnRes model holding `reference`'s weights (new depth parameters keep their zero / one init)."""
    config = tiny_config(**{name: getattr(reference.config, name) for name in LLAMA_FIELDS}, **overrides)
    model = AttnResForCausalLM(config).eval()
    missing, unexpected = model.load_state_dict(reference.state_dict(), strict=False)
    assert not unexpected
    assert all(name.endswith(("pseudo_query", "key_norm_weight")) for name in missing)
    return model


def input_batch(config, batch: int = 2, length: int = 11, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, config.vocab_size, (batch, length), generator=generator)


# ---------------------------------------------------------------------------------------------- standard == Llama


@pytest.mark.parametrize("tie_word_embeddings", [False, True])
def test_standard_mode_is_llama(tie_word_embeddings):
    llama = llama_twin(tiny_config(tie_word_embeddings=tie_word_embeddings))
    model = attnres_from(llama, residual_mode="standard")
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in llama.parameters())
    ids = input_batch(model.config)
    with torch.no_grad():
        expected = llama(ids, output_hidden_states=True)
        actual = model(ids, output_hidden_states=True)
    assert max_diff(actual.logits, expected.logits) <= 1e-5
    assert torch.equal(actual.logits, expected.logits), "standard mode must be bit-compatible with Llama"
    assert len(actual.hidden_states) == len(expected.hidden_states) == model.config.num_hidden_layers + 1
    for ours, theirs in zip(actual.hidden_states, expected.hidden_states):
        assert torch.equal(ours, theirs)


def test_standard_moe_is_mixtral():
    config = tiny_config(residual_mode="standard", num_local_experts=4, num_experts_per_tok=2)
    fields = {name: getattr(config, name) for name in LLAMA_FIELDS}
    mixtral = MixtralForCausalLM(
        MixtralConfig(
            **fields,
            rope_parameters=dict(config.rope_parameters),
            num_local_experts=4,
            num_experts_per_tok=2,
            router_aux_loss_coef=0.02,
        )
    ).eval()
    model = AttnResForCausalLM(tiny_config(residual_mode="standard", num_local_experts=4, router_aux_loss_coef=0.02))
    model.load_state_dict(mixtral.state_dict(), strict=True)
    model.eval()
    ids = input_batch(config)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    # The same experts implementation as Mixtral (its default, grouped_mm), so the same computation.
    assert model.config._experts_implementation == mixtral.config._experts_implementation == "grouped_mm"
    with torch.no_grad():
        expected = mixtral(ids, attention_mask=mask, labels=ids, output_router_logits=True)
        actual = model(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    assert torch.equal(actual.logits, expected.logits), "standard MoE must be bit-compatible with Mixtral"
    assert torch.equal(actual.aux_loss, expected.aux_loss)
    assert torch.equal(actual.loss, expected.loss)
    assert len(actual.router_logits) == config.num_hidden_layers


# ------------------------------------------------------------------- zero-init AttnRes == standard (docs/design.md §5)


@pytest.mark.parametrize("mode,block_size", [("full", None), ("block", 2), ("block", 3), ("block", 6)])
def test_zero_init_attnres_equals_standard_with_exact_retrofit(mode, block_size):
    """Zero pseudo-queries average the sources; with each step's output multiplied by k the model is the baseline."""
    llama = llama_twin(tiny_config(rms_norm_eps=1e-2))  # a large eps makes any eps mistake visible
    extra = {} if block_size is None else {"block_size": block_size}
    exact = attnres_from(llama, residual_mode=mode, exact_retrofit=True, **extra)
    plain = attnres_from(llama, residual_mode=mode, exact_retrofit=False, **extra)
    ids = input_batch(llama.config)
    with torch.no_grad():
        expected = llama(ids).logits
        assert max_diff(exact(ids).logits, expected) <= 1e-5
        # Without the retrofit the only difference is eps * k**2 in each norm (design.md §5): visible at eps = 1e-2.
        assert max_diff(plain(ids).logits, expected) > 1e-3


def test_zero_init_attnres_equals_standard_when_eps_is_zero():
    """With eps = 0, RMSNorm is scale invariant, so the uniform average equals the residual sum after every norm."""
    llama = llama_twin(tiny_config(rms_norm_eps=0.0))
    model = attnres_from(llama, residual_mode="block", block_size=3)
    ids = input_batch(llama.config)
    with torch.no_grad():
        assert max_diff(model(ids).logits, llama(ids).logits) <= 1e-5


def test_num_depth_sources_follows_spec():
    # S = 2 over L = 6: blocks {1,2} {3,4} {5,6}
    assert [num_depth_sources(l, 2, 6) for l in range(1, 8)] == [1, 2, 2, 3, 3, 4, 4]
    # S = 1 is Full AttnRes: sublayer l attends over v_0..v_{l-1}; the output over v_0..v_L
    assert [num_depth_sources(l, 1, 6) for l in range(1, 8)] == [1, 2, 3, 4, 5, 6, 7]
    # S = L: one block, sources [embedding, partial]
    assert [num_depth_sources(l, 6, 6) for l in range(1, 8)] == [1, 2, 2, 2, 2, 2, 2]


# ------------------------------------------------------------------------ two-phase == naive (docs/design.md §3, §6)


def test_phase1_and_phase2_equal_naive_softmax():
    generator = torch.Generator().manual_seed(3)
    blocks = torch.randn(4, 2, 5, 24, generator=generator) * torch.tensor([1.0, 3.0, 0.5, 2.0]).view(4, 1, 1, 1)
    partial = torch.randn(2, 5, 24, generator=generator)
    queries = torch.randn(3, 24, generator=generator)
    gains = 1 + 0.3 * torch.randn(3, 24, generator=generator)
    eps = 1e-6
    obar, lse = phase1(blocks, inverse_rms(blocks, eps), queries * gains)
    for q in range(3):
        expected_blocks, _ = naive_depth_attention(blocks, queries[q], gains[q], eps)
        assert max_diff(obar[q], expected_blocks) <= 1e-5
        expected, weights = naive_depth_attention(torch.cat([blocks, partial[None]]), queries[q], gains[q], eps)
        merged = phase2(obar[q], lse[q], partial, queries[q] * gains[q], eps)
        assert max_diff(merged, expected) <= 1e-5
        assert torch.allclose(weights.sum(-1), torch.ones(2, 5))


@pytest.mark.parametrize("num_blocks", [1, 3, 5])
def test_padded_phase1_matches_the_reference(num_blocks):
    """Phase 1 over blocks padded to 5 (what torch.compile runs, `two_phase_torch.padded_phase1`) is phase 1 over the
    valid ones, values and gradients, in fp32 to rounding; the padding, NaN here as uninitialised memory may be,
    changes nothing and gets no gradient."""
    generator = torch.Generator().manual_seed(4)
    scales = torch.tensor([1.0, 3.0, 0.5, 2.0, 1.5])[:num_blocks].view(-1, 1, 1, 1)
    blocks = (torch.randn(num_blocks, 2, 3, 16, generator=generator) * scales).requires_grad_()
    queries = torch.randn(3, 16, generator=generator, requires_grad=True)
    padding = [torch.full((2, 3, 16), torch.nan, requires_grad=True) for _ in range(5 - num_blocks)]
    valid = torch.arange(5) < num_blocks
    eps = 1e-6
    grads = (torch.randn(3, 2, 3, 16, generator=generator), torch.randn(3, 2, 3, generator=generator))
    expected, expected_grads = values_and_grads(
        lambda b, q: phase1(b, inverse_rms(b, eps), q), (blocks, queries), grads
    )
    actual, actual_grads = values_and_grads(
        lambda b, q, *pad: tuple(map(torch.stack, two_phase_torch.padded_phase1(valid, q, eps, *b.unbind(0), *pad))),
        (blocks, queries, *padding),
        grads,
    )
    for value, reference in zip(actual + actual_grads[:2], expected + expected_grads, strict=True):
        assert max_diff(value, reference) <= 1e-5 * max(1.0, reference.abs().max().item())
    assert all(grad is None or torch.equal(grad, torch.zeros_like(grad)) for grad in actual_grads[2:])


def values_and_grads(fn, inputs: tuple[torch.Tensor, ...], grad_outputs: tuple[torch.Tensor, ...]):
    leaves = tuple(x.detach().requires_grad_() for x in inputs)
    outputs = fn(*leaves)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    torch.autograd.backward(outputs, grad_outputs)
    return outputs, tuple(x.grad for x in leaves)


def assert_close_to_fp32(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32 up to summation order (1e-5 of the largest magnitude); bf16 results are that value rounded once."""
    rtol = 1e-5 if actual.dtype == torch.float32 else torch.finfo(actual.dtype).eps
    atol = 1e-5 * max(1.0, expected.float().abs().max().item())
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("num_blocks, num_queries, tokens", [(3, 2, (2, 3)), (1, 4, (5,)), (4, 1, ()), (5, 6, (1, 3))])
def test_torch_two_phase_matches_reference(num_blocks, num_queries, tokens, dtype):
    """`two_phase_torch` (the model's path without Triton: hand-written backward, blocks never stacked in the state)
    against the autograd reference in fp32: values and every gradient, phase 1 and phase 2 fused with the pre-norm."""
    generator = torch.Generator().manual_seed(num_blocks)
    hidden = 20
    blocks = tuple((3 * torch.randn(*tokens, hidden, generator=generator)).to(dtype) for _ in range(num_blocks))
    blocks_inv_rms = inverse_rms(torch.stack(blocks), 1e-6)
    queries = torch.randn(num_queries, hidden, generator=generator)
    grads = (torch.randn(num_queries, *tokens, hidden, generator=generator), torch.randn(num_queries, *tokens))

    def lean_phase1(inv_rms, queries, *blocks):
        return two_phase_torch.phase1(blocks, inv_rms, queries)

    def reference_phase1(inv_rms, queries, *blocks):
        return two_phase.phase1(torch.stack(blocks), inv_rms, queries)

    inputs = (blocks_inv_rms, queries, *blocks)
    (obar, lse), lean_grads = values_and_grads(lean_phase1, inputs, grads)
    (ref_obar, ref_lse), ref_grads = values_and_grads(reference_phase1, tuple(x.float() for x in inputs), grads)
    assert_close_to_fp32(obar, ref_obar)
    assert_close_to_fp32(lse, ref_lse)
    for x, grad, ref_grad in zip(inputs, lean_grads, ref_grads, strict=True):
        assert grad.dtype == x.dtype
        assert_close_to_fp32(grad, ref_grad)
    with torch.no_grad():  # the no-grad path skips autograd.Function but computes the same
        assert torch.equal(two_phase_torch.phase1(blocks, blocks_inv_rms, queries)[0], obar)

    partial = (3 * torch.randn(*tokens, hidden, generator=generator)).to(dtype)
    norm_weight = (1 + 0.3 * torch.randn(hidden, generator=generator)).to(dtype)
    inputs = (obar[0].detach(), lse[0].detach(), partial, queries[0], norm_weight)
    grad = (torch.randn(*tokens, hidden, generator=generator).to(dtype),)

    def fused(module):
        def phase2_rms_norm(obar, lse, partial, query, weight):
            return module.phase2_rms_norm(obar, lse, partial, query, 1e-6, weight, 1e-5)

        return phase2_rms_norm

    def straight_through(x: torch.Tensor) -> torch.Tensor:
        """`x` rounded to `dtype` in the forward pass and untouched in the backward, as the backward pass treats the
        bf16 model's roundings of `h` and of the normalised `h` (no-ops in fp32)."""
        return x + (x.to(dtype).float() - x).detach()

    def fp32_reference(obar, lse, partial, query, weight):
        hidden = straight_through(two_phase.phase2(obar, lse, partial, query, 1e-6))
        return weight * straight_through(hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-5))

    (out,), lean_grads = values_and_grads(fused(two_phase_torch), inputs, grad)
    # Forward: the same operations as the reference in the same order and dtype (bf16 rounding included).
    assert torch.equal(out, fused(two_phase)(*inputs))
    _, ref_grads = values_and_grads(fp32_reference, tuple(x.float() for x in inputs), tuple(g.float() for g in grad))
    for x, grad, ref_grad in zip(inputs, lean_grads, ref_grads, strict=True):
        assert grad.dtype == x.dtype
        assert_close_to_fp32(grad, ref_grad)


@pytest.mark.parametrize("residual_mode", ["block", "full"])
@pytest.mark.parametrize("training", [False, True])
def test_forward_traces_into_one_graph(residual_mode, training):
    """`torch.compile` sees the whole forward pass as one graph, without a graph break, in inference (where the depth
    functions run their plain forward) and in training (where they are autograd Functions)."""
    model = AttnResForCausalLM(tiny_config(residual_mode=residual_mode)).train(training)
    ids = input_batch(model.config)
    with torch.inference_mode(not training):
        explanation = torch._dynamo.explain(model)(ids, use_cache=False)
    assert explanation.graph_break_count == 0, [str(graph_break.reason) for graph_break in explanation.break_reasons]
    assert explanation.graph_count == 1


def test_depth_queries_are_read_through_hooked_or_wrapped_modules():
    """The model reads every step's folded query by calling its `DepthQuery`, so a hook (accelerate's offloading,
    torch's) runs and what it returns is what the model uses; unhooked, the same queries."""
    model = AttnResForCausalLM(tiny_config(residual_mode="block", block_size=3))
    randomize_depth_parameters(model)
    direct = model.model.depth_queries()
    step = model.model.layers[1].mlp_residual.query
    calls = []
    handle = step.register_forward_hook(lambda module, args, output: calls.append(output))
    try:
        called = model.model.depth_queries()
    finally:
        handle.remove()
    assert len(calls) == 1 and torch.equal(calls[0], direct[3])
    assert torch.equal(torch.stack(called), torch.stack(direct))
    # A hook may change what the step returns (as PEFT's wrappers return their copy's query): the model reads that.
    handle = step.register_forward_hook(lambda module, args, output: output * 2)
    try:
        assert torch.equal(model.model.depth_queries()[3], 2 * direct[3])
    finally:
        handle.remove()


def test_a_kv_cache_keeps_the_depth_queries_of_the_pass_that_started_it():
    """Decoding reads the queries once per KV cache: the pass that starts a cache reads every `DepthQuery`, the passes
    that continue it without autograd read none and compute what reading them would. A cache that starts again
    (reset, as `generate` resets a static cache it reuses) reads them anew, so it sees changed parameters; with
    autograd every pass reads them."""
    model = AttnResForCausalLM(tiny_config(residual_mode="block", block_size=3)).eval()
    randomize_depth_parameters(model)
    ids = input_batch(model.config, batch=1)
    step = model.model.layers[1].mlp_residual.query
    calls = []
    handle = step.register_forward_hook(lambda module, args, output: calls.append(output))

    def decode(cache, steps: int = 3) -> torch.Tensor:
        """The greedy continuation of `ids`, `steps` tokens decoded through `cache`, and the logits of each."""
        tokens, logits = ids, []
        for _ in range(steps + 1):
            positions = torch.arange(ids.shape[1] + len(logits) - tokens.shape[1], ids.shape[1] + len(logits))
            logits.append(model(tokens, cache=cache, use_cache=True, position_ids=positions[None]).logits[:, -1])
            tokens = logits[-1].argmax(-1, keepdim=True)
        return torch.stack(logits, dim=1)

    def uncached(logits: torch.Tensor) -> torch.Tensor:
        """The logits of the same tokens in one pass without a cache."""
        sequence = torch.cat([ids, logits[:, :-1].argmax(-1)], dim=1)
        return model(sequence, use_cache=False).logits[:, ids.shape[1] - 1 :]

    try:
        with torch.no_grad():
            cache = StaticCache(model.config, max_cache_len=32)
            logits = decode(cache)
            assert len(calls) == 1
            assert max_diff(logits, uncached(logits)) <= 1e-5
            randomize_depth_parameters(model, seed=1)
            calls.clear()
            cache.reset()
            changed = decode(cache)
            assert len(calls) == 1
            assert max_diff(changed, uncached(changed)) <= 1e-5 and max_diff(changed, logits) > 1e-3
        calls.clear()
        decode(DynamicCache(config=model.config), steps=2)
        assert len(calls) == 3
    finally:
        handle.remove()


@pytest.mark.parametrize("residual_mode", ["block", "full"])
def test_per_step_phase1_when_queries_cannot_be_gathered(residual_mode, monkeypatch):
    """Sharded parameters (FSDP, ZeRO-3) cannot be read before their layer runs: the model then lets each step run
    phase 1 for its own query. Same logits and gradients as phase 1 once per block."""
    from attnres import depth_mixing

    model = AttnResForCausalLM(tiny_config(residual_mode=residual_mode, block_size=3))
    randomize_depth_parameters(model)
    ids = input_batch(model.config)

    def logits_and_grads():
        model.zero_grad()
        logits = model(ids).logits
        logits.square().mean().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    assert model.model.depth_queries() is not None
    logits, grads = logits_and_grads()
    # What an FSDP1 / ZeRO-3 placeholder looks like outside its unit's forward: an empty tensor.
    hidden_size = model.config.hidden_size
    placeholder, whole = depth_mixing.DepthQuery(hidden_size), depth_mixing.DepthQuery(hidden_size)
    placeholder.pseudo_query.data = torch.empty(0)
    assert not depth_mixing.holds_full_values(placeholder)
    assert depth_mixing.holds_full_values(whole)
    monkeypatch.setattr(depth_mixing, "holds_full_values", lambda step: False)
    assert model.model.depth_queries() is None
    per_step_logits, per_step_grads = logits_and_grads()
    assert max_diff(per_step_logits, logits) <= 1e-5
    for grad, per_step_grad in zip(grads, per_step_grads, strict=True):
        assert max_diff(per_step_grad, grad) <= 1e-5 * max(1.0, grad.abs().max().item())


def naive_logits(model: AttnResForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """The whole model the naive way: every depth-mixing step attends over explicitly listed sources
    (docs/design.md §3-§4)."""
    config, decoder = model.config, model.model
    block_size, num_sublayers = config.depth_block_size, config.num_sublayers
    embeddings = decoder.embed_tokens(input_ids)
    position_ids = torch.arange(input_ids.shape[1]).unsqueeze(0)
    position_embeddings = decoder.rotary_emb(embeddings, position_ids)
    mask = create_causal_mask(config, embeddings, None, None, position_ids=position_ids)
    outputs = [embeddings]  # v_0, v_1, ...

    def sources(position: int) -> torch.Tensor:
        block = (min(position, num_sublayers + 1) - 1) // block_size + 1 if position <= num_sublayers else None
        if block is None:  # the output attends over every block
            block = math.ceil(num_sublayers / block_size) + 1
        completed = [outputs[0]] + [
            sum(outputs[(n - 1) * block_size + 1 : min(n * block_size, num_sublayers) + 1])
            for n in range(1, block)
        ]
        partial = outputs[(block - 1) * block_size + 1 : position]
        return torch.stack(completed + ([sum(partial)] if partial else []))

    def mix(position: int, mixer: torch.nn.Module) -> torch.Tensor:
        query = mixer.query
        hidden = naive_depth_attention(sources(position), query.pseudo_query, query.key_norm_weight, mixer.eps)[0]
        return hidden * mixer.output_scale

    for index, layer in enumerate(decoder.layers):
        hidden = layer.input_layernorm(mix(2 * index + 1, layer.attn_residual))
        outputs.append(layer.self_attn(hidden, position_embeddings, mask)[0])
        outputs.append(layer.mlp(layer.post_attention_layernorm(mix(2 * index + 2, layer.mlp_residual))))
    return model.lm_head(decoder.norm(mix(num_sublayers + 1, decoder.output_residual)))


@pytest.mark.parametrize("mode,block_size", [("full", None), ("block", 1), ("block", 2), ("block", 3), ("block", 6)])
@pytest.mark.parametrize("moe", [False, True])
def test_two_phase_model_equals_naive_with_trained_depth_parameters(mode, block_size, moe):
    extra = {"exact_retrofit": True, "rms_norm_eps": 1e-2} if mode == "full" else {}
    if block_size is not None:
        extra["block_size"] = block_size
    if moe:
        extra.update(num_local_experts=4, num_experts_per_tok=2)
    model = AttnResForCausalLM(tiny_config(residual_mode=mode, **extra)).eval()
    randomize_depth_parameters(model)
    ids = input_batch(model.config)
    with torch.no_grad():
        assert max_diff(model(ids).logits, naive_logits(model, ids)) <= 1e-5


def test_block_size_one_equals_full():
    full = AttnResForCausalLM(tiny_config(residual_mode="full")).eval()
    randomize_depth_parameters(full)
    block = AttnResForCausalLM(tiny_config(residual_mode="block", block_size=1)).eval()
    block.load_state_dict(full.state_dict())
    ids = input_batch(full.config)
    with torch.no_grad():
        assert torch.equal(block(ids).logits, full(ids).logits)
        assert max_diff(full(ids).logits, naive_logits(full, ids)) <= 1e-5


def test_depth_attention_weights_are_distributions_over_the_spec_sources():
    model = AttnResForCausalLM(tiny_config(residual_mode="block", block_size=2)).eval()
    ids = input_batch(model.config)
    weights = model.model.depth_attention_weights(ids)
    assert len(weights) == model.config.num_sublayers + 1
    for name, value in weights.items():
        position = model.model.get_submodule(name).position
        k = num_depth_sources(position, 2, model.config.num_sublayers)
        assert value.shape == (*ids.shape, k)
        # zero-initialised pseudo-queries: uniform attention
        assert torch.allclose(value, torch.full_like(value, 1 / k))
    randomize_depth_parameters(model)
    trained = model.model.depth_attention_weights(ids)
    assert all(torch.allclose(w.sum(-1), torch.ones(ids.shape)) for w in trained.values())
    assert not torch.allclose(trained["output_residual"], weights["output_residual"])


# ----------------------------------------------------------------------------------------- Transformers features


def trained_model(**overrides) -> AttnResForCausalLM:
    model = AttnResForCausalLM(tiny_config(**overrides)).eval()
    randomize_depth_parameters(model)
    return model


@pytest.mark.parametrize("mode", ["standard", "full", "block"])
def test_cached_generation_equals_uncached(mode):
    model = trained_model(residual_mode=mode, block_size=3)
    prompt = input_batch(model.config, batch=1, length=6)
    kwargs = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    static = model.generate(prompt, cache_implementation="static", **kwargs)
    assert cached.shape[1] == prompt.shape[1] + 20
    assert torch.equal(cached, uncached)
    assert torch.equal(cached, static)


def test_compiled_static_cache_generation_equals_eager():
    """Generation with a static cache and the forward pass compiled (Transformers' recipe for compiled decoding):
    each decoding step runs the graph compiled with static shapes at one token, the case of
    `test_inductor_compiled_one_token_equals_eager`, and its greedy tokens are eager generation's."""
    model = trained_model(residual_mode="block", block_size=3)
    prompt = input_batch(model.config, batch=1, length=6)
    kwargs = dict(max_new_tokens=8, min_new_tokens=8, do_sample=False, cache_implementation="static")
    eager = model.generate(prompt, **kwargs)
    model.forward = torch.compile(model.forward, fullgraph=True, dynamic=False)
    assert torch.equal(model.generate(prompt, disable_compile=True, **kwargs), eager)


def test_compiled_training_with_more_blocks_than_torch_keeps_traces_of_a_region(monkeypatch):
    """Compiled with autograd, phase 1 is traced block by block (`kernel_dispatch.depth_kernels`): here 11 calls
    (Full AttnRes over 10 sublayers, and the output), more than the 8 traces torch keeps of a nested compile region,
    whose inputs would differ at every block (the blocks require gradients, the padding does not). The loss and every
    gradient are eager's on the same implementation within fp32 rounding."""
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
    model = trained_model(residual_mode="full", num_hidden_layers=5)
    ids = input_batch(model.config)

    def loss_and_grads(forward) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss = forward(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}

    torch._dynamo.reset()
    compiled_loss, compiled_grads = loss_and_grads(torch.compile(model, fullgraph=True))
    loss, grads = loss_and_grads(model)
    assert max_diff(compiled_loss, loss) <= 1e-5
    for name, grad in grads.items():
        assert max_diff(compiled_grads[name], grad) <= 1e-5 * max(1.0, grad.abs().max().item()), name


def test_static_cache_forward_matches_full_forward():
    model = trained_model()
    ids = input_batch(model.config, batch=1, length=9)
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        full = model(ids).logits
        first = model(ids[:, :5], cache=cache, use_cache=True).logits
        rest = model(ids[:, 5:], cache=cache, use_cache=True).logits
    assert max_diff(torch.cat([first, rest], 1), full) <= 1e-5


@pytest.mark.parametrize("attn_implementation", ["eager", "sdpa"])
def test_left_padded_batch_equals_each_sequence_alone(attn_implementation):
    model = trained_model()
    model.config._attn_implementation = attn_implementation
    long, short = input_batch(model.config, batch=1, length=9)[0], input_batch(model.config, 1, 5, seed=7)[0]
    pad = model.config.pad_token_id
    ids = torch.stack([long, torch.cat([torch.full((4,), pad), short])])
    mask = torch.tensor([[1] * 9, [0] * 4 + [1] * 5])
    with torch.no_grad():
        batched = model(ids, attention_mask=mask).logits
        alone_long = model(long[None]).logits[0]
        alone_short = model(short[None]).logits[0]
    assert max_diff(batched[0], alone_long) <= 1e-5
    assert max_diff(batched[1, 4:], alone_short) <= 1e-5
    generated = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False)
    alone = model.generate(short[None], max_new_tokens=8, do_sample=False)
    assert torch.equal(generated[1, 4:], alone[0])


def test_eager_equals_sdpa():
    model = trained_model(residual_mode="full")
    ids = input_batch(model.config)
    with torch.no_grad():
        model.config._attn_implementation = "eager"
        eager = model(ids).logits
        model.config._attn_implementation = "sdpa"
        sdpa = model(ids).logits
    assert max_diff(eager, sdpa) <= 1e-5


@pytest.mark.parametrize("depth_kernel", ["auto", "reference"])
def test_forward_without_autograd_sums_each_block_in_place_and_computes_the_same(depth_kernel):
    """Without autograd a block's partial sum is updated in place from its third step on. The logits are exactly the
    recorded forward pass's, the sublayers' outputs (which a hook may keep) are left as they were returned, and the
    partial sum is allocated once per block rather than once per step."""
    model = trained_model(residual_mode="block", block_size=4, num_hidden_layers=4, depth_kernel=depth_kernel)
    ids = input_batch(model.config)
    kept = []
    hooks = [
        module.register_forward_hook(lambda module, args, output: kept.append((output, output.clone())))
        for layer in model.model.layers
        for module in (layer.mlp, layer.self_attn.o_proj)
    ]
    recorded = model(ids).logits
    kept.clear()
    captured = {}

    def capture(name: str) -> Callable:
        def hook(module, args):
            captured[name] = args

        return hook

    hooks.append(model.model.layers[3].attn_residual.register_forward_pre_hook(capture("third step")))
    hooks.append(model.model.output_residual.register_forward_pre_hook(capture("output step")))
    with torch.no_grad():
        unrecorded = model(ids).logits
    for hook in hooks:
        hook.remove()
    assert torch.equal(unrecorded, recorded.detach())
    assert len(kept) == 8 and all(torch.equal(output, copy) for output, copy in kept)
    (state, context) = captured["output step"]
    assert not context.kernels.differentiable and state.partial is None and len(state.blocks) == 3
    # Sublayer 7 is the second block's third step: the sum it received, updated in place by it and sublayer 8,
    # became the block b_2.
    assert state.blocks[2] is captured["third step"][0].partial


@pytest.mark.parametrize("use_reentrant", [True, False])
@pytest.mark.parametrize("mode", ["standard", "block"])
def test_gradient_checkpointing_gives_the_same_gradients(use_reentrant, mode):
    model = trained_model(residual_mode=mode, block_size=3, num_local_experts=4 if mode == "block" else 0)
    model.train()
    ids = input_batch(model.config)

    def gradients() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(ids, labels=ids, use_cache=False).loss.backward()
        return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    plain = gradients()
    enable_activation_checkpointing(model, use_reentrant)
    checkpointed = gradients()
    disable_activation_checkpointing(model)
    assert plain.keys() == checkpointed.keys()
    if mode == "block":  # the depth parameters are reached through the positional depth state
        assert any(name.endswith("pseudo_query") for name in plain)
        assert "model.layers.0.attn_residual.query.pseudo_query" in checkpointed
    for name in plain:
        assert max_diff(plain[name], checkpointed[name]) <= 1e-6, name


@pytest.mark.parametrize("mode", ["standard", "full", "block", "hc"])
def test_logits_to_keep_computes_the_output_at_the_kept_positions_only(mode):
    """Every form of `logits_to_keep` gives the full forward's logits at those positions; under AttnRes the output
    step reads its sources at the kept positions alone (prefill keeps the last one). Recorded hidden states span
    every position, as Llama's do, so recording runs the output step at every position besides."""
    model = trained_model(residual_mode=mode, block_size=3)
    ids = input_batch(model.config)
    mask = torch.zeros(ids.shape, dtype=torch.bool)
    mask[0, 2] = mask[1, 5] = mask[1, 9] = True
    output_step_tokens = []
    model.model.output_residual.register_forward_pre_hook(
        lambda module, args: output_step_tokens.append(args[0][0][-1].shape[:-1])
    )
    with torch.no_grad():
        full = model(ids).logits
        for keep, expected in [(1, full[:, -1:]), (3, full[:, -3:]), (torch.tensor([0, 4]), full[:, [0, 4]])]:
            assert max_diff(model(ids, logits_to_keep=keep).logits, expected) <= 1e-6
        kept = model(ids, logits_to_keep=mask).logits
        assert kept.shape == (3, model.config.vocab_size) and max_diff(kept, full[mask]) <= 1e-6
        assert max_diff(model(ids, logits_to_keep=99).logits, full) == 0
        last_hidden = model.model(ids, logits_to_keep=2).last_hidden_state
        assert max_diff(last_hidden, model.model(ids).last_hidden_state[:, -2:]) <= 1e-6
        recorded = model(ids, logits_to_keep=1, output_hidden_states=True)
    assert max_diff(recorded.logits, full[:, -1:]) <= 1e-6 and recorded.hidden_states[-1].shape[1] == ids.shape[1]
    if mode in ("full", "block"):
        assert output_step_tokens == [(2, 11), (2, 1), (2, 3), (2, 2), (3,), (2, 11), (2, 2), (2, 11), (2, 1), (2, 11)]


def test_sequence_classification():
    model = trained_model()
    ids = input_batch(model.config)
    classifier = AutoModelForSequenceClassification.from_config(tiny_config(num_labels=3)).eval()
    classifier.model.load_state_dict(model.model.state_dict())
    with torch.no_grad():
        scores = classifier(ids, labels=torch.tensor([0, 2])).logits
    assert scores.shape == (2, 3)


def test_tied_embeddings_share_storage():
    model = AttnResForCausalLM(tiny_config(tie_word_embeddings=True))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_torch_compile_fullgraph_traces_every_mode(monkeypatch):
    """Compiled graphs run the PyTorch implementation of the two phases (on a CPU, eager inference takes the fused
    C++ kernels), so the eager model is compared on the PyTorch path. Standard mode computes the same operations
    compiled, bit for bit; Full and Block compiled run phase 1 in its padded form, sums of products where the eager
    path multiplies matrices, so they agree to fp32 rounding (1e-5, `test_padded_phase1_matches_the_reference`'s
    bound; the random models' logits differ by up to about 1e-6)."""
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
    for mode in ("standard", "full", "block"):
        model = trained_model(residual_mode=mode, block_size=3)
        ids = input_batch(model.config)
        torch._dynamo.reset()
        compiled = torch.compile(model, fullgraph=True, backend="eager")
        with torch.no_grad():
            difference = max_diff(compiled(ids).logits, model(ids).logits)
        assert difference == 0 if mode == "standard" else difference <= 1e-5


def with_engine_norms(model: AttnResForCausalLM) -> AttnResForCausalLM:
    """`model` with every RMSNorm replaced by Llama's, holding the same gain and eps, as vLLM's Transformers backend
    swaps in its own: the depth-attention steps then hand each norm its input computed (phase 2 alone)."""
    for module in list(model.modules()):
        for name, norm in list(module.named_children()):
            if isinstance(norm, AttnResRMSNorm):
                replacement = LlamaRMSNorm(norm.weight.shape[0], eps=norm.variance_epsilon)
                replacement.weight.data.copy_(norm.weight.data)
                setattr(module, name, replacement)
    return model


@pytest.mark.parametrize("exact_retrofit", [False, True])
@pytest.mark.parametrize("kernel", ["reference", "auto"])
def test_engine_norms_compute_the_model_function(kernel, exact_retrofit, monkeypatch, tmp_path):
    """An engine's norms, holding the model's gains and eps, read each step's input computed (`k * h` under the exact
    retrofit, design.md §5) where the model's own fuse it: the same logits, within 1e-5 in fp32 (a large eps makes
    a misplaced k visible), and in bf16 within `assert_bf16_tracks`' documented tolerance of fp32. The engine's
    model is loaded from a saved checkpoint, where k, a buffer the checkpoint does not hold, is initialised anew."""
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", kernel)
    model = trained_model(residual_mode="block", block_size=3, exact_retrofit=exact_retrofit, rms_norm_eps=1e-2)
    model.save_pretrained(tmp_path)
    engine = with_engine_norms(AttnResForCausalLM.from_pretrained(tmp_path).eval())
    steps = [module for module in engine.modules() if hasattr(module, "output_scale_tensor")]
    assert len(steps) == 2 * model.config.num_hidden_layers + 1
    assert any(step.output_scale > 1 for step in steps) == exact_retrofit
    for step in steps:
        scale = step.output_scale_tensor
        assert scale.item() == step.output_scale if step.output_scale != 1 else scale is None
    ids = input_batch(model.config, length=16)
    with torch.no_grad():
        expected = model(ids).logits
        assert max_diff(engine(ids).logits, expected) <= 1e-5
    assert_bf16_tracks(engine, ids)


@pytest.mark.parametrize("dynamic", [False, True, "tokens"])
def test_torch_compile_traces_phase_1_once_for_every_block(dynamic, monkeypatch):
    """Under torch.compile, phase 1 is one nested compile region (`kernel_dispatch.compiled_torch_kernels`): the
    graph calls one traced subgraph for every block's phase 1 and the output's (over the blocks padded to their final
    number), and no other. Static shapes, `dynamic=True` (where eps is a symbolic float) and a dynamic token axis (as
    vLLM marks it) alike; the compiled model computes the eager one's logits, within 1e-5 as the two-phase form is of
    the naive one (the padded phase 1 is another exact form, `test_padded_phase1_matches_the_reference`)."""
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
    model = trained_model(residual_mode="block", block_size=3, num_hidden_layers=6, exact_retrofit=True)
    model = with_engine_norms(model)
    ids = input_batch(model.config)
    graphs = []

    def keep_graph(graph_module: torch.fx.GraphModule, example_inputs) -> Callable:
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    shapes = {False: False, True: True, "tokens": None}[dynamic]  # None: dynamic where marked
    compiled = torch.compile(model, fullgraph=True, backend=keep_graph, dynamic=shapes)
    if dynamic == "tokens":
        torch._dynamo.mark_dynamic(ids, 1)
    with torch.no_grad():
        assert max_diff(compiled(ids).logits, model(ids).logits) <= 1e-5
    (graph,) = graphs
    regions = [node for node in graph.graph.nodes if node.target is torch.ops.higher_order.invoke_subgraph]
    assert len({node.args[0].target for node in regions}) == 1
    assert len(regions) == 5  # 12 sublayers in blocks of 3: phase 1 for each of 4 blocks and for the output


@pytest.mark.parametrize("engine_norms", [True, False])
def test_inductor_compiles_no_kernel_per_step_or_block(engine_norms, monkeypatch):
    """Inductor generates and compiles each distinct kernel once, and a step's kernels are the same code as any
    other's as long as everything it reads is a tensor of its own (its query, its row of phase 1, its output scale):
    a row of a larger tensor would put its offset into the kernel's code. So a model twice as deep compiles the same
    number of kernels: none per step, and none per block (phase 1 is one region over the blocks padded to their
    final number). With an engine's norms and an exact retrofit (vLLM's case, dynamic tokens as vLLM marks them),
    and with the model's own fused norms, whose eps an exact retrofit varies per step (docs/design.md §5), without.
    The compiled logits are the eager ones within 1e-5."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
    kernels = []
    for num_hidden_layers in (3, 6):
        model = trained_model(
            residual_mode="block", block_size=3, num_hidden_layers=num_hidden_layers, exact_retrofit=engine_norms
        )
        if engine_norms:
            model = with_engine_norms(model)
        ids = input_batch(model.config)
        compiled = torch.compile(model, fullgraph=True, dynamic=None)
        torch._dynamo.mark_dynamic(ids, 1)
        # No cached graph, so that the code is generated; the compiled C++ kernels are cached and shared (their
        # source names no step), so the deeper model compiles none anew.
        no_graph_cache = torch._inductor.config.patch(fx_graph_cache=False)
        with torch.no_grad(), no_graph_cache, torch._functorch.config.patch(enable_autograd_cache=False):
            logits, (code,) = run_and_get_code(lambda: compiled(ids).logits)
            assert max_diff(logits, model(ids).logits) <= 1e-5
        kernels.append(code.count("async_compile.cpp_pybinding("))
    assert kernels[0] == kernels[1], kernels


@pytest.mark.parametrize("num_hidden_layers, block_size", [(1, 2), (2, 4)])
def test_inductor_compiled_one_token_equals_eager(num_hidden_layers, block_size):
    """Compiled with static shapes at one token (a decode step's shape), the logits are the eager ones within 1e-5.
    At one token each query's row of phase 1 is contiguous however it is laid out, the case in which a view returned
    from phase 1's region would be reused by inductor as a larger buffer (`two_phase_torch.padded_phase1`): here a
    single block, and the output step's phase 1."""
    model = trained_model(residual_mode="block", block_size=block_size, num_hidden_layers=num_hidden_layers)
    ids = input_batch(model.config, batch=1, length=1)
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    with torch.no_grad():
        for _ in range(3):
            assert max_diff(compiled(ids, use_cache=False).logits, model(ids, use_cache=False).logits) <= 1e-5


@pytest.mark.parametrize("kernel", ["reference", "auto", "cpu"])
@pytest.mark.parametrize("residual_mode", ["block", "full", "standard", "mhc"])
def test_output_hidden_states_change_no_output_and_are_the_inputs_each_layer_reads(kernel, residual_mode, monkeypatch):
    """Recording computes each step's input `h` besides the fused last phase + norm the model goes on with, so the
    logits are bit-equal on every implementation of the two phases (Triton's: test_kernels.py)."""
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", kernel)
    model = trained_model(residual_mode=residual_mode, block_size=2)
    ids = input_batch(model.config)
    inputs = []
    hooks = [
        layer.attn_residual.register_forward_hook(lambda m, a, out: inputs.append(out)) for layer in model.model.layers
    ]
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for hook in hooks:
        hook.remove()
    with torch.no_grad():
        unrecorded = model(ids)
        last_only = model(ids, logits_to_keep=1)
        last_only_recorded = model(ids, logits_to_keep=1, output_hidden_states=True)
    assert torch.equal(out.logits, unrecorded.logits)
    assert torch.equal(last_only_recorded.logits, last_only.logits)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    for recorded, expected in zip(out.hidden_states[:-1], inputs):
        expected = expected.value() if isinstance(expected, PendingInput) else expected
        assert torch.equal(recorded, expected)
    assert torch.equal(out.hidden_states[-1], model.model(ids).last_hidden_state)


def test_moe_training_loss_includes_the_router_aux_loss():
    model = trained_model(num_local_experts=4, num_experts_per_tok=2, router_aux_loss_coef=0.5)
    ids = input_batch(model.config)
    with torch.no_grad():
        with_aux = model(ids, labels=ids, output_router_logits=True)
        without = model(ids, labels=ids, output_router_logits=False)
    assert with_aux.aux_loss is not None and without.aux_loss is None
    assert with_aux.loss.item() == pytest.approx(without.loss.item() + 0.5 * with_aux.aux_loss.item(), rel=1e-6)


# ---------------------------------------------------------------------------------------------------- numerics


def test_bf16_tracks_fp32():
    model = trained_model(residual_mode="block", block_size=3)
    assert_bf16_tracks(model, input_batch(model.config, batch=2, length=16))


def assert_bf16_tracks(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """bf16 keeps 8 bits of mantissa (relative step 2**-8 = 0.0039); over 6 sublayers of a random tiny model the
    logits (std ~0.2-1) drift by a few bf16 steps. Documented tolerance: max |dlogit| <= 0.1, mean <= 0.01, and
    greedy tokens agree on >= 95% of positions. Depth logits and merges stay in fp32 in both. Leaves `model` in
    bf16."""
    with torch.no_grad():
        reference = model.float()(ids).logits
        low = model.to(torch.bfloat16)(ids).logits.float()
    difference = (low - reference).abs()
    assert difference.max().item() <= 0.1
    assert difference.mean().item() <= 0.01
    assert (low.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.95


# ----------------------------------------------------------------------------------------- save / load / remote


def test_save_load_round_trip_is_bit_identical(tmp_path):
    model = trained_model(num_local_experts=4)
    model.save_pretrained(tmp_path)
    for name in ("configuration_attnres.py", "modeling_attnres.py", "depth_mixing.py", "two_phase.py"):
        assert (tmp_path / name).is_file(), name
    config = AutoConfig.from_pretrained(tmp_path)
    assert set(config.auto_map) >= {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(loaded, AttnResForCausalLM)
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name
    ids = input_batch(model.config)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert isinstance(AutoModel.from_pretrained(tmp_path), AttnResModel)


def test_device_map_auto_loads_and_matches(tmp_path):
    """A memory cap forces accelerate to offload part of the model to disk and run it through its hooks."""
    model = trained_model(hidden_size=256, intermediate_size=512, num_local_experts=2, num_experts_per_tok=1)
    model.save_pretrained(tmp_path / "ckpt")
    half = sum(p.numel() * p.element_size() for p in model.parameters()) // 2
    loaded = AutoModelForCausalLM.from_pretrained(
        tmp_path / "ckpt", device_map="auto", max_memory={"cpu": half}, offload_folder=tmp_path / "offload"
    ).eval()
    assert "disk" in loaded.hf_device_map.values() and "cpu" in loaded.hf_device_map.values()
    ids = input_batch(model.config)
    with torch.no_grad():
        assert max_diff(loaded(ids).logits, model(ids).logits) <= 1e-6
    kwargs = dict(max_new_tokens=6, do_sample=False)
    assert torch.equal(loaded.generate(ids[:1], **kwargs), model.generate(ids[:1], **kwargs))


# ------------------------------------------------------------------------------------------------ config errors


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("residual_mode", "dense", "'standard' | 'full' | 'block'"),
        ("block_size", 0, "from 1 to 2 * num_hidden_layers = 6"),
        ("block_size", 7, "from 1 to 2 * num_hidden_layers = 6"),
        ("num_key_value_heads", 3, "divisor of num_attention_heads"),
        ("hidden_size", 0, "positive integer"),
        ("num_hidden_layers", -1, "positive integer"),
        ("rms_norm_eps", -1.0, ">= 0"),
        ("attention_dropout", 1.5, "[0, 1]"),
        ("num_local_experts", -2, "positive integer"),
        ("num_experts_per_tok", 5, "from 1 to num_local_experts"),
        ("router_jitter_noise", -0.1, ">= 0"),
        ("sliding_window", 0, "positive integer"),
        ("sliding_window", 4, "must be None: family 'llama' has no such field"),
        ("depth_kernel", "cuda", "'auto' | 'reference'"),
        ("head_dim", 7, "even integer"),
    ],
)
def test_invalid_config_field_raises_naming_it(field, value, message):
    overrides = {field: value}
    if field in ("num_local_experts", "num_experts_per_tok", "router_jitter_noise"):
        overrides = {"family": "mixtral", "num_local_experts": 4, **overrides}
    elif field == "sliding_window":  # a window of 0 in the family that has one, any in one that has none
        overrides["family"] = "mistral" if value == 0 else "llama"
    with pytest.raises(ValueError) as error:
        tiny_config(**overrides)
    assert f"AttnResConfig.{field}=" in str(error.value)
    assert message in str(error.value)


@pytest.mark.parametrize("num_layers", range(1, 65))
def test_default_block_size_is_whole_layers_about_eight_blocks(num_layers):
    config = AttnResConfig(num_hidden_layers=num_layers, hidden_size=64, num_attention_heads=4, intermediate_size=128)
    num_blocks = math.ceil(config.num_sublayers / config.block_size)
    assert config.block_size % 2 == 0  # no block splits a decoder layer
    nearest = min(abs(math.ceil(num_layers / n) - 8) for n in range(1, num_layers + 1))
    assert abs(num_blocks - 8) == nearest
    assert num_blocks == num_layers if num_layers <= 8 else 6 <= num_blocks <= 10


@pytest.mark.parametrize("num_layers,block_size", [(4, 2), (9, 2), (12, 4), (28, 8), (30, 8), (32, 8), (36, 10)])
def test_default_block_size_at_common_depths(num_layers, block_size):
    assert AttnResConfig(num_hidden_layers=num_layers, hidden_size=64, num_attention_heads=4).block_size == block_size


def test_explicit_and_saved_block_sizes_load_unchanged(tmp_path):
    """A checkpoint records its block size, so one saved under another default (here the odd 7 that
    `ceil(2L / 8)` gave 27 layers) loads with the block size it was trained with."""
    config = AttnResConfig(num_hidden_layers=27, hidden_size=64, num_attention_heads=4, block_size=7)
    assert config.block_size == 7
    config.save_pretrained(tmp_path)
    assert AttnResConfig.from_pretrained(tmp_path).block_size == 7
    assert AttnResConfig(num_hidden_layers=27, hidden_size=64, num_attention_heads=4).block_size == 8
