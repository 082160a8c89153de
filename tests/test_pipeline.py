"""Pipeline parallelism (`attnres.training.pipeline`) on PyTorch's engine: the layout and its refusals in one process;
then every case of tests/distributed_pipeline.py under torchrun on gloo, 2 and 4 CPU processes (two launches), against
one process: each step's loss and every parameter's gradient, the bytes the cross-stage cache sends against the
formula of docs/design.md §11, a saved checkpoint reloaded in one process, FSDP2 inside the stages, bf16 autocast
against the family's own model pipelined the same way; and examples/pretrain_pp.py."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import error_lines, randomize_depth_parameters, tiny_config
from distributed_pipeline import (
    BATCH,
    CASES,
    GLM_LAYOUT,
    KOLIBRI_LAYOUT,
    KOLIBRI_SLIDING_FIRST,
    SEQ_LEN,
    SHAPE,
    batches,
    build_model,
    family_model,
    reference_step,
)
from family_cases import CASES as FAMILY_CASES
from family_cases import COMMON, prompt_ids, source_model
from test_training import GRADIENT_BOUND, LOSS_BOUND, launch, launcher_env
from transformers import AutoModelForCausalLM

from attnres import AttnResForCausalLM
from attnres.conversion.architectures import attnres_config
from attnres.families import FAMILIES
from attnres.training.pipeline import PipelineLayout, PipelineLoss, pipeline_schedule, stage_modules


REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCHES = {
    2: [name for name, case in CASES.items() if case.ranks * case.data_parallel == 2],
    4: [name for name, case in CASES.items() if case.ranks * case.data_parallel == 4],
}


# --- the layout, in one process -----------------------------------------------------------------------------------


def test_layout_splits_layers_evenly_and_places_stages_in_a_loop():
    model = AttnResForCausalLM(tiny_config(num_hidden_layers=7, block_size=3))
    layout = PipelineLayout.of(model, num_ranks=2, stages_per_rank=2)
    assert layout.stage_layers == (range(0, 2), range(2, 4), range(4, 6), range(6, 7))
    assert [layout.rank(stage) for stage in range(4)] == [0, 1, 0, 1]
    # 14 sublayers in blocks of 3 (the last of 2): the cuts after sublayers 4 and 8 fall inside a block, the one
    # after 12 between two; the last sublayer closes the last block.
    assert [layout.blocks_after(stage) for stage in range(4)] == [2, 3, 5, 6]
    assert [layout.partial_after(stage) for stage in range(3)] == [True, True, False]


def tensors_per_microbatch(num_layers: int, block_size: int, ranks: int, stages_per_rank: int, cached: bool) -> int:
    """docs/design.md §11's count for equal stages, written out on its own: the boundary after stage t (t = 0..C-2)
    sends the blocks completed after its sublayer p = (t + 1) s, b_0 included, and the partial sum if p cuts a block;
    cached, minus the blocks the receiving rank held after its previous stage t + 1 - P."""
    stages = ranks * stages_per_rank
    per_stage = 2 * num_layers // stages
    total = 0
    for t in range(stages - 1):
        cut = per_stage * (t + 1)
        blocks = 1 + cut // block_size
        seen_at = per_stage * (t + 2 - ranks)
        if cached and t + 1 - ranks >= 0:
            blocks -= 1 + seen_at // block_size
        total += blocks + (cut % block_size != 0)
    return total


@pytest.mark.parametrize(
    "num_layers, block_size, ranks, stages_per_rank, naive, cached",
    [(4, 3, 2, 2, 8, 5), (8, 4, 4, 2, 23, 15), (8, 2, 2, 4, 35, 8), (4, 4, 2, 1, 2, 2)],
)
def test_layout_counts_the_tensors_of_the_formula(num_layers, block_size, ranks, stages_per_rank, naive, cached):
    """The counts written by hand (docs/design.md §11): 4 layers in blocks of 3 sublayers on 2 ranks x 2 stages
    send 2 + 3 + 3 tensors naively and 2 + 2 + 1 cached; the layout and the formula agree with them."""
    model = AttnResForCausalLM(tiny_config(num_hidden_layers=num_layers, block_size=block_size))
    layout = PipelineLayout.of(model, ranks, stages_per_rank)
    for is_cached, expected in ((False, naive), (True, cached)):
        assert layout.tensors_sent(is_cached) == expected
        assert tensors_per_microbatch(num_layers, block_size, ranks, stages_per_rank, is_cached) == expected


@pytest.mark.parametrize(
    "overrides, ranks, stages_per_rank, message",
    [
        (dict(residual_mode="mhc"), 2, 1, "residual_mode='mhc'"),
        (dict(residual_mode="block", depth_ablation="sigmoid"), 2, 1, "'block with ablation'"),
        (dict(tie_word_embeddings=True), 2, 1, "tie_word_embeddings=True"),
        (dict(), 1, 2, "num_ranks=1"),
        (dict(), 2, 2, "stages_per_rank=2 = 4 stages"),
    ],
    ids=["mhc", "ablation", "tied", "one-rank", "more-stages-than-layers"],
)
def test_layout_refuses_what_it_cannot_split(overrides, ranks, stages_per_rank, message):
    model = AttnResForCausalLM(tiny_config(**overrides))  # 3 layers
    with pytest.raises(ValueError, match=message):
        PipelineLayout.of(model, ranks, stages_per_rank)


@pytest.mark.parametrize(
    "name, stages, message",
    [("zero-bubble", [None], "schedule='zero-bubble': allowed values"), ("1f1b", [None, None], "runs one stage")],
)
def test_schedule_refuses_unknown_names_and_stage_counts(name, stages, message):
    with pytest.raises(ValueError, match=message):
        pipeline_schedule(name, stages, microbatches=2, loss=None)


@pytest.mark.parametrize("distributed_config", [{"pp_size": 2}, "DistributedConfig"])
def test_transformers_own_pipeline_parallelism_is_refused_in_one_line(tmp_path, distributed_config):
    """Transformers' `pp_size` would split the layers and pass one tensor between them: refused before any process
    group or mesh is set up, naming what to use instead."""
    if distributed_config == "DistributedConfig":
        from transformers.distributed import DistributedConfig

        distributed_config = DistributedConfig(pp_size=2)
    AttnResForCausalLM(tiny_config()).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"^distributed_config pp_size=2: .*attnres\.training\.pipeline"):
        AutoModelForCausalLM.from_pretrained(tmp_path, distributed_config=distributed_config)


def run_stages(
    modules: list, ids: torch.Tensor, loss: PipelineLoss, backward: bool = True
) -> tuple[torch.Tensor, torch.Tensor | tuple]:
    """One microbatch through the stages in order, forward then (`backward`) backward, as the engine runs them: a
    stage after the first reads the tensors the one before returned, detached (leaves of its own graph, requiring their
    gradient where the sender's do); the last stage's backward starts from the loss, each earlier one's from the
    gradients left on the next stage's inputs (zeros where none reached them). Returns the loss and the last stage's
    output; the parameters hold their gradients."""
    inputs, runs = (ids,), []
    for module in modules:
        outputs = module(*inputs)
        runs.append((inputs, outputs))
        inputs = tuple(t.detach().requires_grad_(t.requires_grad) for t in outputs)
    output = runs[-1][1]
    value = loss(output, ids)
    if not backward:
        return value, output
    value.backward()
    for stage in reversed(range(len(runs) - 1)):
        outputs, received = runs[stage][1], runs[stage + 1][0]
        sent = [(output, leaf) for output, leaf in zip(outputs, received) if output.requires_grad]
        grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for _, leaf in sent]
        torch.autograd.backward([output for output, _ in sent], grad_tensors=grads)
    return value, output


def assert_stages_compute_the_model(
    model: AttnResForCausalLM, cached: bool, with_aux_loss: bool, with_gradients: bool = True
) -> None:
    """The stages of `model`, 2 ranks x 2 stages (a rank's stages sharing its cache), chained in one process
    (`run_stages`): the model's logits, its load-balancing loss where `with_aux_loss`, its loss and, `with_gradients`,
    every parameter's gradient (within 1e-5 of its largest entry, or of 1: the stages sum in another order)."""
    ids = prompt_ids()
    model.zero_grad()
    expected = model(input_ids=ids, labels=ids)
    if with_gradients:
        expected.loss.backward()
    expected_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    layout = PipelineLayout.of(model, num_ranks=2, stages_per_rank=2)
    modules = sorted(
        (module for rank in range(2) for module in stage_modules(model, layout, rank, cross_stage_cache=cached)),
        key=lambda module: module.stage_index,
    )
    loss, outputs = run_stages(modules, ids, PipelineLoss(model.config), with_gradients)
    logits, aux_loss = outputs if with_aux_loss else (outputs, None)
    torch.testing.assert_close(logits, expected.logits, rtol=0, atol=1e-5)
    if with_aux_loss:
        torch.testing.assert_close(aux_loss[0], expected.aux_loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(loss, expected.loss, rtol=0, atol=1e-5)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == set(expected_grads)
    for name, grad in expected_grads.items():
        scale = max(1.0, grad.abs().max().item())  # LFM2's short-convolution biases: gradients in the thousands
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-5 * scale, msg=name)


# The cases whose family's own model computes no gradient: xLSTM's config runs its kernels in `mode="inference"`.
NO_GRADIENTS = ["xlstm"]


@pytest.mark.parametrize("case", list(FAMILY_CASES))
@pytest.mark.parametrize("cached", [False, True], ids=["naive", "cached"])
def test_every_family_splits_into_stages_that_compute_the_model(case, cached):
    """In one process, the stages of every decoder family (2 ranks x 2 stages of one layer, blocks of 3 sublayers
    spanning the cuts) give the model's logits, loss and gradients, and for the MoE families its load-balancing loss:
    the per-type masks and rotary embeddings, multipliers and soft-caps of each family reach the stages that read
    them, a hybrid's linear attentions their recurrent masks, and what GLM-5's and Kolibri 1.1's attention passes from
    layer to layer (top-k indices; a key pool, and keys and values a later layer reuses) crosses every boundary."""
    model_type, fields = FAMILY_CASES[case]
    moe = FAMILIES[model_type].moe
    overrides = dict(num_hidden_layers=4)
    family_fields = {field.name for field in dataclasses.fields(FAMILIES[model_type].config_class)}
    if moe and "output_router_logits" in family_fields:  # Aria's config has no such field
        overrides["output_router_logits"] = True
    layers = fields.get("num_hidden_layers", COMMON["num_hidden_layers"])
    for name, value in fields.items():  # the case's per-layer settings (layer types, MLP types), cycled
        if isinstance(value, list) and len(value) == layers:
            overrides[name] = (value * 4)[:4]
    source = source_model(case, **overrides)
    with_loss = bool(moe and moe.load_balancing_loss)  # DeepSeek-V3, GLM-4.5, HunYuan, Llama 4: logits only
    config = attnres_config(source.config, mode="block", block_size=3, exact_retrofit=False)
    torch.manual_seed(0)
    model = AttnResForCausalLM(config).eval()
    randomize_depth_parameters(model)
    assert_stages_compute_the_model(model, cached, with_loss, with_gradients=case not in NO_GRADIENTS)


@pytest.mark.parametrize(
    "case, overrides, threaded, naive, cached",
    [
        ("glm_moe_dsa", GLM_LAYOUT, [True] * 3, [(), (), ()], None),
        ("kolibri1_1", KOLIBRI_LAYOUT, [True] * 3, [(0,), (0,), (0,)], [(0,), (), ()]),
        ("kolibri1_1", KOLIBRI_SLIDING_FIRST, [False, True, True], [(), (1,), ()], None),
    ],
    ids=["glm-5", "kolibri-1.1", "kolibri-1.1-sliding-first"],
)
def test_boundaries_carry_what_the_attention_threads_between_layers(case, overrides, threaded, naive, cached):
    """4 layers on 2 ranks x 2 stages: each boundary carries what the layer before it threads to the next where it
    returned a tensor (a Kolibri 1.1 layer before the first indexer returns `None`), and the shared entries (keys and
    values) of earlier layers that a later layer reads, cached only where the receiving rank does not hold them; the
    stages compute the model. The same models run under torchrun (`CASES`)."""
    model = family_model(case, overrides).eval()
    layout = PipelineLayout.of(model, num_ranks=2, stages_per_rank=2)
    for is_cached, shared in ((False, naive), (True, cached or naive)):
        transfers = [layout.transfer(stage, is_cached) for stage in range(3)]
        assert [transfer.threaded for transfer in transfers] == threaded
        assert [transfer.shared for transfer in transfers] == shared
        assert_stages_compute_the_model(model, is_cached, with_aux_loss=False)


# --- under torchrun -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory) -> dict[str, list[dict]]:
    """Every case, each rank's record of it: one torchrun launch over 2 processes, one over 4."""
    folder = tmp_path_factory.mktemp("pipeline")
    script = str(REPO_ROOT / "tests" / "distributed_pipeline.py")
    runs = {}
    for processes, names in LAUNCHES.items():  # one after another: each fills the 2 CI cores
        output = folder / str(processes)
        output.mkdir()
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(processes)]
        launch([*command, script, "--cases", *names, "--output", str(output)], folder / f"{processes}.log")
        ranks = [torch.load(output / f"rank{rank}.pt") for rank in range(processes)]
        runs |= {name: [records[name] for records in ranks] for name in names}
        runs |= {f"{name}/checkpoint": output / name for name in names if CASES[name].save}
    return runs


def merged(records: list[dict], field: str, step: int) -> dict[str, torch.Tensor]:
    """One step's tensors of every rank by parameter name; ranks that hold the same stage (FSDP shards, gathered)
    must agree."""
    tensors = {}
    for record in records:
        for name, tensor in record[field][step].items():
            if name in tensors:
                assert torch.equal(tensors[name], tensor), name
            tensors[name] = tensor
    return tensors


@pytest.mark.distributed
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if not case.mixed_precision])
def test_pipeline_steps_equal_one_process(pipeline_runs, name):
    """At each step, from the parameters the pipeline holds, one process computes the same loss (the mean over the
    same microbatches) and the same gradient of every parameter. Compared step by step at the same parameters,
    since any two summation orders drift apart over training steps (tiny blocks under the key norm amplify
    float rounding), which would test the optimizer rather than the pipeline."""
    case, records = CASES[name], pipeline_runs[name]
    model = build_model(case)
    names = {name for name, _ in model.named_parameters()}
    losses = records[0]["losses"]
    assert len(losses) == len(batches()) - 1 and len(set(losses)) == len(losses)  # the steps did train
    for step, batch in enumerate(batches()[:-1]):
        parameters = merged(records, "parameters", step)
        assert set(parameters) == names  # the stages hold the whole model, under its names
        model.load_state_dict(parameters, strict=False)  # its buffers as built (GLM-5's routing bias, not trained)
        loss, grads = reference_step(model, case, batch)
        assert all(record["losses"][step] == losses[step] for record in records)
        assert abs(losses[step] - loss) <= 1e-5, (step, losses[step], loss)
        pipelined = merged(records, "grads", step)
        assert set(pipelined) == set(grads) <= names  # GLM-5's indexers run without autograd, as in its own model
        for parameter, grad in grads.items():
            torch.testing.assert_close(pipelined[parameter], grad, rtol=0, atol=1e-5, msg=f"step {step}: {parameter}")
    moe = FAMILIES[model.config.family].moe
    if moe and moe.load_balancing_loss:  # the load-balancing loss is in: without it the loss differs
        model.config.router_aux_loss_coef = 0.0
        without, _ = reference_step(model, case, batches()[-2])
        assert abs(without - losses[-1]) > 1e-4
    if case.data_parallel > 1:
        assert all(record["sharded"] for record in records)  # FSDP2 held the parameters as DTensor shards


