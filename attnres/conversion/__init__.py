"""Retrofit Llama / Mistral / Mixtral / Qwen2 checkpoints into AttnRes, read FLA's AttnRes checkpoints and write
them, each with a proof of equivalence.

    from attnres.conversion import convert, export
    report = convert("path/or/hub-id", "smollm2-attnres", mode="block")
    print(report)
    print(export("fla-trained-and-converted", "back-to-fla", to="fla"))

See `convert` and `export` for the options and `verify_conversion` for what the proof checks.
"""

from .architectures import REFUSED_MODEL_TYPES, SUPPORTED_ARCHITECTURES, ConversionError
from .converter import ConversionReport, convert
from .exporter import ExportReport, export
from .verify import GenerationComparison, Tolerance, VerificationError, VerificationReport, verify_conversion


__all__ = [
    "ConversionError",
    "ConversionReport",
    "ExportReport",
    "GenerationComparison",
    "REFUSED_MODEL_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "Tolerance",
    "VerificationError",
    "VerificationReport",
    "convert",
    "export",
    "verify_conversion",
]
