"""QLoRA on a converted checkpoint: loaded in 4-bit NF4 through `BitsAndBytesConfig` (bitsandbytes' CPU backend
here), LoRA on the projections and the depth modules trained in full, with Trainer.

A tiny Qwen3 conversion with `intermediate_size=128`: bitsandbytes' CPU kernels need every quantized layer's input
width to be a multiple of its block size (64).

bitsandbytes' CPU backend repacks a 4-bit weight in place at its first forward in eval mode without autograd (on CPUs
with AVX-512 BF16), a layout PEFT's merge does not read; the logits compared here are computed in training mode,
where no layer is repacked (every dropout here is 0). The family's own model shows the same in eval mode.
"""

import bitsandbytes as bnb
import pytest
import torch
from peft import PeftModel, get_peft_model, prepare_model_for_kbit_training
from peft.utils import ModulesToSaveWrapper
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainingArguments

from attnres.conversion import convert
from attnres.training import PROJECTION_TARGET_MODULES, lora_config
from conftest import max_diff
from family_cases import prompt_ids, save_source


DEPTH_PARAMETERS = ("pseudo_query", "key_norm_weight")


def nf4(compute_dtype: torch.dtype) -> BitsAndBytesConfig:
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("qlora")
    source = save_source("qwen3", root / "source", intermediate_size=128)
    convert(source, root / "block", mode="block", verify=False, progress=False)
    return dict(source=source, block=root / "block")


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    """The logits in fp32, computed in training mode (see the module's docstring) without autograd."""
    model.train()
    with torch.no_grad():
        return model(ids).logits.float()


def depth_parameters(model) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if name.endswith(DEPTH_PARAMETERS)}


def test_4bit_loading_quantizes_the_projections_and_keeps_the_depth_queries_in_fp32(checkpoints):
    full = AutoModelForCausalLM.from_pretrained(checkpoints["block"])
    model = AutoModelForCausalLM.from_pretrained(
        checkpoints["block"], quantization_config=nf4(torch.bfloat16), dtype=torch.bfloat16
    )
    projections = {name: m for name, m in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTION_TARGET_MODULES}
    assert len(projections) == 7 * full.config.num_hidden_layers
    for module in projections.values():
        assert isinstance(module, bnb.nn.Linear4bit)
        assert module.weight.dtype == torch.uint8 and module.weight.quant_state.quant_type == "nf4"
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.norm.weight.dtype == torch.bfloat16  # the rest in the dtype asked for
    # The pseudo-queries and key norms: plain fp32 parameters, holding the checkpoint's values exactly.
    expected = depth_parameters(full)
    loaded = depth_parameters(model)
    assert set(loaded) == set(expected) and len(loaded) == 2 * (2 * full.config.num_hidden_layers + 1)
    for name, parameter in loaded.items():
        assert type(parameter) is torch.nn.Parameter and parameter.dtype == torch.float32, name
        assert torch.equal(parameter, expected[name]), name


def test_4bit_attnres_equals_its_4bit_source(checkpoints):
    """The same projections quantized the same way: the 4-bit conversion computes what the 4-bit source does, as
    the fp32 conversion computes what the fp32 source does."""
    ids = prompt_ids(batch=2, length=16)
    source = AutoModelForCausalLM.from_pretrained(checkpoints["source"], quantization_config=nf4(torch.float32))
    model = AutoModelForCausalLM.from_pretrained(checkpoints["block"], quantization_config=nf4(torch.float32))
    full = AutoModelForCausalLM.from_pretrained(checkpoints["block"])
    quantization_error = max_diff(logits(model, ids), logits(full, ids))
    assert quantization_error > 1e-3  # the projections really are quantized
    assert max_diff(logits(model, ids), logits(source, ids)) <= 1e-4


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_qlora_trains_reloads_merges_and_unmerges(checkpoints, tmp_path, bf16):
    folder = checkpoints["block"]
    ids = prompt_ids(batch=4, length=24)
    full_precision_logits = logits(AutoModelForCausalLM.from_pretrained(folder), ids)

    def load_4bit():
        quantization = nf4(torch.bfloat16)
        return AutoModelForCausalLM.from_pretrained(folder, quantization_config=quantization, dtype=torch.bfloat16)

    base = load_4bit()
    quantization_error = max_diff(logits(base, ids), full_precision_logits)
    model = get_peft_model(prepare_model_for_kbit_training(base), lora_config(r=4, lora_alpha=8))
    trainable = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    assert {p.dtype for p in trainable.values()} == {torch.float32}
    assert any(name.endswith("pseudo_query") for name in trainable)

    args = TrainingArguments(
        tmp_path / "run", max_steps=8, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=1,
        lr_scheduler_type="constant", save_strategy="no", report_to=[], use_cpu=True, bf16=bf16,
    )
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": row, "labels": row} for row in ids])
    trainer.train()
    model = trainer.accelerator.unwrap_model(model, keep_fp32_wrapper=False)  # no autocast around its forward
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1, losses  # every step on the same batch
    changed = {name for name, p in model.named_parameters() if p.requires_grad and not torch.equal(p, trainable[name])}
    assert any("lora_B" in name for name in changed) and any(name.endswith("pseudo_query") for name in changed)
    for name, parameter in depth_parameters(model).items():
        assert parameter.dtype == torch.float32 and not isinstance(parameter, bnb.nn.Params4bit), name

    trained = logits(model, ids)
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(prepare_model_for_kbit_training(load_4bit()), tmp_path / "adapter")
    assert max_diff(logits(reloaded, ids), trained) <= 1e-5

    # Merging into the 4-bit weights quantizes W + BA again, and unmerging once more: each is one more NF4 rounding
    # of every weight, and two independent roundings differ by about sqrt(2) times one. Measured here: quantizing
    # moves the logits by 0.150, the adapter by 1.34, merging by 0.23 to 0.24, unmerging by 0.21 to 0.22 (fp32 and
    # bf16 runs); a merge that misreads the weights' layout moves them by 0.8.
    model.merge_adapter()
    merged = logits(model, ids)
    model.unmerge_adapter()
    unmerged = logits(model, ids)
    with model.disable_adapter():
        without_adapter = logits(model, ids)
    assert max_diff(trained, without_adapter) > 4 * quantization_error  # the adapter matters more than the rounding
    assert max_diff(merged, trained) <= 2.5 * quantization_error
    assert max_diff(unmerged, trained) <= 2.5 * quantization_error

    # The recipe for a merged checkpoint: the adapter onto the full-precision model, merged exactly.
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(folder), tmp_path / "adapter")
    expected = logits(peft_model, ids)
    merged_model = peft_model.merge_and_unload()
    assert not any(isinstance(m, ModulesToSaveWrapper) or hasattr(m, "lora_A") for m in merged_model.modules())
    assert max_diff(logits(merged_model, ids), expected) <= 1e-5
    assert max_diff(expected, trained) <= 2 * quantization_error  # the 4-bit model's function, up to quantization
