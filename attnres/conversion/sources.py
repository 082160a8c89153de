"""Where a conversion reads from: a local Transformers folder, a Hub repository, or a GGUF file.

Every source ends up as a local folder holding a config and safetensors shards, which the converter streams. GGUF
files are quantised and not laid out like Transformers checkpoints, so Transformers dequantises them into a model
that is saved as safetensors into a staging folder first. Pickle checkpoints (`.bin`, `.pt`) are never loaded:
unpickling runs arbitrary code.
"""

import importlib.util
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..families import FAMILIES
from ..inputs import ModelSource
from .architectures import ConversionError


SAFETENSORS_INDEX = "model.safetensors.index.json"
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
# Files a model folder holds that the converter writes itself (weights and config) or must not carry over (code
# for another architecture). Everything else at the top level (tokenizer, chat template, generation config, model
# card, license) is copied unchanged.
_NOT_CARRIED = re.compile(r"(\.safetensors|\.index\.json|\.gguf|\.py|\.msgpack|\.h5|\.onnx)$|^config\.json$")
_HUB_PATTERNS = [
    "*.safetensors",
    "*.json",
    "*.txt",
    "*.model",
    "*.jinja",
    "*.tiktoken",
    "README.md",
    "LICENSE*",
]


@dataclass
class LocalSource:
    """A local Transformers folder to convert; `description` is what the report calls it (the user's SRC)."""

    folder: Path
    description: str

    def shards(self) -> list[Path]:
        """The safetensors shards, in index order. Refuses folders whose only weights are pickles."""
        index = self.folder / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            return [self.folder / name for name in dict.fromkeys(weight_map.values())]
        if (self.folder / "model.safetensors").is_file():  # beside it may lie other formats (consolidated.*)
            return [self.folder / "model.safetensors"]
        shards = sorted(self.folder.glob("*.safetensors"))
        if shards:
            return shards
        pickles = sorted(p.name for p in self.folder.iterdir() if p.suffix in _PICKLE_SUFFIXES)
        if pickles:
            raise ConversionError(
                f"{self.description} holds only pickle weights ({', '.join(pickles[:3])}); they are not loaded "
                "because unpickling can run arbitrary code. Save the model with safetensors first "
                "(`model.save_pretrained(folder)` does by default)."
            )
        raise ConversionError(f"{self.description} holds no safetensors weights.")

    def carried_files(self) -> list[Path]:
        """Top-level files copied unchanged into the converted folder (tokenizer, templates, generation config...)."""
        return sorted(
            path
            for path in self.folder.iterdir()
            if path.is_file() and not _NOT_CARRIED.search(path.name) and path.suffix not in _PICKLE_SUFFIXES
        )


def source_config(source: ModelSource, revision: str | None = None) -> PreTrainedConfig | None:
    """The source's config, read without its weights, so that an unconvertible source fails before they load.

    A GGUF file's metadata holds the config but names no model class; it is the causal LM of its model type, the class
    `materialize_gguf` loads. Returns None for a GGUF file in a Hub repository, whose metadata comes only with the
    whole download.
    """
    from huggingface_hub import hf_hub_download

    if source.kind == "folder":
        return AutoConfig.from_pretrained(source.location)
    if source.kind == "gguf":
        _require_gguf_package()
        config = AutoConfig.from_pretrained(source.location, gguf_file=source.gguf_file)
        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        return config
    if source.gguf_file is not None:
        return None
    return AutoConfig.from_pretrained(Path(hf_hub_download(source.location, "config.json", revision=revision)).parent)


def raw_source_config(source: ModelSource, revision: str | None = None) -> dict | None:
    """The source's `config.json` as written, for the configs Transformers cannot read without their own package
    (FLA's); None for a GGUF file, whose config is in its metadata."""
    from huggingface_hub import hf_hub_download

    if source.kind == "gguf" or source.gguf_file is not None:
        return None
    if source.kind == "folder":
        path = Path(source.location) / "config.json"
    else:
        path = Path(hf_hub_download(source.location, "config.json", revision=revision))
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ConversionError(f"{path}: not a readable config.json ({error})") from None


