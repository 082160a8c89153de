"""Training: Trainer (dense and MoE, checkpoint resume, activation checkpointing), optimizer groups, depth-only
training, the PEFT LoRA recipe, DDP / FSDP on CPU against a single process and in bf16 against the family's own
model, the retrofit step on the real SmolLM2, and the examples."""

import functools
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import enable_activation_checkpointing, randomize_depth_parameters, tiny_config
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from attnres import AttnResForCausalLM
from attnres.families import FAMILIES
from attnres.training import (
    AttnResTrainer,
    demo_retrofit,
    depth_attention_table,
    depth_parameter_names,
    is_depth_parameter,
    lora_config,
    no_decay_parameter_names,
    optimizer_groups,
    plot_depth_attention,
    retrofit_depth,
    shakespeare_plays,
    token_windows,
    train_depth_only,
)


REPO_ROOT = Path(__file__).resolve().parents[1]
MOE = dict(num_local_experts=4, num_experts_per_tok=2, output_router_logits=True)


def counting_dataset(num_rows: int = 64, seq_len: int = 16, vocab_size: int = 96, seed: int = 0) -> list[dict]:
    """Sequences that count up from a random start with a random stride of 1 or 2: learnable in a few steps."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(3, vocab_size, (num_rows, 1), generator=generator)
    stride = torch.randint(1, 3, (num_rows, 1), generator=generator)
    ids = (start - 3 + stride * torch.arange(seq_len)) % (vocab_size - 3) + 3
    return [{"input_ids": row, "labels": row} for row in ids]


def training_args(output_dir: Path, **overrides) -> TrainingArguments:
    fields = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=8,
        max_steps=16,
        learning_rate=1e-2,
        weight_decay=0.1,
        lr_scheduler_type="constant",
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    fields.update(overrides)
    return TrainingArguments(**fields)


def logged_losses(trainer: Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


# --- Trainer ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_trainer_loss_goes_down(tmp_path, kind):
    model = AttnResForCausalLM(tiny_config(**(MOE if kind == "moe" else {})))
    trainer = AttnResTrainer(model=model, args=training_args(tmp_path), train_dataset=counting_dataset())
    trainer.train()
    losses = logged_losses(trainer)
    assert len(losses) == 16
    assert all(math.isfinite(loss) for loss in losses)
    assert sum(losses[-4:]) / 4 < losses[0] - 0.75, losses  # from ln(93) = 4.53 (uniform) towards counting
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if n.endswith("pseudo_query"))


def test_trainer_checkpoint_resume_matches_uninterrupted(tmp_path):
    dataset = counting_dataset()
    args = dict(max_steps=6, save_strategy="steps", save_steps=3)
    torch.manual_seed(0)
    uninterrupted = AttnResTrainer(
        model=AttnResForCausalLM(tiny_config()), args=training_args(tmp_path / "a", **args), train_dataset=dataset
    )
    uninterrupted.train()
    assert (tmp_path / "a" / "checkpoint-3" / "model.safetensors").is_file()

    torch.manual_seed(0)
    resumed = AttnResTrainer(
        model=AttnResForCausalLM(tiny_config()), args=training_args(tmp_path / "b", **args), train_dataset=dataset
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-3"))
    assert resumed.state.global_step == 6
    # The resumed run's history starts with the checkpoint's three logged steps; compare the three it trained.
    torch.testing.assert_close(logged_losses(resumed)[3:], logged_losses(uninterrupted)[3:], rtol=0, atol=1e-5)
    expected = dict(uninterrupted.model.named_parameters())
    for name, parameter in resumed.model.named_parameters():
        torch.testing.assert_close(parameter, expected[name], rtol=0, atol=1e-5, msg=name)

    # The checkpoint itself is an AttnRes folder: it reloads through the Auto class with its trained depth weights.
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "checkpoint-6")
    torch.testing.assert_close(
        reloaded.model.layers[1].mlp_residual.query.pseudo_query,
        uninterrupted.model.model.layers[1].mlp_residual.query.pseudo_query,
    )


# MoE with reentrant checkpointing is left out: its load-balancing loss sends no gradient to the routers (the router
# logits are captured by hooks during the no-grad recompute), a known limitation documented in docs/training.md.
@pytest.mark.parametrize("kind, use_reentrant", [("dense", False), ("dense", True), ("moe", False)])
def test_trainer_activation_checkpointing_gives_the_same_training(tmp_path, kind, use_reentrant):
    config = tiny_config(**(MOE if kind == "moe" else {}))
    runs = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = AttnResForCausalLM(config)
        args = training_args(
            tmp_path / str(checkpointing),
            max_steps=4,
            activation_checkpointing=checkpointing,
            activation_checkpointing_kwargs={"use_reentrant": use_reentrant},
        )
        trainer = AttnResTrainer(model=model, args=args, train_dataset=counting_dataset())
        trainer.train()
        assert model.is_activation_checkpointing == checkpointing
        runs[checkpointing] = logged_losses(trainer)
    torch.testing.assert_close(runs[True], runs[False], rtol=0, atol=1e-5)


# --- optimizer groups ---------------------------------------------------------------------------------------------


def expected_no_decay(num_layers: int, biases: bool) -> set[str]:
    """Written out by hand from the parameter table in docs/configuration.md, independently of the helper's rule."""
    output_query = "model.output_residual.query"
    names = {"model.norm.weight", f"{output_query}.pseudo_query", f"{output_query}.key_norm_weight"}
    for i in range(num_layers):
        layer = f"model.layers.{i}"
        names |= {f"{layer}.input_layernorm.weight", f"{layer}.post_attention_layernorm.weight"}
        for step in ("attn_residual", "mlp_residual"):
            names |= {f"{layer}.{step}.query.pseudo_query", f"{layer}.{step}.query.key_norm_weight"}
        if biases:
            names |= {f"{layer}.self_attn.{proj}.bias" for proj in ("q_proj", "k_proj", "v_proj", "o_proj")}
    return names


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_trainer_optimizer_groups_hold_exactly_the_right_names(tmp_path, kind):
    # Mixtral's attention has no biases; Llama's, with attention_bias, has one on each projection.
    config = tiny_config(**(MOE if kind == "moe" else dict(attention_bias=True)))
    model = AttnResForCausalLM(config)
    trainer = AttnResTrainer(model=model, args=training_args(tmp_path), train_dataset=counting_dataset())
    optimizer = trainer.create_optimizer()
    names = {id(p): n for n, p in model.named_parameters()}
    groups = {group["weight_decay"]: {names[id(p)] for p in group["params"]} for group in optimizer.param_groups}
    no_decay = expected_no_decay(config.num_hidden_layers, biases=kind == "dense")
    assert groups[0.0] == no_decay
    assert groups[0.1] == set(names.values()) - no_decay
    assert "model.embed_tokens.weight" in groups[0.1] and "lm_head.weight" in groups[0.1]
    if kind == "moe":
        assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.gate_up_proj"} <= groups[0.1]

    # Why the helper exists: Trainer's own rule would decay every pseudo-query towards uniform attention.
    plain = Trainer(model=model, args=training_args(tmp_path / "plain"), train_dataset=counting_dataset())
    assert "model.layers.0.attn_residual.query.pseudo_query" in plain.get_decay_parameter_names(model)