def deviations_from_fp32(name: str, records: list[dict]) -> tuple[list[float], list[float]]:
    """Per step, from the parameters the pipeline held: |its loss - one fp32 process's loss| over the same
    microbatches, and the relative error of all its gradients together against that process's."""
    case = CASES[name]
    model = build_model(case)
    losses, grad_errors = [], []
    for step, batch in enumerate(batches()[:-1]):
        model.load_state_dict(merged(records, "parameters", step))
        loss, grads = reference_step(model, case, batch)
        pipelined = merged(records, "grads", step)
        assert set(pipelined) == set(grads) == {name for name, _ in model.named_parameters()}
        error = sum((pipelined[parameter] - grad).pow(2).sum() for parameter, grad in grads.items()).sqrt()
        norm = sum(grad.pow(2).sum() for grad in grads.values()).sqrt()
        losses.append(abs(records[0]["losses"][step] - loss))
        grad_errors.append((error / norm).item())
    return losses, grad_errors


@pytest.mark.distributed
def test_pipeline_under_autocast_tracks_fp32_within_the_familys_deviation(pipeline_runs):
    """Block AttnRes (blocks of 3 spanning the cuts, 2 ranks x 2 stages, cross-stage cache) trained under
    `torch.autocast(bfloat16)` deviates from one fp32 process, step by step from the same parameters, no more than the
    family's own model (standard mode, the Llama it was converted from) pipelined the same way: measured, the largest
    loss deviation over the 3 steps 7.19e-5 (standard 7.26e-5), the gradients' relative error 0.48% (0.52%). The
    bounds are those of tests/test_training.py's mixed-precision runs (`LOSS_BOUND`, `GRADIENT_BOUND`). The blocks
    cross the boundaries in the stream's dtype, fp32 (the statistics are recomputed on the receiving side): the bytes
    sent are the formula's in fp32."""
    block, standard = "block-interleaved-bf16", "standard-interleaved-bf16"
    losses, grad_errors = deviations_from_fp32(block, pipeline_runs[block])
    family_losses, family_grad_errors = deviations_from_fp32(standard, pipeline_runs[standard])
    assert max(family_losses) > 0 and min(family_grad_errors) > 0  # bf16 did round
    for step in range(len(losses)):
        assert losses[step] <= LOSS_BOUND * max(family_losses), (step, losses, family_losses)
        assert grad_errors[step] <= GRADIENT_BOUND * max(family_grad_errors), (step, grad_errors, family_grad_errors)
    case = CASES[block]
    config = build_model(case).config
    count = tensors_per_microbatch(
        config.num_hidden_layers, config.depth_block_size, case.ranks, case.stages_per_rank, cached=True
    )
    fp32_bytes = count * BATCH * SEQ_LEN * SHAPE["hidden_size"] * 4  # per microbatch, times the microbatches
    for step in range(len(losses)):
        assert sum(sent for record in pipeline_runs[block] for sent, _ in record["traffic"][step]) == fp32_bytes


