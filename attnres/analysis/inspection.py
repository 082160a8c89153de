"""`inspect_models`: load one or more causal LMs, profile them on a text, write the pictures and the numbers."""

import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from ..inputs import ModelSource, check_model_source, check_positive_int
from .plots import write_pictures
from .profiles import DepthProfile, depth_profile


def encode(model_path: str | Path, text: str, vocab_size: int, max_tokens: int) -> torch.Tensor:
    """`text` as `[1, seq]` ids: with the checkpoint's tokenizer when it has one, else as UTF-8 bytes (the byte-level
    models of `benchmarks/ablation.py`), which needs a vocabulary of at least 256."""
    from transformers import AutoTokenizer

    try:
        ids = AutoTokenizer.from_pretrained(model_path)(text)["input_ids"]
    except (OSError, ValueError):
        if vocab_size < 256:
            raise ValueError(
                f"model={str(model_path)!r}: has no tokenizer, and its vocabulary ({vocab_size}) is too small for "
                "UTF-8 bytes"
            ) from None
        ids = list(text.encode("utf-8"))
    if len(ids) < 2:
        raise ValueError(
            f"text={text!r}: must give at least 2 tokens with {str(model_path)!r}'s tokenizer (the loss predicts "
            "each token from the previous one)"
        )
    return torch.tensor([ids[:max_tokens]])


def inspect_models(
    models: list[str | Path],
    text: str,
    output_dir: str | Path,
    labels: list[str] | None = None,
    max_tokens: int = 512,
    device: str = "cpu",
) -> tuple[list[DepthProfile], list[Path]]:
    """Profile each model (folder or Hub id, loaded in fp32) on `text`; write `depth_attention.png` (models with
    depth attention), `magnitudes.png`, `gradient_norms.png` and `profiles.json` to `output_dir`.

    Every model, its config and the text's tokens are checked before the first model loads, so a bad argument fails
    at once rather than after the work on the models before it.

    Returns the profiles and the paths written.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    import attnres  # noqa: F401  registers AttnRes with the Auto classes

    sources = _check_arguments(models, text, labels, max_tokens)
    labels = labels or [Path(str(m)).name or str(m) for m in models]
    input_ids = [
        encode(source.location, text, AutoConfig.from_pretrained(source.location).vocab_size, max_tokens)
        for source in sources
    ]
    profiles = []
    for source, label, ids in zip(sources, labels, input_ids):
        model = AutoModelForCausalLM.from_pretrained(source.location, dtype=torch.float32).to(device)
        profiles.append(depth_profile(model, ids.to(device), label=label))
        del model
    output_dir = Path(output_dir)
    paths = write_pictures(profiles, output_dir)
    numbers = output_dir / "profiles.json"
    numbers.write_text(json.dumps([asdict(p) for p in profiles], indent=1) + "\n")
    return profiles, [*paths, numbers]


def _check_arguments(
    models: list[str | Path], text: str, labels: list[str] | None, max_tokens: int
) -> list[ModelSource]:
    """The checks that need no model; returns where each model is."""
    if isinstance(models, (str, os.PathLike)) or not models:
        raise ValueError(f"models={models!r}: must be a non-empty list of model folders or Hub ids")
    if not isinstance(text, str) or not text:
        raise ValueError(f"text={text!r}: must be a non-empty string")
    check_positive_int("max_tokens", max_tokens, minimum=2, why="the loss predicts each token from the previous one")
    if labels is not None and len(labels) != len(models):
        raise ValueError(f"labels={labels!r}: must give one label per model ({len(models)} models)")
    return [check_model_source(f"models[{i}]", model, gguf=False) for i, model in enumerate(models)]
