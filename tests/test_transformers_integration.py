"""AttnRes reached through code written for Transformers rather than for it: the deprecated `past_key_values` name,
attention backends registered with `AttentionInterface`, and continuous batching (`generate_batch`)."""

import inspect
import warnings

import pytest
import torch
from transformers import (
    AttentionInterface,
    AttentionMaskInterface,
    DynamicCache,
    GenerationConfig,
    LlamaForCausalLM,
    LlamaForSequenceClassification,
    LlamaModel,
    MixtralForCausalLM,
    MixtralModel,
)
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from attnres import AttnResForCausalLM, AttnResForSequenceClassification, AttnResModel
from attnres.transformers_compat import CACHE_NAME

from conftest import max_diff, randomize_depth_parameters, tiny_config


def trained(**overrides) -> AttnResForCausalLM:
    model = AttnResForCausalLM(tiny_config(**overrides)).eval()
    randomize_depth_parameters(model)
    return model


def prompt_ids(model: AttnResForCausalLM, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, length), generator=generator)


# ------------------------------------------------------------------------------------------ past_key_values


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (AttnResModel, LlamaModel),
        (AttnResModel, MixtralModel),
        (AttnResForCausalLM, LlamaForCausalLM),
        (AttnResForCausalLM, MixtralForCausalLM),
        (AttnResForSequenceClassification, LlamaForSequenceClassification),
    ],
)
def test_forward_names_every_argument_llama_and_mixtral_name(ours, theirs):
    """An argument Llama or Mixtral names but ours leaves to `**kwargs` would be swallowed without effect."""

    def named(model_class: type) -> set[str]:
        parameters = inspect.signature(model_class.forward).parameters.items()
        return {name for name, parameter in parameters if parameter.kind is not parameter.VAR_KEYWORD}

    # Before Transformers 5.20 Llama names the cache `past_key_values`, which ours takes through its decorator.
    assert named(theirs) <= named(ours) | {"past_key_values"}


@pytest.mark.parametrize("model_class", [AttnResForCausalLM, AttnResModel])
def test_past_key_values_is_the_cache_with_a_deprecation_warning(model_class):
    """Code written for Transformers before 5.20 passes `past_key_values`: it must fill that cache and the next step
    must continue from it, as `cache=` does, with Transformers' deprecation warning from 5.20 on (before it, the name
    is current and `generate` passes it itself)."""
    config = tiny_config()
    model = model_class(config).eval()
    randomize_depth_parameters(model)
    ids = prompt_ids(AttnResForCausalLM(config), 9, seed=3)
    output = (lambda out: out.logits) if model_class is AttnResForCausalLM else (lambda out: out.last_hidden_state)
    with torch.no_grad():
        full = output(model(ids))
        cache = DynamicCache(config=config)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            first = output(model(ids[:, :7], past_key_values=cache, use_cache=True))
        assert cache.get_seq_length() == 7
        warned = any("`past_key_values` is deprecated" in str(w.message) for w in caught)
        assert warned == (CACHE_NAME == "cache")
        rest = output(model(ids[:, 7:], past_key_values=cache, use_cache=True))
    assert max_diff(torch.cat([first, rest], 1), full) <= 1e-5


# ------------------------------------------------------------------------------------ attention backends


@pytest.mark.parametrize("mode", ["block", "standard"])
def test_registered_attention_function_is_called_by_every_layer(tmp_path, mode):
    """Paged attention, vLLM's Transformers backend and others plug in through `AttentionInterface`: selected by
    `attn_implementation`, the registered function must be the one every layer calls, with the arguments SDPA gets.
    Its mask format is registered under the same name, as Transformers asks of a backend that takes a mask."""
    calls = []

    def recording_sdpa(module, query, key, value, attention_mask, **kwargs):
        calls.append((module.layer_idx, sorted(kwargs)))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("attnres_test_recording_sdpa", recording_sdpa)
    AttentionMaskInterface.register("attnres_test_recording_sdpa", sdpa_mask)
    trained(residual_mode=mode, sliding_window=5).save_pretrained(tmp_path)
    custom = AttnResForCausalLM.from_pretrained(tmp_path, attn_implementation="attnres_test_recording_sdpa").eval()
    sdpa = AttnResForCausalLM.from_pretrained(tmp_path, attn_implementation="sdpa").eval()
    ids = prompt_ids(custom, 8, seed=5)
    with torch.no_grad():
        custom_logits, sdpa_logits = custom(ids).logits, sdpa(ids).logits
    assert [layer for layer, _ in calls] == list(range(custom.config.num_hidden_layers))
    assert all({"dropout", "scaling", "sliding_window"} <= set(kwargs) for _, kwargs in calls)
    assert torch.equal(custom_logits, sdpa_logits)

    calls.clear()
    generated = custom.generate(ids, max_new_tokens=4, do_sample=False)
    assert len(calls) == 4 * custom.config.num_hidden_layers  # the prefill and three cached steps
    assert torch.equal(generated, sdpa.generate(ids, max_new_tokens=4, do_sample=False))


# ------------------------------------------------------------------------------------ continuous batching


CACHE_PAGES = 16  # the continuous-batching tests' paged cache, in pages of 256 tokens (`generate_batch_equals_generate`)


def generate_batch_equals_generate(model: AttnResForCausalLM, prompts: list[list[int]], max_new_tokens: int) -> None:
    """`generate_batch` (paged attention, the prompts packed into one batch) against `generate`, prompt by prompt."""
    from transformers import ContinuousBatchingConfig  # Transformers >= 5.20

    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    # A paged cache of `CACHE_PAGES` pages: left to size itself, it takes 60% of the memory free on a CPU, which a test
    # cannot take while another worker's runs beside it.
    paged = ContinuousBatchingConfig(num_blocks=CACHE_PAGES)
    results = model.generate_batch(prompts, generation_config=config, continuous_batching_config=paged)
    by_prompt = {tuple(result.prompt_ids): result.generated_tokens for result in results.values()}
    assert len(by_prompt) == len(prompts)
    for prompt in prompts:
        expected = model.generate(torch.tensor([prompt]), generation_config=config)[0, len(prompt) :].tolist()
        assert by_prompt[tuple(prompt)] == expected, prompt


needs_continuous_batching = pytest.mark.skipif(
    CACHE_NAME != "cache", reason="continuous batching needs Transformers >= 5.20 (attnres/transformers_compat.py)"
)


@needs_continuous_batching
@pytest.mark.parametrize(
    "overrides", [dict(residual_mode="block"), dict(residual_mode="full", num_local_experts=4, num_experts_per_tok=2)]
)
def test_continuous_batching_equals_generate(overrides):
    model = trained(**overrides)
    prompts = [prompt_ids(model, length, seed).tolist()[0] for length, seed in ((5, 1), (3, 2), (9, 3))]
    generate_batch_equals_generate(model, prompts, max_new_tokens=8)


@pytest.mark.skipif(CACHE_NAME == "cache", reason="Transformers >= 5.20 runs continuous batching (test above)")
def test_continuous_batching_is_refused_in_one_line_before_transformers_5_20(caplog):
    """Its generation thread logs the model's error instead of raising it, and returns no result."""
    model = trained(residual_mode="block")
    results = model.generate_batch([[1, 2, 3]], generation_config=GenerationConfig(max_new_tokens=2, do_sample=False))
    assert not results
    assert "continuous batching (generate_batch) needs transformers>=5.20" in caplog.text
