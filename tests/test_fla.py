"""FLA's AttnRes checkpoints in and out, against FLA's own model (flash-linear-attention 0.6.0 from PyPI): FLA ->
attnres -> FLA gives FLA's logits and FLA's weights back bit for bit, for Full AttnRes and blocks of 2 and 4
sublayers; what either side cannot represent is refused in one line.

FLA's model needs flash-attn and Triton kernels, so it runs here on the torch references that the verification of
FLA conversions uses (`attnres.conversion.fla_reference`: FLA's own references, SDPA for flash-attn).
"""

import os
import subprocess
import sys

import pytest
import torch

import attnres_cli
from attnres import AttnResForCausalLM
from attnres.conversion import ConversionError, convert, export
from attnres.conversion.fla_reference import fla_on_torch
from conftest import TINY_SHAPE, randomize_depth_parameters, tiny_config


try:
    from fla.models import TransformerConfig, TransformerForCausalLM
except ImportError as error:
    if os.environ.get("ATTNRES_REQUIRE_ENGINES") == "1":  # scripts/test.sh installs FLA, and so requires it
        raise
    pytest.skip(f"FLA is not importable ({error}): bash scripts/setup.sh", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def fla_on_this_cpu():
    with fla_on_torch():
        yield


def fla_model(folder, block_size: int, **overrides) -> TransformerForCausalLM:
    """A tiny FLA AttnRes Transformer with trained-looking depth parameters and norms, saved to `folder`."""
    torch.manual_seed(block_size)
    fields = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_heads=4,
        num_kv_heads=2,
        vocab_size=101,
        max_position_embeddings=128,
        attnres_block_size=block_size,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = TransformerForCausalLM(TransformerConfig(**{**fields, **overrides})).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "res_" in name or name.endswith("norm.weight") or name.endswith("bias"):
                parameter.normal_()
    model.save_pretrained(folder)
    return model


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, use_cache=False).logits


