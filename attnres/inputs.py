"""Checks of the paths and numbers users pass to conversion, evaluation and inspection.

They run before any model is loaded, so that a typo fails in one line instead of after minutes of work. What does not
exist raises `FileNotFoundError`, any other bad value `ValueError`; messages read `name=value: what is allowed`, which
the command line prints as they are (exit status 2).
"""

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal


GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelSource:
    """A model's location: a local Transformers folder, a local GGUF file, or a Hub repository id."""

    kind: Literal["folder", "gguf", "hub"]
    location: str  # the folder (holding the GGUF file for "gguf") or the repository id
    gguf_file: str | None = None  # the GGUF file's name inside `location`

    @property
    def path(self) -> Path:
        return Path(self.location)


def check_model_source(
    name: str,
    value: str | os.PathLike,
    *,
    gguf: bool = True,
    gguf_file: str | None = None,
    revision: str | None = None,
) -> ModelSource:
    """Where the model `name=value` is: an existing folder with a config.json, a real GGUF file (when `gguf`), or a
    Hub repository id (`owner/name`) that can be reached or is cached.

    Args:
        name: the argument's name, for the messages.
        value: a folder, a `.gguf` file, or a Hub repository id.
        gguf: whether GGUF files are accepted.
        gguf_file: the GGUF file inside a folder or Hub repository `value`.
        revision: the Hub revision, to look for a cached copy when the Hub is offline.
    """
    shown = f"{name}={str(value)!r}"
    path = Path(value).expanduser()
    if path.is_dir():
        if gguf_file is not None:
            if not (path / gguf_file).is_file():
                raise FileNotFoundError(f"gguf_file={gguf_file!r}: no such file in {shown}")
            check_gguf_file("gguf_file", path / gguf_file, shown=gguf_file)
            return ModelSource("gguf", str(path), gguf_file)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{shown}: a folder without config.json, not a Transformers checkpoint")
        return ModelSource("folder", str(path))
    if path.is_file() and gguf and path.suffix == ".gguf":
        check_gguf_file(name, path, shown=str(value))
        return ModelSource("gguf", str(path.parent), path.name)
    if path.exists():
        raise ValueError(f"{shown}: not a model folder{' or a .gguf file' if gguf else ''}")
    if not is_hub_id(str(value)) or path.suffix == ".gguf":
        raise FileNotFoundError(f"{shown}: no such {'file or folder' if gguf else 'folder'}")
    _check_hub_reachable(shown, str(value), gguf_file or "config.json", revision)
    return ModelSource("hub", str(value), gguf_file)


def check_gguf_file(name: str, path: Path, *, shown: str | None = None) -> None:
    """Fail unless `path` is a file that starts with the GGUF magic bytes; `shown` is the value as the user gave it."""
    shown = f"{name}={shown if shown is not None else str(path)!r}"
    if not path.is_file():
        raise FileNotFoundError(f"{shown}: no such file")
    with path.open("rb") as file:
        if file.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ValueError(f"{shown}: not a GGUF file (it does not start with {GGUF_MAGIC!r})")


def is_hub_id(text: str) -> bool:
    """Whether `text` has the form of a Hub repository id with its namespace (`owner/name`)."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if text.count("/") != 1:
        return False
    try:
        validate_repo_id(text)
    except HFValidationError:
        return False
    return True


def _check_hub_reachable(shown: str, repo_id: str, filename: str, revision: str | None) -> None:
    """With the Hub offline, only a repository whose `filename` is in the local cache can be loaded."""
    from huggingface_hub import is_offline_mode, try_to_load_from_cache

    if is_offline_mode() and not isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str):
        raise ValueError(f"{shown}: not a local path, and the Hugging Face Hub is offline (HF_HUB_OFFLINE=1)")


def check_positive_int(name: str, value: object, *, minimum: int = 1, why: str = "") -> None:
    """Fail unless `value` is an integer (not a bool) of at least `minimum`; `why` explains the bound."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name}={value!r}: must be {allowed}{f' ({why})' if why else ''}")
