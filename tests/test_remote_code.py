"""A checkpoint's remote code stands on its own: every Auto class the package registers loads from it with
`trust_remote_code=True` alone, in a virtual environment without attnres, and where an `attnres` is importable the
checkpoint's code never imports it, so that a checkpoint computes the same function under any later version; and
checkpoints saved by an earlier version (`tests/fixtures/v0_1_0`) still load and give the logits they gave then.

The environment without attnres is vLLM's (`scripts/setup_engines.sh`, Transformers 5.19, the same torch).
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from attnres import AttnResForCausalLM, AttnResForSequenceClassification
from conftest import randomize_depth_parameters, run_reporting, tiny_config


REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_WITHOUT_ATTNRES = REPO_ROOT / ".engines" / "vllm" / "bin" / "python"
MODES = {
    "block": dict(residual_mode="block", block_size=2),
    "full-moe": dict(residual_mode="full", num_local_experts=4, num_experts_per_tok=2),
    "standard": dict(residual_mode="standard"),
}

# Loads every registered Auto class from the checkpoint's code and compares with what the package computed.
LOAD_SCRIPT = """
import json, sys
import torch
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification
folder, expected_path = sys.argv[1:3]
expected = torch.load(expected_path)
report = {}
config = AutoConfig.from_pretrained(folder + "/causal", trust_remote_code=True)
report["config"] = type(config).__module__
classes = [("causal", AutoModelForCausalLM), ("base", AutoModel), ("classifier", AutoModelForSequenceClassification)]
with torch.no_grad():
    for name, auto in classes:
        model = auto.from_pretrained(folder + "/" + name, trust_remote_code=True).eval()
        output = model(expected["ids"])
        value = output.last_hidden_state if name == "base" else output.logits
        report[name] = {
            "class": type(model).__name__,
            "module": type(model).__module__,
            "max_diff": (value - expected[name]).abs().max().item(),
        }
