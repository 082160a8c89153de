"""TRL's trainers on AttnRes checkpoints, with TRL's defaults (bf16 mixed precision, activation checkpointing):
`SFTTrainer` with a LoRA `peft_config`, in full, with packing and with padding-free batches, and `DPOTrainer` with a
LoRA `peft_config` (`tests/trl_runs.py` runs them). On tiny Qwen3 and Gemma 3 conversions every run, on the converted
SmolLM2-135M the two LoRA runs (the full-parameter runs are left to the tiny models, to keep CI short); each through
the installed package and through the checkpoint's remote code, in a process that never imports attnres.

Every run's loss falls on a batch it sees at every step, and every saved adapter loads back onto a fresh copy of the
checkpoint with equal logits. TRL's fused LM head (the log-probabilities of the labels computed from the backbone's
output and the head's weight, without the model's forward) gives the model's own loss.
"""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from attnres.conversion import convert
from conftest import max_diff, run_reporting
from family_cases import COMMON, prompt_ids, save_source
from trl_runs import RUNS, run_trainers


TESTS = Path(__file__).resolve().parent
FAMILIES = ["qwen3", "gemma3_text"]
# Gemma's final soft-capping on, so that the fused LM head's reading of it is tested.
SOURCE_FIELDS = {"gemma3_text": dict(final_logit_softcapping=30.0)}
SMOLLM2_RUNS = ("sft-lora", "dpo-lora")
SMOLLM2_RATES = dict(steps=4, lora_lr=3e-4, dpo_lr=3e-4)


def character_tokenizer() -> PreTrainedTokenizerFast:
    """One token per printable ASCII character, after `family_cases.COMMON`'s pad, bos and eos ids (0, 1, 2) and an
    unknown token: 99 tokens, within the tiny models' vocabulary of 128."""
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({chr(code): 4 + index for index, code in enumerate(range(32, 127))})
    assert len(vocab) <= COMMON["vocab_size"]
    backend = Tokenizer(models.BPE(vocab, merges=[], unk_token="<unk>"))  # no merges: one token per character
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module")
def conversions(tmp_path_factory) -> dict[str, Path]:
    """Each family's tiny source converted to Block AttnRes, with the character tokenizer beside it."""
    root = tmp_path_factory.mktemp("trl")
    folders = {}
    for family in FAMILIES:
        folders[family] = root / family
        source = save_source(family, root / f"{family}-source", **SOURCE_FIELDS.get(family, {}))
        convert(source, folders[family], verify=False, progress=False)
        character_tokenizer().save_pretrained(folders[family])
    return folders


def run_with_remote_code(folder: Path, output: Path, **options) -> dict:
    """`run_trainers` in a new process that loads the checkpoint through its remote code (`trust_remote_code=True`)
    and never imports attnres: no PYTHONPATH, started outside the repository."""
    output.mkdir(parents=True)
    arguments = json.dumps(dict(remote_code=True, **options))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "ATTNRES_DEPTH_KERNEL")}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(output / "modules"))
    command = [sys.executable, str(TESTS / "trl_runs.py"), str(folder), str(output), arguments]
    return run_reporting(command, output, env, timeout=1200)


def check_report(report: dict, runs: tuple[str, ...], remote_code: bool) -> None:
    """Each run trained under TRL's defaults and its loss fell; each adapter reloaded to equal logits; padding-free
    batches gave the padded batches' losses; remote code ran without attnres."""
    imported = report.pop("attnres_imported")
    assert imported == [] if remote_code else "attnres.modeling_attnres" in imported
    assert set(report) == set(runs)
    for name, run in report.items():
        losses = run["losses"]
        assert run["bf16"] and run["activation_checkpointing"], name
        assert run["model_module"].startswith("transformers_modules." if remote_code else "attnres."), name
        assert all(map(torch.isfinite, torch.tensor(losses))), (name, losses)
        assert losses[-1] < losses[0], (name, losses)
        if "reload_max_diff" in run:
            assert run["reload_max_diff"] <= 1e-5, (name, run)
    if "dpo-lora" in report:
        assert abs(report["dpo-lora"]["losses"][0] - torch.log(torch.tensor(2.0)).item()) < 1e-3  # before any step
    if "sft-padding-free" in report:
        assert report["sft-padding-free"]["padding_free"] and report["sft-packing"]["padding_free"]
        assert not report["sft-full"]["padding_free"]
        # The same rows, the same updates: under bf16 autocast the losses differ by the rounding of differently
        # shaped products alone. Measured: 2.5e-5 (Qwen3) and 5e-6 (Gemma 3) at the first step, 1.2e-3 and 3.0e-3
        # at most over 6 steps.
        padded, padding_free = report["sft-full"]["losses"], report["sft-padding-free"]["losses"]
        assert abs(padded[0] - padding_free[0]) <= 1e-3, (padded, padding_free)
        assert max(abs(a - b) for a, b in zip(padded, padding_free)) <= 1e-2, (padded, padding_free)


@pytest.mark.parametrize("family", FAMILIES)
def test_trl_trainers_through_the_package(conversions, family, tmp_path):
    check_report(run_trainers(conversions[family], tmp_path, remote_code=False), RUNS, remote_code=False)


@pytest.mark.parametrize("family", FAMILIES)
def test_trl_trainers_through_remote_code(conversions, family, tmp_path):
    check_report(run_with_remote_code(conversions[family], tmp_path / "runs"), RUNS, remote_code=True)


def test_trl_lora_and_dpo_on_converted_smollm2_through_the_package(converted_smollm2, tmp_path):
    report = run_trainers(converted_smollm2, tmp_path, remote_code=False, runs=SMOLLM2_RUNS, **SMOLLM2_RATES)
    check_report(report, SMOLLM2_RUNS, remote_code=False)


def test_trl_lora_and_dpo_on_converted_smollm2_through_remote_code(converted_smollm2, tmp_path):
    report = run_with_remote_code(converted_smollm2, tmp_path / "runs", runs=SMOLLM2_RUNS, **SMOLLM2_RATES)
    check_report(report, SMOLLM2_RUNS, remote_code=True)


@pytest.mark.parametrize("family", FAMILIES)
def test_trl_fused_lm_head_gives_the_models_own_loss(conversions, family):
    """TRL's trainers score through `add_fused_lm_head`, which reads the backbone's `last_hidden_state`, the head's
    weight and the config's logit soft-capping and scale: it must compute the loss the model's own forward does."""
    from trl.trainer.utils import add_fused_lm_head

    model = AutoModelForCausalLM.from_pretrained(conversions[family]).eval()
    ids = prompt_ids(batch=2, length=12)
    with torch.no_grad():
        expected = model(ids, labels=ids).loss
        add_fused_lm_head(model)
        fused = model(ids, labels=ids, fused_lm_head=True)
        unfused = model(ids, labels=ids)
    assert max_diff(fused.loss, expected) <= 1e-5
    assert torch.equal(unfused.loss, expected)  # without the flag, the model's own forward
