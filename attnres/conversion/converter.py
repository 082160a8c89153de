"""`convert`: retrofit a PreNorm checkpoint (Llama, Mistral, Mixtral, Qwen2) into AttnRes, and prove it.

The shared weights keep their names, so conversion copies tensors shard by shard from the source safetensors into
the destination, adds zero pseudo-queries and unit key-norm gains, writes an `AttnResConfig` with the exact retrofit
on (docs/design.md §5), and copies the tokenizer, chat template, generation config and the remote code. Everything is
written into a temporary folder beside DST; it becomes DST by a rename only after verification passed, so DST is either
absent, left as it was, or complete and verified.
"""

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoConfig
from transformers.dynamic_module_utils import custom_object_save

from ..configuration_attnres import RESIDUAL_MODES, AttnResConfig
from ..inputs import ModelSource, check_destination, check_model_source, check_positive_int
from ..modeling_attnres import AttnResForCausalLM
from .architectures import (
    ConversionError,
    TensorRenamer,
    attnres_config,
    block_size_rule,
    initial_depth_parameter,
    is_depth_parameter,
    source_architecture,
)
from .fla import FLA_ARCHITECTURE, FlaRenamer, fla_conversion_config, fla_verification_problem, is_fla_config
from .fla_reference import fla_on_torch
from .sources import (
    SAFETENSORS_INDEX,
    LocalSource,
    copy_carried_files,
    raw_source_config,
    resolve_source,
    source_config,
)
from .verify import (
    DEFAULT_TEXT_TOKENS,
    Tolerance,
    VerificationError,
    VerificationReport,
    check_verification_text,
    verification_summary,
    verify_conversion,
)


@dataclass
class ConversionReport:
    """What `convert` did, and the verification's findings when it ran."""

    source: str
    destination: str
    architecture: str
    residual_mode: str
    block_size: int  # the depth block size in sublayers (1 for Full AttnRes)
    num_blocks: int
    num_sublayers: int
    exact_retrofit: bool
    dtype: str
    num_tensors: int
    num_shards: int
    depth_parameters: int  # parameters added (pseudo-queries and key-norm gains)
    carried_files: list[str] = field(default_factory=list)
    seconds: float = 0.0
    verification: VerificationReport | None = None
    # Why the verification did not run, when it was asked for and could not (an FLA source without FLA).
    unverified_reason: str | None = None

    def format(self) -> str:
        lines = [
            f"Converted {self.architecture} {self.source}",
            f"       -> {self.destination}",
            f"  residual        {self.residual_mode}, block size {self.block_size} sublayers, {self.num_blocks} blocks "
            f"over {self.num_sublayers} sublayers",
            f"  exact retrofit  {'on (step outputs x k)' if self.exact_retrofit else 'off'}",
            f"  weights         {self.num_tensors} tensors in {self.num_shards} shard(s), {self.dtype}, "
            f"{self.depth_parameters} depth-mixing parameters added",
            f"  carried over    {', '.join(self.carried_files) or '-'}",
            f"  time            {self.seconds:.1f} s",
        ]
        lines.append(verification_summary(self.verification, self.unverified_reason))
        return "\n".join(lines)

    __str__ = format


