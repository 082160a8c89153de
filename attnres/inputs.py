"""Checks of the paths and numbers users pass to conversion, evaluation and inspection.

They run before any model is loaded, so that a typo fails in one line instead of after minutes of work. What does not
exist raises `FileNotFoundError`, any other bad value `ValueError`; messages read `name=value: what is allowed`, which
the command line prints with its own spelling of the names (exit status 2).

The command line runs these checks before it imports torch, loading this file on its own rather than through
`attnres/__init__.py` (which imports torch and Transformers to register the Auto classes): so this module imports
nothing from the package, and nothing heavy at module level.
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
        revision: the Hub revision, for a Hub repository `value`.
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
    _check_hub_reachable(shown, str(value), gguf_file, revision)
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


def _check_hub_reachable(shown: str, repo_id: str, gguf_file: str | None, revision: str | None) -> None:
    """Fail unless the Hub repository `repo_id` can be loaded: its config.json (or `gguf_file`) is in the local
    cache, or the Hub answers for it. One request without retries, so that a machine without a network hears so at
    once instead of after the retries of a download."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, is_offline_mode, try_to_load_from_cache
    from huggingface_hub.errors import (
        GatedRepoError,
        HTTPError,  # the HTTP client's base error, which huggingface_hub's own errors extend
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    filename = gguf_file or "config.json"
    cached = isinstance(try_to_load_from_cache(repo_id, filename, revision=revision), str)
    if is_offline_mode():
        if not cached:
            raise ValueError(
                f"{shown}: neither a local folder nor in the local Hub cache, and the Hugging Face Hub is off "
                "(HF_HUB_OFFLINE=1); pass a local folder, or unset HF_HUB_OFFLINE to download it"
            )
        return
    try:
        get_hf_file_metadata(hf_hub_url(repo_id, filename, revision=revision), retry_on_errors=False)
    except GatedRepoError:
        raise ValueError(
            f"{shown}: a gated repository on the Hugging Face Hub; accept its terms there and log in (hf auth login)"
        ) from None
    except RepositoryNotFoundError:
        raise ValueError(
            f"{shown}: neither a local folder nor a repository on the Hugging Face Hub (a private one needs a login: "
            "hf auth login)"
        ) from None
    except RevisionNotFoundError:
        raise ValueError(f"revision={revision!r}: no such revision of {shown} on the Hugging Face Hub") from None
    except RemoteEntryNotFoundError:
        if gguf_file is not None:
            raise FileNotFoundError(
                f"gguf_file={gguf_file!r}: no such file in {shown} on the Hugging Face Hub"
            ) from None
        raise FileNotFoundError(f"{shown}: a Hugging Face Hub repository without config.json") from None
    except (HTTPError, OSError) as error:  # no answer, or an error of the Hub's own
        if not cached:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise ValueError(
                f"{shown}: neither a local folder nor reachable on the Hugging Face Hub ({constants.ENDPOINT}: "
                f"{reason}); pass a local folder, or set HF_HUB_OFFLINE=1 to load Hub ids from the local cache "
                "without a network"
            ) from None


def check_destination(
    name: str, value: str | os.PathLike, *, source: str | os.PathLike, source_name: str = "source", overwrite: bool
) -> Path:
    """The output folder `name=value` as an absolute path, refused when it exists (unless `overwrite`) or when
    writing it would write into or replace the input `source_name=source`, which is only ever read."""
    destination = Path(value).expanduser().resolve()
    shown = f"{name}={str(destination)!r}"
    source_path = Path(source).expanduser()
    if source_path.exists():
        source_path = source_path.resolve()
        if destination == source_path or destination in source_path.parents or source_path in destination.parents:
            raise ValueError(
                f"{shown}: overlaps {source_name}={str(source_path)!r}, which is only ever read, never written"
            )
    if destination.exists() or destination.is_symlink():
        if not overwrite:
            raise ValueError(f"{shown}: already exists; pass overwrite=True to replace it")
        if not destination.is_dir() or destination.is_symlink():
            raise ValueError(f"{shown}: exists and is not a folder; refusing to replace it")
    return destination


def check_positive_int(name: str, value: object, *, minimum: int = 1, why: str = "") -> None:
    """Fail unless `value` is an integer (not a bool) of at least `minimum`; `why` explains the bound."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ValueError(f"{name}={value!r}: must be {allowed}{f' ({why})' if why else ''}")