@pytest.mark.distributed
@pytest.mark.parametrize(
    "cached, naive, tensors",
    [
        ("block-interleaved", "block-interleaved-naive", (5, 8)),
        ("block-interleaved-4", "block-interleaved-4-naive", (15, 23)),
    ],
    ids=["2-ranks", "4-ranks"],
)
def test_cross_stage_cache_sends_the_bytes_of_the_formula(pipeline_runs, cached, naive, tensors):
    """The bytes the stages handed to gloo in each step, summed over the ranks: per microbatch, the formula's count of
    blocks and partial sums, each `[microbatch, seq, hidden]` fp32; the same again for their gradients."""
    case = CASES[cached]
    config = build_model(case).config
    tensor_bytes = BATCH // case.microbatches * SEQ_LEN * SHAPE["hidden_size"] * 4
    for run, count, is_cached in ((cached, tensors[0], True), (naive, tensors[1], False)):
        assert count == tensors_per_microbatch(
            config.num_hidden_layers, config.depth_block_size, case.ranks, case.stages_per_rank, is_cached
        )
        for step in range(len(batches()) - 1):
            activations = sum(sent for record in pipeline_runs[run] for sent, _ in record["traffic"][step])
            gradients = sum(sent for record in pipeline_runs[run] for _, sent in record["traffic"][step])
            assert activations == gradients == count * case.microbatches * tensor_bytes, (run, step)


