"""How the fused CPU kernels are compiled and cached: one folder per build key, so that checkouts and virtual
environments never load or overwrite one another's builds and the same source in the same environment is compiled
once per machine.

Each build has a folder of its own, `attnres_<stem>_<key>` under `TORCH_EXTENSIONS_DIR` (by default
`~/.cache/torch_extensions`), whose key hashes what makes builds differ (`build_key`): the source's bytes and those of
the headers it includes, the compiler flags, the torch version, the CPU's vector instruction set, the compiler, the
Python interpreter and environment. A folder marked complete is imported directly, without the builder; a build runs
under an OS lock on the folder, which the OS releases when its process dies, so concurrent processes build once and a
killed build blocks nothing.
"""

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch
from torch.utils import cpp_extension


logger = logging.getLogger(__name__)


# How long a process waits for another one's build of the same key before it gives up and keeps the PyTorch ops:
# a build takes a minute or two on a loaded machine, so a lock held far longer belongs to a process that hangs.
BUILD_WAIT_SECONDS = 600.0

# `#include "header"` (not `<header>`): a header of the kernel's own, whose bytes belong to the build's key.
_LOCAL_INCLUDE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"', re.MULTILINE)


def source_files(source: Path) -> dict[str, bytes]:
    """`source` and the headers it includes with quotes (recursively), by their paths relative to `source`'s folder:
    what the build compiles, so what its key hashes."""
    root = source.parent.resolve()
    files: dict[str, bytes] = {}
    pending = [source.resolve()]
    while pending:
        path = pending.pop()
        if not path.is_relative_to(root):
            raise OSError(f"{path}, included by the kernel source {source}, is outside the source's folder {root}")
        relative = path.relative_to(root).as_posix()
        if relative in files:
            continue
        files[relative] = path.read_bytes()
        includes = _LOCAL_INCLUDE.findall(files[relative])
        pending.extend((path.parent / include.decode()).resolve() for include in includes)
    return files


def build_environment() -> dict[str, str]:
    """What, besides the source and the flags, makes one build unfit for another process: the torch it is compiled
    against, the vector instructions PyTorch dispatches to on this CPU (a cache folder may be shared between
    machines), the compiler, and the Python interpreter and environment that load it."""
    return {
        "torch": torch.__version__,
        "torch_path": str(Path(torch.__file__).parent),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "compiler": os.environ.get("CXX", "c++"),
        "python": sys.version,
        "executable": sys.executable,
        "prefix": sys.prefix,
    }


def build_key(
    files: Mapping[str, bytes], cflags: Sequence[str], ldflags: Sequence[str], environment: Mapping[str, str]
) -> str:
    """16 hex digits of a SHA-256 over everything that makes one build differ from another: builds with the same key
    are interchangeable, and builds with different keys never share a folder."""
    inputs = {
        "files": {name: hashlib.sha256(data).hexdigest() for name, data in files.items()},
        "cflags": list(cflags),
        "ldflags": list(ldflags),
        "environment": dict(environment),
    }
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def compiled(source: Path, cflags: Sequence[str], ldflags: Sequence[str]) -> ModuleType:
    """`source` compiled as a Python extension module with `cflags` and `ldflags`, into (or, once built, imported
    from) the folder of its key under `TORCH_EXTENSIONS_DIR`.

    The build compiles a copy of the hashed bytes kept in that folder, not `source` itself, so that the folder's build
    commands are the same from every checkout and the files compiled are the files hashed."""
    files = source_files(source)
    key = build_key(files, cflags, ldflags, build_environment())
    name = "attnres_" + re.sub(r"\W", "_", source.stem) + "_" + key
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    directory = Path(root) / name
    library = directory / f"{name}.so"
    complete = directory / "complete"
    if complete.exists() and library.exists():
        return _imported(name, library)
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory):
        if complete.exists() and library.exists():
            return _imported(name, library)
        complete.unlink(missing_ok=True)
        # torch's own lock file, left behind by a build that was killed (under this lock, no build is running): its
        # builder would wait for it to disappear forever.
        (directory / "lock").unlink(missing_ok=True)
        for relative, data in files.items():
            path = directory / relative
            if not path.exists() or path.read_bytes() != data:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(data)
        inputs = {"built_from": str(source.resolve()), "cflags": list(cflags), "ldflags": list(ldflags)}
        (directory / "inputs.json").write_text(json.dumps({**inputs, **build_environment()}, indent=1) + "\n")
        logger.warning(
            "attnres: building the fused CPU kernels into %s (once per machine and environment, about a minute)",
            directory,
        )
        module = cpp_extension.load(
            name=name,
            sources=[str(directory / source.name)],
            extra_cflags=list(cflags),
            extra_ldflags=list(ldflags),
            build_directory=str(directory),
        )
        complete.touch()
        return module


@contextmanager
def _locked(directory: Path) -> Iterator[None]:
    """`directory` to this process alone, for `BUILD_WAIT_SECONDS` at most: an OS lock on a file in it, which the OS
    releases when the process holding it ends, however it ends. Waiting prints one line."""
    with open(directory / "build.lock", "a") as handle:
        deadline = time.monotonic() + BUILD_WAIT_SECONDS
        waiting = False
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"another process has been building {directory} for over {BUILD_WAIT_SECONDS:.0f} s"
                    ) from None
                if not waiting:
                    logger.warning("attnres: waiting for another process to build the CPU kernels in %s", directory)
                    waiting = True
                time.sleep(0.2)
        yield


def _imported(name: str, library: Path) -> ModuleType:
    """The built extension module `name`, imported from its file."""
    spec = importlib.util.spec_from_file_location(name, library)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