def convert(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    mode: str | None = None,
    block_size: int | None = None,
    dtype: torch.dtype | str | None = None,
    verify: bool = True,
    overwrite: bool = False,
    exact_retrofit: bool = True,
    gguf_file: str | None = None,
    revision: str | None = None,
    tolerance: Tolerance = Tolerance(),
    verify_dtype: torch.dtype = torch.float32,
    text: str | None = None,
    max_text_tokens: int = DEFAULT_TEXT_TOKENS,
    progress: bool = True,
) -> ConversionReport:
    """Convert a Llama / Mistral / Mixtral / Qwen2 checkpoint, or an FLA AttnRes one (`fla.py`), into an AttnRes
    checkpoint at `destination`.

    Args:
        source: a local Transformers folder (safetensors), a local `.gguf` file, or a Hub repository id. Never
            modified.
        destination: the folder to create. Refused if it exists, unless `overwrite`; replaced only after the new
            checkpoint is complete and verified.
        mode: `"block"` (Block AttnRes, the default), `"full"` (Full AttnRes), or `"standard"` (a PreNorm baseline in
            AttnRes format); an FLA checkpoint keeps its own, and another is refused.
        block_size: Block AttnRes block size in sublayers; defaults to the config's, blocks of whole layers, about 8.
        dtype: cast floating-point weights to this dtype; by default every tensor keeps its dtype (GGUF files are
            dequantised to float32).
        verify: run source and result on probe prompts and a text, and fail unless they agree within `tolerance`.
        exact_retrofit: scale each depth-mixing step's output by its number of sources k, so the result equals the
            source to float precision (docs/design.md §5). Without it the models differ by the RMSNorm eps, which may
            fail verification.
        gguf_file: the GGUF file inside `source` when `source` is a Hub id or a folder.
        revision: Hub revision for Hub ids.
        tolerance, verify_dtype, text, max_text_tokens: see `verify_conversion`.
        progress: show a progress bar per shard.

    Returns:
        The `ConversionReport` (with its `VerificationReport` when `verify`).

    Raises:
        FileNotFoundError: SRC, its config.json or `gguf_file` does not exist; nothing is written.
        ConversionError: a bad option, or a source that cannot be converted, or an unsafe DST; nothing is written.
            Everything that needs no weights is checked before any is read.
        VerificationError: the result does not match its source; nothing is written. `error.report` holds the
            `ConversionReport`.
    """
    started = time.perf_counter()
    located, destination = _check_arguments(
        source,
        destination,
        mode=mode,
        block_size=block_size,
        overwrite=overwrite,
        gguf_file=gguf_file,
        revision=revision,
        text=text,
        max_text_tokens=max_text_tokens,
    )
    if text is not None and not verify:
        raise ConversionError("text: used only by the verification, which verify=False skips")
    dtype = _as_dtype("dtype", dtype)
    verify_dtype = _as_dtype("verify_dtype", verify_dtype)
    fla_source = raw_source_config(located, revision)
    if fla_source is not None and not is_fla_config(fla_source):
        fla_source = None
    if fla_source is not None:  # FLA's AttnRes model: its residual comes with it, refusals before any weight
        fla_target = fla_conversion_config(fla_source, mode=mode, block_size=block_size)
    else:
        mode = mode or "block"
        preflight = source_config(located, revision)
        if preflight is not None:  # the architecture and the block size, before any weight is read
            attnres_config(preflight, mode=mode, block_size=block_size, exact_retrofit=exact_retrofit)
    destination.parent.mkdir(parents=True, exist_ok=True)

    with work_folder(destination) as work:
        staging, output = work / "source", work / "converted"
        staging.mkdir()
        output.mkdir()
        resolved = resolve_source(located, staging=staging, description=str(source), revision=revision)
        if fla_source is not None:
            architecture, config, rename = f"FLA {FLA_ARCHITECTURE}", fla_target, FlaRenamer(fla_target)
        else:
            original_config = AutoConfig.from_pretrained(resolved.folder)
            architecture = source_architecture(original_config).architecture
            config = attnres_config(original_config, mode=mode, block_size=block_size, exact_retrofit=exact_retrofit)
            rename = TensorRenamer(config)
        if verify:  # a text the source cannot read is refused before any weight is
            try:
                check_verification_text(resolved.folder, config.vocab_size, text, f"source={str(source)!r}")
            except ValueError as error:
                raise ConversionError(*error.args) from None
        num_tensors, num_shards, depth_parameters, model_dtype = write_weights(
            resolved, config, output, rename, dtype=dtype, progress=progress
        )
        config.dtype = model_dtype
        carried = copy_carried_files(resolved, output)
        config.save_pretrained(output)
        custom_object_save(AttnResForCausalLM, output)

        report = ConversionReport(
            source=resolved.description,
            destination=str(destination),
            architecture=architecture,
            residual_mode=config.residual_mode,
            block_size=config.depth_block_size,
            num_blocks=math.ceil(config.num_sublayers / config.depth_block_size),
            num_sublayers=config.num_sublayers,
            exact_retrofit=config.exact_retrofit,
            dtype=str(model_dtype).removeprefix("torch."),
            num_tensors=num_tensors,
            num_shards=num_shards,
            depth_parameters=depth_parameters,
            carried_files=carried,
        )
        report.unverified_reason = fla_verification_problem() if verify and fla_source is not None else None
        if verify and report.unverified_reason is None:
            with fla_on_torch() if fla_source is not None else contextlib.nullcontext():
                report.verification = verify_conversion(
                    resolved.folder,
                    output,
                    tolerance=tolerance,
                    dtype=verify_dtype,
                    weights_dtype=dtype,
                    text=text,
                    max_text_tokens=max_text_tokens,
                    source_generates_with_cache=fla_source is None,
                )
            if not report.verification.passed:
                report.seconds = time.perf_counter() - started
                raise VerificationError(
                    report,
                    f"{destination} was not written: the converted model does not match its source "
                    f"({'; '.join(report.verification.failures)}).",
                )
        publish(output, destination, work)
        report.seconds = time.perf_counter() - started
        return report


