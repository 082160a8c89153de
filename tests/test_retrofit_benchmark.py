"""The retrofit benchmark with controls (benchmarks/retrofit.py) end to end on a tiny Llama made here (the real run
converts SmolLM2-135M and takes about an hour): its arms train what they say, share their batches and LoRA
initialisation per seed, pick each learning rate on the validation play, and report paired differences."""

import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from attnres.training import shakespeare_plays


RUNNER = Path(__file__).resolve().parents[1] / "benchmarks" / "retrofit.py"
HIDDEN, LAYERS = 32, 2


@pytest.fixture(scope="module")
def retrofit():
    spec = importlib.util.spec_from_file_location("retrofit_benchmark", RUNNER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    """A 2-layer Llama with a word-level tokenizer trained on Hamlet, saved as a Transformers folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"])
    tokenizer.train_from_iterator(shakespeare_plays(["hamlet"])["hamlet"].splitlines(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="</s>")
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=fast.vocab_size,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        eos_token_id=fast.eos_token_id,
        bos_token_id=None,
        pad_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_arms_lrs_seeds_and_paired_differences(retrofit, tiny_llama, tmp_path):
    lrs, seeds = [1e-3, 1e-2], [0, 1]
    argv = [
        "--source", str(tiny_llama), "--steps", "3", "--lrs", *map(str, lrs), "--seeds", *map(str, seeds),
        "--seq-len", "16", "--batch-size", "2", "--validation-windows", "2", "--held-out-windows", "3",
        "--lora-rank", "2", "--block-size", "2", "--output-dir", str(tmp_path), "--name", "tiny",
    ]  # fmt: skip
    report = retrofit.main(argv)

    sublayers = 2 * LAYERS
    counts = report["parameter_counts"]
    assert counts["depth"] == (sublayers + 1) * 2 * HIDDEN  # a pseudo-query and a key norm per mixing step
    assert counts["norms"] == (sublayers + 1) * HIDDEN  # every pre-norm and the final norm
    assert counts["lora_depth"] == counts["lora"] + counts["depth"] and counts["lora"] > 0

    # Exact retrofit: the converted model before training is the source model.
    untrained = report["untrained"]
    for split in ("validation_loss", "held_out_loss"):
        assert untrained["converted"][split] == pytest.approx(untrained["source"][split], abs=1e-5)

    runs = report["runs"]
    trained_arms = ["depth", "norms", "lora_depth", "lora"]
    assert sorted((r["arm"], r["lr"], r["seed"]) for r in runs) == sorted(
        (arm, lr, seed) for arm in trained_arms for lr in lrs for seed in seeds
    )
    for run in runs:
        assert run["trainable_parameters"] == counts[run["arm"]]
        assert run["validation_loss_before"] == pytest.approx(untrained["source"]["validation_loss"], abs=1e-5)
        assert run["validation_loss"] != run["validation_loss_before"] and len(run["train_losses"]) == 3
    # The same LoRA initialisation for both LoRA arms of a seed, a different one for the other seed.
    digest = {(r["arm"], r["seed"]): r["lora_digest"] for r in runs if r["lr"] == lrs[0]}
    for seed in seeds:
        assert digest[("lora", seed)] == digest[("lora_depth", seed)] is not None
        assert digest[("depth", seed)] is None and digest[("norms", seed)] is None
    assert digest[("lora", 0)] != digest[("lora", 1)]

    # Each arm's learning rate is the one of lowest mean validation loss; the held-out play plays no part in it.
    chosen = retrofit.selected_runs(report)
    for arm in trained_arms:
        means = {lr: statistics.mean(r["validation_loss"] for r in runs if r["arm"] == arm and r["lr"] == lr) for lr in lrs}
        assert {r["lr"] for r in chosen[arm].values()} == {min(means, key=means.get)}

    by_pair = {(c["first"], c["second"]): c for c in retrofit.comparisons(report)}
    assert set(by_pair) == set(retrofit.COMPARISONS)
    depth_vs_norms = by_pair[("depth", "norms")]
    expected = [chosen["depth"][s]["held_out_loss"] - chosen["norms"][s]["held_out_loss"] for s in seeds]
    assert depth_vs_norms["differences"] == pytest.approx(expected)
    assert depth_vs_norms["mean"] == pytest.approx(statistics.mean(expected))
    assert depth_vs_norms["critical"] == pytest.approx(12.706)  # two seeds: one degree of freedom
    untrained_held_out = untrained["source"]["held_out_loss"]
    assert by_pair[("depth", "source")]["differences"] == pytest.approx(
        [chosen["depth"][s]["held_out_loss"] - untrained_held_out for s in seeds]
    )

    table = (tmp_path / "tiny.md").read_text()
    for arm in retrofit.ARMS:
        assert f"| {arm.label} |" in table
    assert "| (a) converted, depth parameters − (b) source, RMSNorm gains | 2 |" in table
    assert json.loads((tmp_path / "tiny.json").read_text())["runs"] == runs
    again = tmp_path / "again"
    retrofit.main(["--from-json", str(tmp_path / "tiny.json"), "--output-dir", str(again), "--name", "tiny"])
    assert (again / "tiny.md").read_text() == table


def test_norm_gains_are_the_llama_rms_norms(retrofit):
    assert retrofit.is_norm_gain("model.layers.3.input_layernorm.weight")
    assert retrofit.is_norm_gain("model.layers.3.post_attention_layernorm.weight")
    assert retrofit.is_norm_gain("model.norm.weight")
    assert not retrofit.is_norm_gain("model.layers.3.self_attn.q_proj.weight")
    assert not retrofit.is_norm_gain("model.layers.3.attn_residual.query.key_norm_weight")
