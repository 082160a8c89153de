"""TRL's trainers on one AttnRes checkpoint, with TRL's defaults (bf16 mixed precision, activation checkpointing):
`SFTTrainer` with a LoRA `peft_config`, in full, with packing and with padding-free batches, and `DPOTrainer` with a
LoRA `peft_config`. Each run reports its per-step losses; the LoRA runs save their adapter, load it back onto a fresh
copy of the checkpoint and report the largest logit difference against the trained model.

Imports neither attnres nor the tests' helpers, so that `tests/test_trl.py` runs it in its own process on a checkpoint
loaded through its remote code (`python tests/trl_runs.py FOLDER OUTPUT '{"remote_code": true}'`: the keyword
arguments of `run_trainers` as JSON; it prints the report as `REPORT {json}`), as well as in the test's process
through the installed package (`run_trainers`).
"""

import json
import sys
from pathlib import Path

import torch
from datasets import Dataset
from peft import LoraConfig, PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer


SENTENCES = [
    "The cat sat on the mat.",
    "A dog ran out in the fog.",
    "One, two, three, four, five.",
    "Red sky at night, shepherd's delight.",
    "All that glitters is not gold.",
    "To be, or not to be.",
    "The rain in Spain stays mainly in the plain.",
    "A stitch in time saves nine.",
]
PREFERENCES = {
    "prompt": ["The cat sat on the", "One, two, three,", "To be, or not to", "A stitch in time saves"],
    "chosen": [" mat.", " four.", " be.", " nine."],
    "rejected": [" zqx.", " qqj.", " xzv.", " jjq."],
}
# LoRA on the projections, the depth-mixing modules trained in full: `attnres.training.lora_config`'s choice, spelled
# out here because remote code never imports attnres.
LORA = dict(
    r=4,
    lora_alpha=8,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    modules_to_save=["attn_residual", "mlp_residual", "output_residual"],
    task_type="CAUSAL_LM",
)


def common_arguments(output: Path, remote_code: bool, steps: int, learning_rate: float) -> dict:
    """What every run shares; bf16 and activation checkpointing stay at TRL's defaults (on)."""
    return dict(
        output_dir=str(output),
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        trust_remote_code=remote_code,
    )


def losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def adapter_reload_max_diff(trainer, folder: Path, output: Path, remote_code: bool, probe: torch.Tensor) -> float:
    """Save the trained adapter, load it onto a fresh copy of the checkpoint, and compare logits in fp32."""
    trainer.save_model(str(output))
    trained = trainer.accelerator.unwrap_model(trainer.model, keep_fp32_wrapper=False).eval()  # no autocast
    reloaded = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=remote_code), output
    ).eval()
    with torch.no_grad():
        return (trained(probe).logits.float() - reloaded(probe).logits.float()).abs().max().item()


RUNS = ("sft-lora", "sft-full", "sft-packing", "sft-padding-free", "dpo-lora")


def run_trainers(
    folder: Path,
    output: Path,
    remote_code: bool,
    runs: tuple[str, ...] = RUNS,
    steps: int = 6,
    lora_lr: float = 1e-2,
    full_lr: float = 3e-3,
    dpo_lr: float = 1e-2,
) -> dict:
    """The `runs` named in `RUNS`, each `steps` steps on the same batch of 4 rows (the whole data set), so that each
    step's loss is on the same rows."""
    folder, output = Path(folder), Path(output)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    texts = Dataset.from_dict({"text": SENTENCES[:4]})
    preferences = Dataset.from_dict(PREFERENCES)
    probe = tokenizer(SENTENCES[:2], return_tensors="pt", padding=True).input_ids
    report = {}

    def record(name, trainer, **extra):
        report[name] = dict(
            losses=losses(trainer),
            bf16=trainer.args.bf16,
            activation_checkpointing=trainer.model.is_gradient_checkpointing,
            model_module=type(trainer.model.get_base_model() if name.endswith("lora") else trainer.model).__module__,
            **extra,
        )

    sft_runs = {
        "sft-lora": (dict(), lora_lr, True),
        "sft-full": (dict(), full_lr, False),
        "sft-packing": (dict(packing=True, max_length=32), full_lr, False),
        "sft-padding-free": (dict(padding_free=True, max_length=None), full_lr, False),
    }
    for name, (fields, learning_rate, lora) in sft_runs.items():
        if name not in runs:
            continue
        args = SFTConfig(**common_arguments(output / name, remote_code, steps, learning_rate), **fields)
        trainer = SFTTrainer(
            model=str(folder),
            args=args,
            train_dataset=texts,
            processing_class=tokenizer,
            peft_config=LoraConfig(**LORA) if lora else None,
        )
        trainer.train()
        extra = dict(padding_free=trainer.padding_free)
        if lora:
            adapter = output / name / "adapter"
            extra["reload_max_diff"] = adapter_reload_max_diff(trainer, folder, adapter, remote_code, probe)
        record(name, trainer, **extra)

    if "dpo-lora" in runs:
        args = DPOConfig(**common_arguments(output / "dpo-lora", remote_code, steps, dpo_lr))
        trainer = DPOTrainer(
            model=str(folder),
            args=args,
            train_dataset=preferences,
            processing_class=tokenizer,
            peft_config=LoraConfig(**LORA),
        )
        trainer.train()
        adapter = output / "dpo-lora" / "adapter"
        reload_max_diff = adapter_reload_max_diff(trainer, folder, adapter, remote_code, probe)
        record("dpo-lora", trainer, reload_max_diff=reload_max_diff)
    report["attnres_imported"] = sorted(m for m in sys.modules if m == "attnres" or m.startswith("attnres."))
    return report


if __name__ == "__main__":
    folder, output, options = sys.argv[1:]
    result = run_trainers(Path(folder), Path(output), **json.loads(options))
    print("REPORT " + json.dumps(result))