def write_weights(
    source: LocalSource,
    config: AttnResConfig,
    output: Path,
    rename: "TensorRenamer | FlaRenamer",
    *,
    dtype: torch.dtype | None = None,
    progress: bool = True,
) -> tuple[int, int, int, torch.dtype]:
    """Stream the source shards into AttnRes shards in `output`, one shard in memory at a time.

    Every tensor the AttnRes model expects must come from the source with the expected shape, except the new
    depth-mixing parameters of a Transformers source, which are added to the last shard (an FLA source has its own);
    any source tensor without a counterpart is an error rather than silently dropped. `rename` maps the source's
    names. Returns (tensors written, shards written, depth parameters added, model dtype).
    """
    with torch.device("meta"):
        expected = {name: tensor.shape for name, tensor in AttnResForCausalLM(config).state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):  # as Transformers reads it: Inkling's config has no field
        expected.pop("lm_head.weight", None)

    adds_depth_parameters = isinstance(rename, TensorRenamer)
    shards = source.shards()
    written: dict[str, torch.dtype] = {}
    parts: list[tuple[Path, list[str], int]] = []
    for index, shard in enumerate(shards):
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(shard, framework="pt") as reader:
            names = list(reader.keys())
            for name in tqdm(names, desc=f"shard {index + 1}/{len(shards)}", unit="tensor", disable=not progress):
                for new_name, tensor in rename(name, reader.get_tensor(name)):
                    _check_tensor(name, new_name, tensor, expected, written)
                    if dtype is not None and tensor.is_floating_point():
                        tensor = tensor.to(dtype)
                    tensors[new_name] = tensor.contiguous()
                    written[new_name] = tensor.dtype
        if index == len(shards) - 1:
            rename.finish()
            model_dtype = written.get("model.embed_tokens.weight", dtype or torch.float32)
            for name, shape in expected.items():
                if adds_depth_parameters and name not in written and is_depth_parameter(name):
                    tensors[name] = initial_depth_parameter(name, shape, model_dtype)
                    written[name] = model_dtype
        if tensors:
            path = output / f"part-{index}.safetensors"
            save_file(tensors, path, metadata={"format": "pt"})
            parts.append((path, list(tensors), sum(t.numel() * t.element_size() for t in tensors.values())))
        del tensors

    missing = [name for name in expected if name not in written]
    if missing:
        raise ConversionError(f"{source.description} lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}.")
    _name_shards(parts, output)
    depth_parameters = 0
    if adds_depth_parameters:
        depth_parameters = sum(expected[name].numel() for name in expected if is_depth_parameter(name))
    return len(written), len(parts), depth_parameters, model_dtype


def _check_tensor(
    source_name: str,
    name: str,
    tensor: torch.Tensor,
    expected: dict[str, torch.Size],
    written: dict[str, torch.dtype],
) -> None:
    if name not in expected:
        raise ConversionError(
            f"Source tensor {source_name} has no counterpart in the AttnRes model; the checkpoint uses a feature the "
            "conversion does not map, so it is refused rather than converted partially."
        )
    if name in written:
        raise ConversionError(f"Source tensor {source_name} appears twice in the checkpoint.")
    if tuple(tensor.shape) != tuple(expected[name]):
        raise ConversionError(
            f"Source tensor {source_name} has shape {tuple(tensor.shape)}, the config implies {tuple(expected[name])}."
        )


def _name_shards(parts: list[tuple[Path, list[str], int]], output: Path) -> None:
    """Give the written parts Transformers' shard names, with an index when there is more than one."""
    if len(parts) == 1:
        parts[0][0].rename(output / "model.safetensors")
        return
    weight_map, total_size = {}, 0
    for number, (path, names, size) in enumerate(parts, start=1):
        shard_name = f"model-{number:05d}-of-{len(parts):05d}.safetensors"
        path.rename(output / shard_name)
        weight_map.update(dict.fromkeys(names, shard_name))
        total_size += size
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (output / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def _check_arguments(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    mode: str,
    block_size: int | None,
    overwrite: bool,
    gguf_file: str | None,
    revision: str | None,
    text: str | None,
    max_text_tokens: int,
) -> tuple[ModelSource, Path]:
    """Every check that needs no model: the options, SRC's existence and kind, and DST's safety. Returns where SRC
    is and DST as an absolute path."""
    if mode is not None and mode not in RESIDUAL_MODES:
        raise ConversionError(f"mode={mode!r}: must be one of {', '.join(map(repr, RESIDUAL_MODES))}")
    if block_size is not None and (isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1):
        raise ConversionError(f"block_size={block_size!r}: must be {block_size_rule()}")
    if text is not None and not text.strip():
        raise ConversionError(f"text={text!r}: must be a non-empty text (None uses the built-in passage)")
    try:
        check_positive_int("max_text_tokens", max_text_tokens, minimum=2, why="the perplexity needs two tokens")
        located = check_model_source("source", source, gguf_file=gguf_file, revision=revision)
        destination = check_destination("destination", destination, source=source, overwrite=overwrite)
    except ValueError as error:
        raise ConversionError(*error.args) from None
    return located, destination


def _as_dtype(name: str, dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    resolved = dtype if isinstance(dtype, torch.dtype) else getattr(torch, str(dtype).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype) or not resolved.is_floating_point:
        raise ConversionError(f"{name}={dtype!r}: must be a floating-point torch dtype, e.g. 'bfloat16' or 'float32'")
    return resolved


@contextlib.contextmanager
def work_folder(destination: Path) -> Iterator[Path]:
    """A temporary folder beside `destination`, on its filesystem so that `publish` can rename into place what is
    written there; removed afterwards, whatever happened."""
    work = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", suffix=".attnres-partial", dir=destination.parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def publish(output: Path, destination: Path, work: Path) -> None:
    """Move the finished checkpoint to DST by rename; an existing DST is moved aside first and deleted last."""
    previous = work / "previous"
    if destination.exists():
        destination.rename(previous)
    try:
        output.rename(destination)
    except BaseException:
        if previous.exists():
            previous.rename(destination)
        raise