@pytest.mark.parametrize("mode", ["hc", "mhc", "denseformer"])
def test_residual_coefficients_of_the_comparison_modes_are_not_decayed(mode):
    model = AttnResForCausalLM(tiny_config(residual_mode=mode))
    residual = {n for n, _ in model.named_parameters() if "_residual." in n}
    assert residual and residual <= set(no_decay_parameter_names(model))
    if mode == "hc":  # a matrix, initialised to the identity: decay would shrink the residual connection itself
        assert "model.layers.1.attn_residual.static_residual" in residual


def test_optimizer_groups_skip_frozen_parameters():
    model = AttnResForCausalLM(tiny_config())
    trainable = train_depth_only(model)
    decay, no_decay = optimizer_groups(model, weight_decay=0.1)
    assert decay == {"params": [], "weight_decay": 0.1}
    assert len(no_decay["params"]) == len(trainable) == 2 * (2 * 3 + 1)
    assert set(trainable) <= set(no_decay_parameter_names(model))


# --- depth-only training ------------------------------------------------------------------------------------------


def test_train_depth_only_freezes_the_rest_and_survives_reentrant_checkpointing():
    model = AttnResForCausalLM(tiny_config())
    randomize_depth_parameters(model)
    names = train_depth_only(model)
    assert names == depth_parameter_names(model) and len(names) == 14
    assert {n for n, p in model.named_parameters() if p.requires_grad} == set(names)
    ids = counting_dataset(num_rows=2)[0]["input_ids"][None]

    def depth_grads() -> dict[str, torch.Tensor]:
        model.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    model.train()
    plain = depth_grads()
    enable_activation_checkpointing(model, True)
    checkpointed = depth_grads()
    # Sublayer 1 reads a single source, so its pseudo-query has no gradient; every later one must have one.
    assert plain["model.layers.2.attn_residual.query.pseudo_query"].abs().sum() > 0
    torch.testing.assert_close(checkpointed, plain, rtol=1e-5, atol=1e-7)