def causal_lm_class(folder: Path) -> type:
    """The class that loads the Transformers model in `folder`: its family's `*ForCausalLM` where the family table has
    its model type, which `AutoModelForCausalLM` does not always map (it maps Emu3's composite config, not the text
    config that `Emu3ForCausalLM` saves), else `AutoModelForCausalLM` (an FLA checkpoint being exported back)."""
    from transformers import AutoModelForCausalLM

    family = FAMILIES.get(json.loads((Path(folder) / "config.json").read_text()).get("model_type"))
    return family.causal_lm_class if family is not None else AutoModelForCausalLM


def resolve_source(source: ModelSource, *, staging: Path, description: str, revision: str | None = None) -> LocalSource:
    """Turn SRC into a local folder, downloading from the Hub or dequantising a GGUF file into `staging` if needed.

    Args:
        source: where SRC is, as `attnres.inputs.check_model_source` found it.
        staging: an empty scratch folder the caller deletes; GGUF sources are materialised there.
        description: what the report calls SRC (the user's spelling of it).
        revision: Hub revision (branch, tag or commit) for Hub ids.
    """
    if source.kind == "folder":
        return LocalSource(source.path, description)
    if source.kind == "gguf":
        return materialize_gguf(source.path, source.gguf_file, staging, description)
    return _download(source.location, staging, source.gguf_file, revision)


def _download(repo_id: str, staging: Path, gguf_file: str | None, revision: str | None) -> LocalSource:
    """Fetch the safetensors checkpoint (or one GGUF file) of a Hub repository; pickle weights are not downloaded."""
    from huggingface_hub import hf_hub_download, list_repo_files, snapshot_download

    if gguf_file is not None:
        path = Path(hf_hub_download(repo_id, gguf_file, revision=revision))
        return materialize_gguf(path.parent, path.name, staging, repo_id)
    files = list_repo_files(repo_id, revision=revision)
    if not any(name.endswith(".safetensors") for name in files):
        ggufs = [name for name in files if name.endswith(".gguf")]
        hint = f"; it has GGUF files, pass gguf_file= one of {ggufs[:3]}" if ggufs else ""
        raise ConversionError(f"Hub repository {repo_id} has no safetensors weights{hint}.")
    # Some repositories also ship the weights in their original layout (e.g. consolidated.safetensors); only the
    # Transformers files are needed.
    transformers_layout = any(re.fullmatch(r"model(-\d+-of-\d+)?\.safetensors", name) for name in files)
    patterns = [p for p in _HUB_PATTERNS if p != "*.safetensors" or not transformers_layout]
    if transformers_layout:
        patterns.append("model*.safetensors")
    folder = snapshot_download(repo_id, revision=revision, allow_patterns=patterns)
    return LocalSource(Path(folder), repo_id)


def materialize_gguf(folder: Path, gguf_file: str, staging: Path, description: str) -> LocalSource:
    """Dequantise a GGUF checkpoint with Transformers and save it, with its tokenizer, as safetensors in `staging`.

    The dequantised weights are what any Transformers user of the GGUF file computes with, so converting them is
    converting the GGUF model. They come out in float32.
    """
    _require_gguf_package()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file, dtype=torch.float32)
    # `save_pretrained` refuses models loaded through the GGUF quantizer even once dequantised, so the plain
    # tensors and the config are written directly; a tied lm_head is the embedding itself and is not stored.
    state_dict = model.state_dict()
    if model.config.tie_word_embeddings:
        state_dict.pop("lm_head.weight", None)
    save_file({name: tensor.contiguous() for name, tensor in state_dict.items()}, staging / "model.safetensors")
    model.config.__dict__.pop("quantization_config", None)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(staging)
    model.generation_config.save_pretrained(staging)
    del model, state_dict
    AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file).save_pretrained(staging)
    return LocalSource(staging, description)


def _require_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:  # Transformers reads GGUF files with it
        raise ConversionError("Reading GGUF files needs the `gguf` package: pip install 'attnres[convert]'.")


def copy_carried_files(source: LocalSource, destination: Path) -> list[str]:
    """Copy the tokenizer files, chat template, generation config and model card; returns their names."""
    names = []
    for path in source.carried_files():
        shutil.copyfile(path, destination / path.name)
        names.append(path.name)
    return names
