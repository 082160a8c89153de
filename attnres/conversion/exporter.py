"""`export`: an AttnRes checkpoint written in another project's format, verified when that project is importable.

The one format is FLA's (flash-linear-attention's `TransformerForCausalLM` with `attnres_block_size`), whose
mapping and limits are in `fla.py`. Like a conversion, an export never modifies its source and writes its
destination whole or not at all.
"""

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..configuration_attnres import AttnResConfig
from ..inputs import check_destination, check_model_source
from ..modeling_attnres import AttnResForCausalLM
from .architectures import ConversionError
from .converter import publish, work_folder
from .fla import (
    FLA_ARCHITECTURE,
    check_fla_exportable,
    fla_config,
    fla_names,
    fla_verification_problem,
    is_fla_query,
)
from .fla_reference import fla_on_torch
from .sources import copy_carried_files, resolve_source
from .verify import Tolerance, VerificationError, VerificationReport, verification_summary, verify_conversion


FORMATS = ("fla",)
# Token ids on which dropping an exact retrofit's output scales is measured.
_DEVIATION_PROBE = (2, 64)


@dataclass
class ExportReport:
    """What `export` wrote, and the verification's findings when it ran."""

    source: str
    destination: str
    target: str
    residual_mode: str
    block_size: int
    num_tensors: int
    dtype: str
    carried_files: list[str]
    # With `drop_exact_retrofit`: the largest change of a logit that dropping the steps' output scales makes.
    retrofit_deviation: float | None = None
    seconds: float = 0.0
    verification: VerificationReport | None = None
    unverified_reason: str | None = None

    def format(self) -> str:
        lines = [
            f"Exported {self.source}",
            f"      -> {self.destination} ({self.target})",
            f"  residual        {self.residual_mode}, block size {self.block_size} sublayers",
            f"  weights         {self.num_tensors} tensors, {self.dtype}",
            f"  carried over    {', '.join(self.carried_files) or '-'}",
        ]
        if self.retrofit_deviation is not None:
            lines.append(
                f"  exact retrofit  dropped: no step scales its output, max |dlogit| "
                f"{self.retrofit_deviation:.3e} on {_DEVIATION_PROBE[0]}x{_DEVIATION_PROBE[1]} random tokens"
            )
        lines.append(f"  time            {self.seconds:.1f} s")
        lines.append(verification_summary(self.verification, self.unverified_reason))
        return "\n".join(lines)

    __str__ = format


def export(
    model: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    to: str = "fla",
    drop_exact_retrofit: bool = False,
    verify: bool = True,
    overwrite: bool = False,
    revision: str | None = None,
    tolerance: Tolerance = Tolerance(),
) -> ExportReport:
    """Write the AttnRes checkpoint `model` (a folder or a Hub id) as an FLA checkpoint at `destination`, which FLA's
    `TransformerForCausalLM.from_pretrained` (or `AutoModelForCausalLM` after `import fla`) loads.

    Args:
        to: the format; `"fla"`.
        drop_exact_retrofit: export a converted model (`exact_retrofit`, a scale on each step's output) without
            the scales, which FLA has not, measuring how far the logits move; refused without it.
        verify: run FLA's model on the export and this package's on `model` (without the retrofit when dropped) on
            probe prompts and a text, and fail unless they agree within `tolerance`; where FLA is not importable the
            report says that only the weights were mapped.

    Raises:
        ConversionError: a bad option, or a model FLA cannot represent (named by its field); nothing is written.
        VerificationError: FLA's model does not compute this one's function; nothing is written.
    """
    started = time.perf_counter()
    if to not in FORMATS:
        raise ConversionError(f"to={to!r}: must be one of {', '.join(map(repr, FORMATS))}")
    try:
        located = check_model_source("model", model, gguf=False, revision=revision)
        destination = check_destination(
            "destination", destination, source=model, source_name="model", overwrite=overwrite
        )
    except ValueError as error:
        raise ConversionError(*error.args) from None
    config = AttnResConfig.from_pretrained(located.location, revision=revision)
    check_fla_exportable(config, drop_exact_retrofit)
    destination.parent.mkdir(parents=True, exist_ok=True)

    with work_folder(destination) as work:
        (work / "source").mkdir()
        resolved = resolve_source(located, staging=work / "source", description=str(model), revision=revision)
        source = AttnResForCausalLM.from_pretrained(resolved.folder).eval()
        reference_folder, deviation = resolved.folder, None
        if config.exact_retrofit:  # dropped (checked above): what FLA computes is the model without it
            reference_folder = work / "without-retrofit"
            source, deviation = _without_retrofit(source)
            source.save_pretrained(reference_folder)

        output = work / "exported"
        output.mkdir()
        names = fla_names(source.config)
        state = source.state_dict()
        tied = {"lm_head.weight"} if source.config.tie_word_embeddings else set()
        unmapped = sorted(set(state) - set(names.values()) - tied)
        if unmapped:  # a weight FLA's model has no place for: refuse rather than drop it
            raise ConversionError(f"{resolved.description}: FLA's model has no place for the weights {unmapped[:3]}")
        tensors = {
            fla: (state[ours].reshape(1, -1) if is_fla_query(fla) else state[ours]).contiguous()
            for fla, ours in names.items()
        }
        model_dtype = state["model.embed_tokens.weight"].dtype
        save_file(tensors, output / "model.safetensors", metadata={"format": "pt"})
        fields = {**fla_config(source.config), "dtype": str(model_dtype).removeprefix("torch.")}
        (output / "config.json").write_text(json.dumps(fields, indent=2) + "\n")
        carried = copy_carried_files(resolved, output)

        report = ExportReport(
            source=resolved.description,
            destination=str(destination),
            target=f"FLA {FLA_ARCHITECTURE}",
            residual_mode=config.residual_mode,
            block_size=config.depth_block_size,
            num_tensors=len(tensors),
            dtype=fields["dtype"],
            carried_files=carried,
            retrofit_deviation=deviation,
        )
        del source, state, tensors
        report.unverified_reason = fla_verification_problem() if verify else None
        if verify and report.unverified_reason is None:
            with fla_on_torch():
                report.verification = verify_conversion(
                    output, reference_folder, tolerance=tolerance, source_generates_with_cache=False
                )
            if not report.verification.passed:
                report.seconds = time.perf_counter() - started
                raise VerificationError(
                    report,
                    f"{destination} was not written: FLA's model does not compute the exported one's function "
                    f"({'; '.join(report.verification.failures)}).",
                )
        publish(output, destination, work)
        report.seconds = time.perf_counter() - started
        return report


def _without_retrofit(model: AttnResForCausalLM) -> tuple[AttnResForCausalLM, float]:
    """The model with `exact_retrofit` off (no step scales its output, as in FLA) and the same weights, and the
    largest change of a logit that makes on random tokens."""
    config = AttnResConfig.from_dict({**model.config.to_dict(), "exact_retrofit": False})
    unscaled = AttnResForCausalLM(config).to(model.dtype).eval()
    unscaled.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(config.vocab_size, _DEVIATION_PROBE, generator=generator)
    with torch.no_grad():
        deviation = (unscaled(ids).logits.float() - model(ids).logits.float()).abs().max().item()
    return unscaled, deviation