# A training step under bf16 autocast, on the PyTorch operations the checkpoint's code runs.
model = AutoModelForCausalLM.from_pretrained(folder + "/causal", trust_remote_code=True).train()
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits = model(expected["ids"]).logits
logits.float().square().mean().backward()
report["autocast"] = {
    "max_diff": (logits.float() - expected["autocast"]).abs().max().item(),
    "finite_grads": all(torch.isfinite(p.grad).all().item() for p in model.parameters() if p.grad is not None),
}
report["attnres_imported"] = sorted(m for m in sys.modules if m == "attnres" or m.startswith("attnres."))
print("REPORT " + json.dumps(report))
"""


def save_checkpoints(folder: Path, overrides: dict) -> Path:
    """A causal LM, its base model and a classifier on it, saved with their code; their outputs beside, computed by
    the package on the PyTorch path (the one remote code runs)."""
    causal = AttnResForCausalLM(tiny_config(**overrides)).eval()
    randomize_depth_parameters(causal)
    classifier = AttnResForSequenceClassification(tiny_config(num_labels=3, **overrides)).eval()
    classifier.model.load_state_dict(causal.model.state_dict())
    ids = torch.randint(3, causal.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    ids[1, :3] = causal.config.pad_token_id  # the classifier scores each row's last non-padding token
    ids[1, -3:] = causal.config.pad_token_id
    causal.save_pretrained(folder / "causal")
    causal.model.save_pretrained(folder / "base")
    classifier.save_pretrained(folder / "classifier")
    with torch.no_grad():
        expected = {
            "ids": ids,
            "causal": causal(ids).logits,
            "base": causal.model(ids).last_hidden_state,
            "classifier": classifier(ids).logits,
        }
        with torch.autocast("cpu", dtype=torch.bfloat16):
            expected["autocast"] = causal.train()(ids).logits.float()
    torch.save(expected, folder / "expected.pt")
    return folder / "expected.pt"


def run_script(python: str, script: str, folder: Path, env: dict, cwd: Path) -> dict:
    env = {**env, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(folder / "modules")}
    return run_reporting([python, "-c", script, str(folder), str(folder / "expected.pt")], cwd, env, timeout=600)


def assert_remote_and_equal(report: dict, max_diff: float) -> None:
    assert report["config"].startswith("transformers_modules.")
    classes = {"causal": "AttnResForCausalLM", "base": "AttnResModel", "classifier": "AttnResForSequenceClassification"}
    for name, expected_class in classes.items():
        assert report[name]["class"] == expected_class and report[name]["module"].startswith("transformers_modules.")
        assert report[name]["max_diff"] <= max_diff, (name, report[name])


def require_venv_without_attnres() -> None:
    if not VENV_WITHOUT_ATTNRES.exists():
        reason = "the vLLM environment is not set up: bash scripts/setup_engines.sh"
        if os.environ.get("ATTNRES_REQUIRE_ENGINES") == "1":  # scripts/test.sh sets it up, and so requires it
            raise RuntimeError(reason)
        pytest.skip(reason)


@pytest.mark.parametrize("mode", MODES)
def test_every_auto_class_loads_from_remote_code_in_a_venv_without_attnres(mode, monkeypatch, tmp_path):
    require_venv_without_attnres()
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
    save_checkpoints(tmp_path, MODES[mode])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATTNRES_DEPTH_KERNEL")}
    report = run_script(str(VENV_WITHOUT_ATTNRES), LOAD_SCRIPT, tmp_path, env, cwd=tmp_path)
    assert report["attnres_imported"] == []
    # Another Transformers (5.19) over the same torch: the same operations, to fp32 rounding at most; under bf16
    # autocast (which failed in the checkpoint's PyTorch phase 2), the same bf16 operations.
    assert_remote_and_equal(report, max_diff=1e-6)
    assert report["autocast"]["finite_grads"] and report["autocast"]["max_diff"] <= 1e-6, report["autocast"]


STANDIN_INIT = '''
"""A stand-in for a later attnres whose kernels compute something else under another API."""
import os
open(os.environ["STANDIN_IMPORT_LOG"], "a").write(__name__ + "\\n")
'''
STANDIN_CPU = '''
import os
open(os.environ["STANDIN_IMPORT_LOG"], "a").write(__name__ + "\\n")
def extension():
    return object()
def implementations(differentiable, version=2):
    raise RuntimeError("the stand-in's kernels were called")
'''


@pytest.mark.parametrize("mode", MODES)
def test_remote_code_never_imports_an_installed_attnres(mode, tmp_path, monkeypatch):
    """A stand-in `attnres` first on the path, with kernels of another API: the checkpoint's code computes what the
    package's PyTorch path does, bit for bit, on the default kernel choice, and never imports the stand-in."""
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
    save_checkpoints(tmp_path, MODES[mode])
    standin = tmp_path / "standin" / "attnres"
    (standin / "kernels").mkdir(parents=True)
    (standin / "__init__.py").write_text(STANDIN_INIT)
    (standin / "kernels" / "__init__.py").write_text("")
    (standin / "kernels" / "cpu.py").write_text(STANDIN_CPU)
    log = tmp_path / "imports.log"
    env = {k: v for k, v in os.environ.items() if k != "ATTNRES_DEPTH_KERNEL"}
    env.update(PYTHONPATH=str(standin.parent), STANDIN_IMPORT_LOG=str(log))
    check = "import attnres, os; assert attnres.__file__.startswith(os.environ['PYTHONPATH']), attnres.__file__"
    subprocess.run([sys.executable, "-c", check], env=env, cwd=tmp_path, check=True)
    log.unlink()
    report = run_script(sys.executable, LOAD_SCRIPT, tmp_path, env, cwd=tmp_path)
    assert report["attnres_imported"] == [] and not log.exists()
    assert_remote_and_equal(report, max_diff=0.0)


