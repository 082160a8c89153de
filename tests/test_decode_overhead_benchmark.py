"""The decode-overhead benchmark (benchmarks/decode_overhead.py): its stand-ins replace the same modules in the
family's model and in AttnRes's, so that what remains is the work around them, and it refuses what it cannot stand in
for."""

import json
import subprocess
import sys
from pathlib import Path

import torch

from benchmarks.decode_overhead import AttentionStandIn, FeedForwardStandIn, replaced_modules, with_stand_ins


ROOT = Path(__file__).resolve().parents[1]


def test_stand_ins_leave_standard_mode_equal_to_the_family():
    """With the stand-ins in both, AttnRes standard mode still computes what the family's model computes (the norms,
    the residual sums, the final norm), bit for bit, from the same cache; the family's modules are gone from both."""
    modules = replaced_modules("small-deepseek-v3")
    family, family_cache = with_stand_ins("small-deepseek-v3", "deepseek_v3", modules)
    standard, standard_cache = with_stand_ins("small-deepseek-v3", "standard", modules)
    for model in (family, standard):
        layer = model.model.layers[0]
        assert isinstance(layer.self_attn, AttentionStandIn) and isinstance(layer.mlp, FeedForwardStandIn)
    token, position = torch.tensor([[7]]), torch.tensor([[4]])
    with torch.inference_mode():
        expected = family(token, cache=family_cache, position_ids=position, use_cache=True).logits
        logits = standard(token, cache=standard_cache, position_ids=position, use_cache=True).logits
    assert logits.shape == (1, 1, 8) and torch.equal(logits, expected)


def run(*arguments: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "benchmarks.decode_overhead", *arguments]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_benchmark_writes_every_model_against_the_family(tmp_path):
    output = tmp_path / "decode_overhead.json"
    result = run("--shapes", "small", "--rounds", "5", "--output", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(output.read_text())["rows"]
    assert [row["model"] for row in rows] == ["llama", "standard", "block", "full"]
    assert rows[0]["added_us"] == 0 and all(row["token_us"] > 0 for row in rows)
    assert "| small | block | " in result.stdout


def test_a_shape_with_recurrent_mixers_is_refused_in_one_line():
    result = run("--shapes", "small-qwen3-next", "--rounds", "5")
    assert result.returncode == 2
    assert "argument --shapes: 'small-qwen3-next' has the recurrent module 'linear_attn'" in result.stderr
    assert "Traceback" not in result.stderr