@pytest.mark.distributed
@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.save])
def test_saved_checkpoint_reloads_in_one_process_with_equal_logits(pipeline_runs, name):
    model = AutoModelForCausalLM.from_pretrained(pipeline_runs[f"{name}/checkpoint"]).eval()
    assert type(model) is AttnResForCausalLM
    # The last stage's ranks in rank order: one per data-parallel shard of the batch.
    logits = torch.cat([record["logits"] for record in pipeline_runs[name] if "logits" in record])
    with torch.no_grad():
        reloaded = model(input_ids=batches()[-1]).logits
    torch.testing.assert_close(reloaded, logits, rtol=0, atol=1e-5)


# --- the example --------------------------------------------------------------------------------------------------


EXAMPLE = str(REPO_ROOT / "examples" / "pretrain_pp.py")


@pytest.mark.parametrize(
    "arguments, message",
    [
        (["--layers", "2", "--stages-per-rank", "2"], "--stages-per-rank=2: 2 ranks x 2 = 4 stages"),
        (["--batch-size", "6", "--microbatches", "4"], "--microbatches=4"),
        (["--schedule", "zero-bubble"], "--schedule: invalid choice: 'zero-bubble'"),
    ],
    ids=["more-stages-than-layers", "microbatches-do-not-divide", "unknown-schedule"],
)
def test_pretrain_pp_refuses_bad_input_in_one_line_before_starting(arguments, message):
    """Checked before any process group starts: run without torchrun, with the world size torchrun would set."""
    env = {**launcher_env(), "WORLD_SIZE": "2"}
    result = subprocess.run([sys.executable, EXAMPLE, *arguments], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr
    assert len(error_lines(result.stderr)) == 1 and message in result.stderr, result.stderr


@pytest.mark.distributed
def test_pretrain_pp_example_trains_under_torchrun(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", EXAMPLE]
    arguments = ["--steps", "4", "--eval-every", "2", "--hidden-size", "32", "--layers", "2", "--seq-len", "32"]
    arguments += ["--batch-size", "4", "--microbatches", "2", "--eval-windows", "4", "--output", str(tmp_path)]
    launch([*command, *arguments], tmp_path / "log.txt")
    results = json.loads((tmp_path / "results.json").read_text())
    assert {run["residual_mode"] for run in results["runs"]} == {"standard", "block"}
    assert all(len(run["train"]) == 4 and len(run["eval"]) == 2 for run in results["runs"])
    assert (tmp_path / "loss_curves.png").read_bytes()[:4] == b"\x89PNG"