def test_remote_code_refuses_to_demand_the_packages_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
    save_checkpoints(tmp_path, MODES["block"])
    env = {**os.environ, "ATTNRES_DEPTH_KERNEL": "cpu", "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "m")}
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path / "causal")!r}, trust_remote_code=True)
        model(torch.tensor([[3, 4, 5]]))
        """
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, cwd=tmp_path, capture_output=True, text=True)
    assert result.returncode != 0
    assert "ATTNRES_DEPTH_KERNEL=cpu: a checkpoint's remote code runs the PyTorch implementation only" in result.stderr


FIXTURES = Path(__file__).resolve().parent / "fixtures" / "v0_1_0"


@pytest.mark.parametrize("checkpoint", ["block-default", "converted"])
def test_checkpoints_saved_by_an_earlier_version_give_the_same_logits(checkpoint, monkeypatch, tmp_path):
    """`tests/fixtures/v0_1_0`: a Block model saved under the earlier default block size (1 sublayer for 3 layers)
    and a converted Llama, saved with their code by attnres 0.1.0 before blocks defaulted to whole layers, and their
    logits computed then on the PyTorch path. Loaded by this package, and from their own code where attnres is not
    installed (there their code, which predates `PACKAGED`, finds no kernels and runs PyTorch). Within 1e-6, not bit
    for bit: the logits were computed on another machine, and another CPU's matrix kernels may sum in another order
    (8e-7 apart on an AVX-512 Xeon, bit-equal where they were saved)."""
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
    expected = torch.load(FIXTURES / "expected_logits.pt")
    model = AttnResForCausalLM.from_pretrained(FIXTURES / checkpoint).eval()
    assert model.config.block_size == 1
    assert model.config.family == "llama" and not hasattr(model.config, "sliding_window")
    assert not hasattr(model.config, "output_router_logits") and not hasattr(model.config, "num_local_experts")
    with torch.no_grad():
        assert (model(expected["ids"]).logits - expected[checkpoint]).abs().max().item() <= 1e-6

    require_venv_without_attnres()
    script = textwrap.dedent(
        f"""
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(FIXTURES / checkpoint)!r}, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        expected = torch.load({str(FIXTURES / "expected_logits.pt")!r})
        with torch.no_grad():
            print("MAX_DIFF", (model(expected["ids"]).logits - expected[{checkpoint!r}]).abs().max().item())
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATTNRES_DEPTH_KERNEL")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(tmp_path / "modules"))
    result = subprocess.run(
        [str(VENV_WITHOUT_ATTNRES), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("MAX_DIFF")]
    assert float(line.split()[1]) <= 1e-6  # also another Transformers (5.19) over the same torch


BEFORE_FAMILIES = Path(__file__).resolve().parent / "fixtures" / "before_families"


@pytest.mark.parametrize("checkpoint, family", [("mixtral-full", "mixtral"), ("qwen2-window-block", "qwen2")])
def test_checkpoints_saved_before_families_load_as_the_family_their_fields_imply(checkpoint, family, monkeypatch):
    """`tests/fixtures/before_families`: saved with their code and logits by the last version whose model held its own
    copies of Llama's and Mixtral's sublayers, with no `family` in their configs: Full AttnRes with Mixtral's MoE, and
    Block AttnRes with q/k/v biases, a window in every layer and the exact retrofit. Read as Mixtral and as Qwen2 (the
    window on in every layer), they give the logits they gave then."""
    monkeypatch.setenv("ATTNRES_DEPTH_KERNEL", "reference")
    expected = torch.load(BEFORE_FAMILIES / "expected_logits.pt")
    model = AttnResForCausalLM.from_pretrained(BEFORE_FAMILIES / checkpoint).eval()
    assert model.config.family == family
    # The Llama and Mixtral fields every such config holds, where the family has none: dropped at their defaults.
    assert not {"attention_bias", "mlp_bias", "qkv_bias"} & set(model.config.to_dict())
    with torch.no_grad():
        assert (model(expected["ids"]).logits - expected[checkpoint]).abs().max().item() <= 1e-6