IDS = torch.randint(101, (2, 13), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize(
    "block_size,overrides",
    [(1, {}), (2, {}), (4, {}), (2, dict(tie_word_embeddings=True, qkv_bias=True, window_size=5))],
    ids=["full", "block-2", "block-4", "block-2-tied-qkv-bias-window"],
)
def test_fla_round_trip_is_exact(tmp_path, block_size, overrides):
    original = fla_model(tmp_path / "fla", block_size, **overrides)
    report = convert(tmp_path / "fla", tmp_path / "attnres", progress=False)
    assert report.residual_mode == ("full" if block_size == 1 else "block") and report.block_size == block_size
    assert report.verification.passed and report.verification.max_abs_logit_diff <= 1e-5, report.format()
    converted = AttnResForCausalLM.from_pretrained(tmp_path / "attnres").eval()
    window, qkv_bias = overrides.get("window_size"), overrides.get("qkv_bias", False)
    assert converted.config.family == ("qwen2" if qkv_bias else "mistral" if window else "llama")
    assert getattr(converted.config, "sliding_window", None) == window
    torch.testing.assert_close(logits(converted, IDS), logits(original, IDS), atol=1e-5, rtol=0)

    exported = export(tmp_path / "attnres", tmp_path / "fla-again", to="fla")
    assert exported.verification.passed and exported.verification.max_abs_logit_diff <= 1e-5, exported.format()
    again = TransformerForCausalLM.from_pretrained(tmp_path / "fla-again").eval()
    assert again.config.attnres_block_size == block_size
    before, after = original.state_dict(), again.state_dict()
    assert before.keys() == after.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name
    assert torch.equal(logits(again, IDS), logits(original, IDS))


def test_an_attnres_model_exports_to_fla_and_back(tmp_path):
    """The other way: a model trained here (Block, blocks of whole layers) goes to FLA and returns bit-equal."""
    model = AttnResForCausalLM(tiny_config(num_hidden_layers=4, block_size=4)).eval()
    randomize_depth_parameters(model)
    model.save_pretrained(tmp_path / "ours")
    report = export(tmp_path / "ours", tmp_path / "fla", to="fla")
    assert report.verification.passed and report.verification.max_abs_logit_diff <= 1e-5, report.format()
    torch.testing.assert_close(
        logits(TransformerForCausalLM.from_pretrained(tmp_path / "fla").eval(), IDS % 96),
        logits(model, IDS % 96),
        atol=1e-5,
        rtol=0,
    )
    convert(tmp_path / "fla", tmp_path / "back", progress=False)
    back = AttnResForCausalLM.from_pretrained(tmp_path / "back")
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_a_converted_llama_exports_without_the_retrofit_only_when_asked(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(**{**TINY_SHAPE, "num_hidden_layers": 4})).save_pretrained(tmp_path / "llama")
    convert(tmp_path / "llama", tmp_path / "converted", block_size=4, progress=False)
    refusal = r"AttnResConfig.exact_retrofit=True: FLA has no scale on a step's output"
    with pytest.raises(ConversionError, match=refusal):
        export(tmp_path / "converted", tmp_path / "fla", to="fla")
    assert not (tmp_path / "fla").exists()
    report = export(tmp_path / "converted", tmp_path / "fla", to="fla", drop_exact_retrofit=True)
    assert 0 < report.retrofit_deviation < 1e-2 and report.verification.passed, report.format()
    assert "exact retrofit  dropped" in report.format()


FLA_REFUSALS = {
    "qk_norm": (dict(qk_norm=True), "FLA config qk_norm=True"),
    "activation": (dict(hidden_act="powlu"), "FLA config hidden_act='powlu'"),
    "no attnres": (dict(attnres_block_size=None), "FLA config attnres_block_size=None"),
}


@pytest.mark.parametrize("case", FLA_REFUSALS)
def test_what_attnres_cannot_represent_is_refused_in_one_line(tmp_path, case, capsys):
    overrides, message = FLA_REFUSALS[case]
    fla_model(tmp_path / "fla", 2, **overrides)
    capsys.readouterr()  # what saving the model printed
    status = attnres_cli.main(["convert", str(tmp_path / "fla"), str(tmp_path / "out")])
    error = capsys.readouterr().err
    assert status == 2 and message in error and len(error.strip().splitlines()) == 1, error
    assert not (tmp_path / "out").exists()


def test_another_fla_family_and_a_contradicting_block_size_are_refused(tmp_path):
    fla_model(tmp_path / "fla", 2)
    config = (tmp_path / "fla" / "config.json").read_text()
    with pytest.raises(ConversionError, match=r"block_size=4: an FLA checkpoint keeps its own, attnres_block_size=2"):
        convert(tmp_path / "fla", tmp_path / "out", block_size=4, progress=False)
    (tmp_path / "fla" / "config.json").write_text(config.replace('"model_type": "transformer"', '"model_type": "gla"'))
    with pytest.raises(ConversionError, match=r"FLA config model_type='gla': only FLA's 'transformer' family"):
        convert(tmp_path / "fla", tmp_path / "out", progress=False)


EXPORT_REFUSALS = {
    "odd block": (dict(num_hidden_layers=4, block_size=3), "AttnResConfig.block_size=3"),
    "moe": (dict(num_hidden_layers=4, num_local_experts=2, num_experts_per_tok=1), "AttnResConfig.family='mixtral'"),
    "mhc": (dict(residual_mode="mhc"), "AttnResConfig.residual_mode='mhc'"),
}


@pytest.mark.parametrize("case", EXPORT_REFUSALS)
def test_what_fla_cannot_represent_is_refused_in_one_line(tmp_path, case, capsys):
    overrides, message = EXPORT_REFUSALS[case]
    AttnResForCausalLM(tiny_config(**overrides)).save_pretrained(tmp_path / "ours")
    capsys.readouterr()
    status = attnres_cli.main(["export", str(tmp_path / "ours"), str(tmp_path / "fla"), "--to", "fla"])
    error = capsys.readouterr().err
    assert status == 2 and message in error and len(error.strip().splitlines()) == 1, error
    assert not (tmp_path / "fla").exists()


def test_without_fla_only_the_weights_are_mapped_and_the_report_says_so(tmp_path, monkeypatch):
    from attnres.conversion import fla

    fla_model(tmp_path / "fla", 2)
    monkeypatch.setattr(fla, "fla_is_importable", lambda: False)
    report = convert(tmp_path / "fla", tmp_path / "attnres", progress=False)
    assert report.verification is None
    assert "Not verified: FLA (flash-linear-attention) is not importable here, so only the weights" in report.format()
    exported = export(tmp_path / "attnres", tmp_path / "fla-again", to="fla")
    assert exported.verification is None and "only the weights were mapped" in exported.format()


def test_an_fla_checkpoint_converts_verified_without_flash_attn(tmp_path):
    """`attnres convert` of an FLA checkpoint in a fresh process, where nothing is patched and flash-attn is not
    installed (any CPU machine): FLA's model checks the conversion on its torch references, and the FLA modules are
    left as they were."""
    fla_model(tmp_path / "fla", 2)
    probe = (
        "import importlib.util, sys, attnres_cli, fla.layers.attn\n"
        "assert importlib.util.find_spec('flash_attn') is None, 'flash-attn is installed'\n"
        "before = fla.layers.attn.flash_attn_func\n"
        "status = attnres_cli.main(sys.argv[1:])\n"
        "assert fla.layers.attn.flash_attn_func is before\n"
        "sys.exit(status)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, "convert", str(tmp_path / "fla"), str(tmp_path / "attnres")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Converted FLA TransformerForCausalLM" in result.stdout and "result               PASS" in result.stdout
    assert "Please install Flash Attention" not in result.stderr
    assert AttnResForCausalLM.from_pretrained(tmp_path / "attnres").config.depth_block_size == 2


def test_an_fla_version_without_the_reference_points_maps_the_weights_only(tmp_path, monkeypatch, capsys):
    """Where an FLA version has moved a function the torch references replace, the conversion is not run half on
    kernels that cannot run: it maps the weights and says why, in one line of its report."""
    import fla.modules.mlp

    fla_model(tmp_path / "fla", 2)
    monkeypatch.delattr(fla.modules.mlp, "swiglu")
    capsys.readouterr()
    assert attnres_cli.main(["convert", str(tmp_path / "fla"), str(tmp_path / "attnres")]) == 0
    out = capsys.readouterr().out
    reason = "Not verified: FLA 0.6.0 has no fla.modules.mlp.swiglu, where its torch references go, so only the weights"
    assert reason in out, out
    assert (tmp_path / "attnres" / "model.safetensors").is_file()


def test_the_torch_references_nest_and_restore(tmp_path):
    import fla.layers.attn
    import fla.modules.norm.layernorm

    patched = fla.layers.attn.flash_attn_func, fla.modules.norm.layernorm.rms_norm  # by this module's fixture
    with fla_on_torch():
        pass
    assert (fla.layers.attn.flash_attn_func, fla.modules.norm.layernorm.rms_norm) == patched
