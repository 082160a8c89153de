"""`attnres inspect` at a tiny size: the pictures exist, and the numbers behind them are what they claim to be."""

import json
import math

import pytest
import torch

from attnres import AttnResForCausalLM
from attnres.analysis import depth_profile
from attnres.training import depth_attention_table
from attnres_cli import main

from conftest import randomize_depth_parameters, tiny_config


PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer."


def byte_level(**overrides) -> AttnResForCausalLM:
    model = AttnResForCausalLM(tiny_config(vocab_size=256, **overrides)).eval()
    randomize_depth_parameters(model)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("inspect")
    byte_level(residual_mode="standard").save_pretrained(folder / "baseline")
    byte_level(residual_mode="block", block_size=2).save_pretrained(folder / "block")
    return folder


def test_inspect_command_writes_the_pictures_for_two_models(checkpoints, tmp_path, capsys):
    status = main(
        [
            "inspect",
            str(checkpoints / "baseline"),
            str(checkpoints / "block"),
            "--text",
            TEXT,
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert status == 0
    for name in ("depth_attention.png", "magnitudes.png", "gradient_norms.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC, name
    profiles = json.loads((tmp_path / "profiles.json").read_text())
    assert [p["label"] for p in profiles] == ["baseline", "block"]
    assert profiles[0]["attention_weights"] == {}  # a PreNorm model has no depth attention
    assert len(profiles[1]["attention_weights"]) == 7  # 6 sublayers and the output
    assert "block: block, 6 sublayers" in capsys.readouterr().out


def test_inspect_command_reports_invalid_input(checkpoints, tmp_path, capsys):
    status = main(["inspect", str(checkpoints / "block"), "--text", "x", "--output-dir", str(tmp_path)])
    assert status == 2 and "at least 2 tokens" in capsys.readouterr().err


def test_profile_numbers_are_the_model_s():
    model = byte_level(residual_mode="block", block_size=2)
    ids = torch.tensor([list(TEXT.encode())])
    profile = depth_profile(model, ids, label="block")
    assert profile.num_sublayers == 6 and profile.num_tokens == ids.shape[1]
    assert all(p.grad is None for p in model.parameters()) and not model.training  # the model is left as it was

    # Depth attention: distributions over the docs/design.md §4 sources, on the grid `attnres demo` draws too.
    for weights in profile.attention_weights.values():
        assert sum(weights) == pytest.approx(1.0, abs=1e-5) and min(weights) >= 0
    table = profile.depth_attention()
    assert table.steps == ["attn 0", "mlp 0", "attn 1", "mlp 1", "attn 2", "mlp 2", "output"]
    assert table.sources == ["b0 (embedding)", "b1", "b2", "b3", "partial"]
    assert table.values[0, 0] == 1.0 and table.values[0, 1:].isnan().all()  # sublayer 1 reads the embedding only
    assert table.values[1, 0] + table.values[1, -1] == pytest.approx(1.0)  # then b0 and its block's partial sum
    assert table.values[-1, :4].sum() == pytest.approx(1.0) and math.isnan(table.values[-1, -1])  # output: blocks
    torch.testing.assert_close(table.values.nansum(dim=1), torch.ones(7))

    # Magnitudes: the RMS of exactly what the sublayers read and wrote.
    outputs = []
    hooks = [layer.mlp.register_forward_hook(lambda m, a, out: outputs.append(out)) for layer in model.model.layers]
    with torch.no_grad():
        logits = model(ids).logits
    for hook in hooks:
        hook.remove()
    for index, output in enumerate(outputs):
        assert profile.output_rms[2 * index + 1] == pytest.approx(output.pow(2).mean().sqrt().item(), rel=1e-5)
    assert all(v > 0 and math.isfinite(v) for v in profile.input_rms + profile.output_rms)
    loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:]).item()
    assert profile.loss == pytest.approx(loss, rel=1e-5)

    # Gradient norms: the norm of the loss gradient with respect to each sublayer's own weights and pre-norm.
    model.zero_grad()
    torch.nn.functional.cross_entropy(model(ids).logits[0, :-1], ids[0, 1:]).backward()
    layer = model.model.layers[1]
    mlp_params = [*layer.post_attention_layernorm.parameters(), *layer.mlp.parameters()]
    expected = torch.cat([p.grad.flatten() for p in mlp_params]).norm().item()
    assert profile.gradient_norms[3] == pytest.approx(expected, rel=1e-4)
    assert all(v > 0 and math.isfinite(v) for v in profile.gradient_norms)


@pytest.mark.parametrize("mode", ["block", "full"])
def test_inspect_and_the_demo_draw_the_same_grid(mode):
    """`attnres inspect` (a profile) and `attnres demo` (the retrofit's table) name and place the sources alike."""
    model = byte_level(residual_mode=mode, block_size=2)
    ids = torch.tensor([list(TEXT.encode())])
    inspected, demo = depth_profile(model, ids).depth_attention(), depth_attention_table(model, ids)
    assert inspected.steps == demo.steps and inspected.sources == demo.sources
    torch.testing.assert_close(inspected.values, demo.values, equal_nan=True)
    # Full AttnRes: every sublayer is a block, so no step reads a partial sum.
    assert inspected.sources[-1] == ("partial" if mode == "block" else "b6")