def test_train_depth_only_refuses_a_standard_model():
    with pytest.raises(ValueError, match="no depth-mixing parameters"):
        train_depth_only(AttnResForCausalLM(tiny_config(residual_mode="standard")))


# --- PEFT ---------------------------------------------------------------------------------------------------------


def test_peft_lora_with_depth_modules_trains_saves_loads_and_merges(tmp_path):
    AttnResForCausalLM(tiny_config()).save_pretrained(tmp_path / "base")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), lora_config(r=4, lora_alpha=8))
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert any("lora_A" in n for n in trainable) and any("self_attn.q_proj" in n for n in trainable)
    assert {n for n in trainable if "lora_" not in n} == {
        n
        for n in trainable
        if n.endswith(("modules_to_save.default.query.pseudo_query", "modules_to_save.default.query.key_norm_weight"))
    }
    assert len([n for n in trainable if "lora_" not in n]) == 14

    # Reentrant checkpointing with frozen embeddings: PEFT must keep the inputs requiring grad.
    args = training_args(
        tmp_path / "run",
        max_steps=10,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": True},
    )
    trainer = AttnResTrainer(model=model, args=args, train_dataset=counting_dataset())
    trainer.train()
    losses = logged_losses(trainer)
    assert losses[-1] < losses[0], losses
    trained_query = model.base_model.model.model.layers[2].attn_residual.modules_to_save["default"].query.pseudo_query
    assert trained_query.abs().sum() > 0
    assert model.base_model.model.model.layers[2].attn_residual.original_module.query.pseudo_query.abs().sum() == 0

    model.eval()
    ids = counting_dataset(num_rows=2, seed=5)[0]["input_ids"][None]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    generated = model.generate(input_ids=ids, max_new_tokens=5, do_sample=False)  # prepare_inputs_for_generation

    model.save_pretrained(tmp_path / "adapter")
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    assert any(k.endswith("attn_residual.query.pseudo_query") for k in saved) and any("lora_B" in k for k in saved)

    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, expected, rtol=0, atol=1e-6)

    merged = loaded.merge_and_unload()
    assert type(merged) is AttnResForCausalLM
    merged.save_pretrained(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(reloaded) is AttnResForCausalLM
    assert not any("lora" in name or "modules_to_save" in name for name in reloaded.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, expected, rtol=0, atol=1e-5)
    assert torch.equal(reloaded.generate(input_ids=ids, max_new_tokens=5, do_sample=False), generated)


# --- distributed: DDP and FSDP2 through accelerate, 2 CPU processes on gloo -----------------------------------------


def launcher_env() -> dict[str, str]:
    """This process's environment for a launched run. Earlier tests in this process (Trainer, accelerate) may leave
    RANK / MASTER_PORT / ACCELERATE_* behind, which would make a single run wait for a process group and the
    launched ranks join the wrong one."""
    launcher_vars = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in launcher_vars and not name.startswith(("TORCHELASTIC_", "ACCELERATE_"))
    }
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return env


