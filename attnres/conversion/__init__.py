"""Retrofit Llama / Mistral / Mixtral / Qwen2 checkpoints into AttnRes, with a proof of equivalence.

    from attnres.conversion import convert
    report = convert("path/or/hub-id", "smollm2-attnres", mode="block")
    print(report)

See `convert` for the options and `verify_conversion` for what the proof checks.
"""

from .architectures import REFUSED_MODEL_TYPES, SUPPORTED_ARCHITECTURES, ConversionError
from .converter import ConversionReport, convert
from .verify import GenerationComparison, Tolerance, VerificationError, VerificationReport, verify_conversion


__all__ = [
    "ConversionError",
    "ConversionReport",
    "GenerationComparison",
    "REFUSED_MODEL_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "Tolerance",
    "VerificationError",
    "VerificationReport",
    "convert",
    "verify_conversion",
]
