"""`inspect_models`: load one or more causal LMs, profile them on a text, write the pictures and the numbers."""

import json
from dataclasses import asdict
from pathlib import Path

import torch

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
                f"{model_path} has no tokenizer and its vocabulary ({vocab_size}) is too small for UTF-8 bytes"
            ) from None
        ids = list(text.encode("utf-8"))
    if len(ids) < 2:
        raise ValueError("the text must give at least 2 tokens (the loss predicts each token from the previous)")
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

    Returns the profiles and the paths written.
    """
    from transformers import AutoModelForCausalLM

    import attnres  # noqa: F401  registers AttnRes with the Auto classes

    labels = labels or [Path(str(m)).name or str(m) for m in models]
    if len(labels) != len(models):
        raise ValueError(f"{len(labels)} labels for {len(models)} models")
    profiles = []
    for model_path, label in zip(models, labels):
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device)
        input_ids = encode(model_path, text, model.config.vocab_size, max_tokens).to(device)
        profiles.append(depth_profile(model, input_ids, label=label))
        del model
    output_dir = Path(output_dir)
    paths = write_pictures(profiles, output_dir)
    numbers = output_dir / "profiles.json"
    numbers.write_text(json.dumps([asdict(p) for p in profiles], indent=1) + "\n")
    return profiles, [*paths, numbers]