def launch(command: list[str], log_path: Path) -> None:
    """Run `command` (a script, or torchrun over 2 processes) to completion within 120 s, its output in `log_path`."""
    with open(log_path, "w") as log:  # a file, not a pipe: a full pipe would block a rank
        process = subprocess.Popen(
            command,
            env=launcher_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, so a hung launcher goes with its workers
        )
    try:
        returncode = process.wait(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert returncode == 0, f"{command} failed:\n{log_path.read_text()[-4000:]}"


def torchrun(script: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", script]


def accelerate_launch(script: str, mixed_precision: str) -> list[str]:
    """`accelerate launch` over 2 processes: its multi-process launcher (torchrun underneath, on a free port), whose
    `--mixed_precision` the script's `Accelerator(cpu=True)` reads; it runs on the CPU over gloo."""
    options = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--dynamo_backend", "no"]
    options += ["--main_process_port", "0", "--mixed_precision", mixed_precision]
    return [sys.executable, "-m", "accelerate.commands.launch", *options, script]


@pytest.fixture(scope="module")
def distributed_runs(tmp_path_factory) -> dict[str, dict]:
    """The same 4 steps of Block AttnRes and of its Llama (tests/distributed_train.py) as one process, as DDP and as
    FSDP over 2 processes in fp32, as DDP under `accelerate launch --mixed_precision bf16`, and as FSDP with bf16
    parameters: per run, per model, its record."""
    folder = tmp_path_factory.mktemp("distributed")
    script = str(REPO_ROOT / "tests" / "distributed_train.py")
    launches = {  # one after another: 2 ranks already fill the 2 CI cores
        "single": ([sys.executable, script], ["single"]),
        "fp32": (torchrun(script), ["ddp", "fsdp", "fsdp-bf16"]),
        "bf16": (accelerate_launch(script, "bf16"), ["ddp"]),
    }
    runs = {}
    for launch_name, (command, names) in launches.items():
        output = folder / f"{launch_name}.json"
        launch([*command, "--runs", *names, "--output", str(output)], folder / f"{launch_name}.log")
        records = json.loads(output.read_text())
        runs |= {("ddp-bf16" if launch_name == "bf16" else name): records[name] for name in names}
    return runs


@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("model", ["attnres", "llama"])
def test_distributed_losses_match_a_single_process(distributed_runs, strategy, model):
    run, single = distributed_runs[strategy][model], distributed_runs["single"][model]
    assert run["world_size"] == 2 and single["world_size"] == 1
    wrapped = {"attnres": "FSDPAttnResForCausalLM", "llama": "FSDPLlamaForCausalLM"}[model]
    assert run["wrapper"] == {"ddp": "DistributedDataParallel", "fsdp": wrapped}[strategy]
    if strategy == "fsdp":
        assert run["parameter"] == "DTensor"
    assert run["precision"] == single["precision"] == "no"
    assert run["dtypes"] == {"matmul": ["float32"], "stream": ["float32"]}
    assert len(run["losses"]) == 4
    # Same global batch, equal tokens per process: only the float summation order differs.
    torch.testing.assert_close(run["losses"], single["losses"], rtol=0, atol=1e-5)
    assert run["losses"][0] != run["losses"][-1]  # the steps did update the model


def cast_floating(value, dtype: torch.dtype):
    """Every floating-point tensor in `value` (through tuples, named tuples, lists and dicts) cast to `dtype`, as
    FSDP2's `MixedPrecisionPolicy(param_dtype=dtype)` casts the inputs of each unit it shards."""
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(cast_floating(item, dtype) for item in value))
    if isinstance(value, (tuple, list)):
        return type(value)(cast_floating(item, dtype) for item in value)
    if isinstance(value, dict):
        return {key: cast_floating(item, dtype) for key, item in value.items()}
    return value


def test_decoder_layers_recompute_the_statistics_a_mixed_precision_policy_casts(monkeypatch):
    """A bf16 model whose decoder layers receive their inputs cast as FSDP2's mixed-precision policy casts them (the
    depth state's fp32 inverse RMS to bf16) computes the same logits, bit for bit: each layer computes the statistics
    again from the blocks. Both runs read the pseudo-queries step by step, as under FSDP2, whose shards the model
    cannot gather; the gradients then differ only by the order in which each block's share of them is summed
    (measured: 0.46% at most, relative, in bf16)."""
    monkeypatch.setattr("attnres.depth_mixing.holds_full_values", lambda step: False)
    torch.manual_seed(0)
    model = AttnResForCausalLM(tiny_config()).to(torch.bfloat16)
    randomize_depth_parameters(model)
    ids = counting_dataset(num_rows=2)[0]["input_ids"][None]
    expected = model(input_ids=ids, labels=ids)
    expected.loss.backward()
    expected_grads = {name: p.grad.float() for name, p in model.named_parameters()}
    model.zero_grad()
    cast = functools.partial(cast_floating, dtype=torch.bfloat16)
    for layer in model.model.layers:
        layer.register_forward_pre_hook(lambda module, args, kwargs: (cast(args), cast(kwargs)), with_kwargs=True)
    cast_inputs = model(input_ids=ids, labels=ids)
    cast_inputs.loss.backward()
    assert torch.equal(cast_inputs.logits, expected.logits)
    for name, p in model.named_parameters():
        expected_grad = expected_grads[name]
        assert (p.grad.float() - expected_grad).norm() <= 1e-2 * expected_grad.norm(), name


# bf16 against fp32 at each step from the same parameters (tests/distributed_train.py), Block AttnRes (exact retrofit,
# zero pseudo-queries) beside the Llama it was converted from: the largest |loss - fp32 loss| over the 4 steps, and
# the largest relative error of all the gradients together, measured on 2 CPU processes:
#                                    AttnRes loss   Llama loss   AttnRes grads   Llama grads
#   DDP, accelerate bf16 autocast      1.16e-4       7.68e-5        0.67%           0.55%
#   FSDP2, bf16 parameters             1.48e-4       1.16e-4        0.88%           1.05%
# The loss's deviation is one rounded scalar per step (its sign and size vary from step to step: the Llama's ran
# 2.4e-6 to 1.2e-4 under FSDP), so each AttnRes step is held to twice the Llama's largest; the gradients' error pools
# every element and varies little, so 1.5 times. Compared run against run instead (each trained on in its own
# precision), the 4-step AdamW trajectories drift apart as any two summation orders do: 3.4e-3 (AttnRes) and 2.6e-3
# (Llama) by step 4 under DDP, 2.9e-3 and 1.2e-3 under FSDP; over 6 data seeds in one process the ratio of those
# largest deviations ranged over 0.4-2.9 while their means agreed within 20%, which is no bound a test can hold.
LOSS_BOUND, GRADIENT_BOUND = 2.0, 1.5


@pytest.mark.distributed
@pytest.mark.parametrize("run, stream", [("ddp-bf16", "float32"), ("fsdp-bf16", "bfloat16")])
def test_mixed_precision_tracks_fp32_within_the_familys_deviation(distributed_runs, run, stream):
    """Under accelerate's bf16 autocast the matrix products run in bf16 and the residual stream (the depth state's
    blocks and partial sums) stays fp32; under FSDP2's `MixedPrecisionPolicy(param_dtype=bfloat16,
    reduce_dtype=float32)` the whole state is bf16. Forward, backward and the optimizer steps run, and AttnRes's
    deviation from fp32 stays within the Llama's (`LOSS_BOUND`, `GRADIENT_BOUND`)."""
    attnres, llama = distributed_runs[run]["attnres"], distributed_runs[run]["llama"]
    for record in (attnres, llama):
        assert record["precision"] == "bf16" and record["world_size"] == 2
        assert record["dtypes"] == {"matmul": ["bfloat16"], "stream": [stream]}
        assert len(record["losses"]) == len(record["fp32_losses"]) == len(record["grad_errors"]) == 4
        assert all(math.isfinite(loss) for loss in record["losses"]) and record["losses"][0] != record["losses"][-1]
    if run == "fsdp-bf16":
        assert attnres["parameter"] == "DTensor" and attnres["wrapper"] == "FSDPAttnResForCausalLM"
    deviation = {
        name: [abs(low - high) for low, high in zip(record["losses"], record["fp32_losses"])]
        for name, record in (("attnres", attnres), ("llama", llama))
    }
    assert max(deviation["llama"]) > 0 and min(llama["grad_errors"]) > 0  # bf16 did round
    for step in range(4):
        assert deviation["attnres"][step] <= LOSS_BOUND * max(deviation["llama"]), (step, deviation)
        assert attnres["grad_errors"][step] <= GRADIENT_BOUND * max(llama["grad_errors"]), (step, attnres, llama)


# --- the retrofit step on the real SmolLM2 ------------------------------------------------------------------------


def test_depth_attention_table_and_plot(tmp_path):
    model = AttnResForCausalLM(tiny_config())
    randomize_depth_parameters(model)
    ids = counting_dataset(num_rows=2)[0]["input_ids"][None]
    grid = depth_attention_table(model, ids)
    # 6 sublayers + output; block size 2 gives b0..b3 and the partial column.
    assert grid.values.shape == (7, 5) and grid.sources == ["b0 (embedding)", "b1", "b2", "b3", "partial"]
    assert grid.steps == ["attn 0", "mlp 0", "attn 1", "mlp 1", "attn 2", "mlp 2", "output"]
    torch.testing.assert_close(grid.values.nansum(dim=1), torch.ones(7))
    present = ~grid.values.isnan()
    assert present.sum(dim=1).tolist() == [1, 2, 2, 3, 3, 4, 4]
    assert present[1, -1] and not present[2, -1] and not present[6, -1]  # partial only inside a block
    path = plot_depth_attention(model, ids, tmp_path / "depth.png", title="tiny")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_token_windows_and_plays():
    windows = token_windows(torch.arange(10), 4)
    assert windows.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert token_windows(torch.arange(10), 4, max_windows=1).shape == (1, 4)
    with pytest.raises(ValueError):
        token_windows(torch.arange(3), 4)
    plays = shakespeare_plays(["hamlet", "macbeth"])
    assert list(plays) == ["hamlet", "macbeth"] and "Fair is foul" in plays["macbeth"]
    with pytest.raises(FileNotFoundError, match="hamlet_folio"):
        shakespeare_plays(["hamlet_folio"])


# The CI budget: small enough for a 2-core CPU, enough to move the loss (lr 2e-4: 1e-3 overshoots on SmolLM2).
RETROFIT_STEPS = 8


def test_demo_retrofit_depth_only_lowers_the_held_out_loss_of_converted_smollm2(converted_smollm2, tmp_path):
    saved = tmp_path / "retrofitted"
    report, plot = demo_retrofit(converted_smollm2, steps=RETROFIT_STEPS, plot_path=tmp_path / "depth.png", save_to=saved)
    print(f"\n[depth only] {report.format()}")
    assert report.trainable_parameters == 70272  # 61 mixing steps x (pseudo-query + key norm) x 576
    assert report.steps == RETROFIT_STEPS and len(report.train_losses) == RETROFIT_STEPS
    assert report.eval_loss_after < report.eval_loss_before - 0.01, report.format()
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The trained model is saved beside the conversion's tokenizer and code; the conversion is left untrained.
    assert {p.name for p in converted_smollm2.iterdir()} <= {p.name for p in saved.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".retrofitted")]  # no work folder left behind
    trained = AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32)
    untrained = AutoModelForCausalLM.from_pretrained(converted_smollm2, dtype=torch.float32)
    queries = {n: p for n, p in trained.named_parameters() if n.endswith("pseudo_query")}
    untouched = [n for n, p in queries.items() if p.abs().max() == 0]
    assert len(queries) == 61 and untouched == ["model.layers.0.attn_residual.query.pseudo_query"], untouched  # 1 source
    assert all(p.abs().max() == 0 for n, p in untrained.named_parameters() if n.endswith("pseudo_query"))
    for (name, a), (_, b) in zip(trained.named_parameters(), untrained.named_parameters()):
        assert is_depth_parameter(name) or torch.equal(a, b), name  # only the depth parameters were trained


def test_retrofit_with_lora_lowers_the_held_out_loss_of_converted_smollm2(converted_smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(converted_smollm2)
    model = AutoModelForCausalLM.from_pretrained(converted_smollm2, dtype=torch.float32)
    model = get_peft_model(model, lora_config(r=8, lora_alpha=16))
    plays = shakespeare_plays(["hamlet", "macbeth"])
    report = retrofit_depth(
        model, tokenizer, [plays["hamlet"]], [plays["macbeth"]], steps=RETROFIT_STEPS, depth_only=False, progress=False
    )
    print(f"\n[LoRA + depth] {report.format()}")
    lora_parameters = sum(p.numel() for n, p in model.named_parameters() if "lora_" in n)
    assert report.trainable_parameters == 70272 + lora_parameters and lora_parameters > 0
    assert report.eval_loss_after < report.eval_loss_before - 0.01, report.format()


# --- examples -----------------------------------------------------------------------------------------------------


def test_pretrain_example_writes_curves_and_table(tmp_path):
    command = [
        sys.executable,
        str(REPO_ROOT / "examples" / "pretrain.py"),
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--hidden-size",
        "32",
        "--layers",
        "2",
        "--seq-len",
        "32",
        "--batch-size",
        "4",
        "--output",
        str(tmp_path),
    ]
    result = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
    table = (tmp_path / "results.md").read_text()
    assert "| standard |" in table and "| block |" in table
    results = json.loads((tmp_path / "results.json").read_text())
    assert {run["residual_mode"] for run in results["runs"]} == {"standard", "block"}
    assert all(len(run["eval"]) == 2 for run in results["runs"])


@pytest.mark.distributed
@pytest.mark.parametrize(
    "overrides",
    [dict(residual_mode="block"), dict(residual_mode="full", num_local_experts=4, num_experts_per_tok=2)],
    ids=["block-dense", "full-moe"],
)
def test_tensor_parallel_logits_equal_one_process(tmp_path, overrides):
    """`tp_plan="auto"` under torchrun over 2 CPU processes (gloo) shards what `base_model_tp_plan` names (vLLM's
    Transformers backend reads the same plan for its TP) and leaves the depth-mixing modules whole."""
    model = AttnResForCausalLM(tiny_config(hidden_size=64, **overrides))
    randomize_depth_parameters(model)
    model.save_pretrained(tmp_path / "model")
    script = str(REPO_ROOT / "tests" / "distributed_tp.py")
    arguments = ["--checkpoint", str(tmp_path / "model")]
    launch([sys.executable, script, *arguments, "--output", str(tmp_path / "single.pt")], tmp_path / "single.log")
    launch([*torchrun(script), *arguments, "--tp", "--output", str(tmp_path / "tp.pt")], tmp_path / "tp.log")
    single, sharded = torch.load(tmp_path / "single.pt"), torch.load(tmp_path / "tp.pt")

    sublayers = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    sublayers += experts if FAMILIES[model.config.family].moe else ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
    for expected in (f"model.layers.{i}.{name}" for i in range(model.config.num_hidden_layers) for name in sublayers):
        assert any(name.startswith(expected) for name in sharded["sharded"]), (expected, sharded["sharded"])
    assert not any("residual" in name for name in sharded["sharded"])
    assert single["sharded"] == []
    torch.testing.assert_close(sharded["logits"], single["logits"], rtol=0, atol=1e-5)
