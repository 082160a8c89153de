"""How the fused CPU kernels are built and cached (`attnres.kernels.build.compiled`): one folder per build key, built
once per machine and environment, safe between concurrent processes and checkouts.

The builds here compile `TINY`, an empty Python module that builds in seconds, in place of `cpu.cpp` (a minute), each
under a `TORCH_EXTENSIONS_DIR` of its own; `tests/test_cpu_kernels.py` builds the real kernels.
"""

import fcntl
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnres.kernels import build


ROOT = Path(__file__).resolve().parents[1]

TINY = """#include <Python.h>

#define TINY_CONCAT_(a, b) a##b
#define TINY_CONCAT(a, b) TINY_CONCAT_(a, b)
#define TINY_STRING_(a) #a
#define TINY_STRING(a) TINY_STRING_(a)

static PyModuleDef definition = {PyModuleDef_HEAD_INIT, TINY_STRING(TORCH_EXTENSION_NAME), nullptr, -1, nullptr};

PyMODINIT_FUNC TINY_CONCAT(PyInit_, TORCH_EXTENSION_NAME)() { return PyModule_Create(&definition); }
"""
CFLAGS, LDFLAGS = ["-O0"], []

# A fresh process that builds or loads argv[1] and prints the module's file.
LOAD = f"""
import sys
from pathlib import Path
from attnres.kernels import build
print(build.compiled(Path(sys.argv[1]), {CFLAGS!r}, {LDFLAGS!r}).__file__)
"""

# `LOAD`, started by the test only once both processes are ready: touches argv[2], waits for argv[3] to exist.
LOAD_AT_ONCE = f"""
import sys
import time
from pathlib import Path
from attnres.kernels import build
Path(sys.argv[2]).touch()
while not Path(sys.argv[3]).exists():
    time.sleep(0.01)
print(build.compiled(Path(sys.argv[1]), {CFLAGS!r}, {LDFLAGS!r}).__file__)
"""


@pytest.fixture
def extensions_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(folder))
    return folder


def source_tree(folder: Path, comment: str = "an empty module") -> Path:
    """A checkout's kernel source: `TINY` under a first-line comment."""
    folder.mkdir(parents=True)
    source = folder / "tiny.cpp"
    source.write_text(f"// {comment}\n{TINY}")
    return source


def build_folder(source: Path) -> Path:
    """The folder `compiled` built `source` into (or imported it from)."""
    return Path(build.compiled(source, CFLAGS, LDFLAGS).__file__).parent


def snapshot(folder: Path) -> tuple:
    """What a rebuild or an overwrite would change: the library's inode and mtime, the object's mtime, ninja's log."""
    library = (folder / f"{folder.name}.so").stat()
    objects = (folder / "tiny.o").stat()
    return library.st_ino, library.st_mtime_ns, objects.st_mtime_ns, (folder / ".ninja_log").read_text()


def compiles(folder: Path) -> int:
    """How many times ninja compiled the object in `folder`."""
    lines = (folder / ".ninja_log").read_text().splitlines()
    return sum(line.split("\t")[3] == "tiny.o" for line in lines if not line.startswith("#"))


def building_messages(records: list[logging.LogRecord]) -> list[str]:
    return [record.getMessage() for record in records if "building" in record.getMessage()]


def test_key_covers_the_source_the_flags_and_the_environment(monkeypatch: pytest.MonkeyPatch):
    files = {"cpu.cpp": b"int x;"}
    environment = build.build_environment()
    key = build.build_key(files, ["-O3"], ["-fopenmp"], environment)
    assert re.fullmatch("[0-9a-f]{16}", key)
    assert build.build_key(dict(files), ["-O3"], ["-fopenmp"], dict(environment)) == key
    changed = [
        ({"cpu.cpp": b"int y;"}, ["-O3"], ["-fopenmp"], environment),
        ({**files, "common.h": b""}, ["-O3"], ["-fopenmp"], environment),
        (files, ["-O2"], ["-fopenmp"], environment),
        (files, ["-O3", "-mavx2"], ["-fopenmp"], environment),
        (files, ["-O3"], [], environment),
        *(
            (files, ["-O3"], ["-fopenmp"], {**environment, field: environment[field] + "x"})
            for field in ("torch", "torch_path", "cpu_capability", "compiler", "python", "executable", "prefix")
        ),
    ]
    keys = {build.build_key(*inputs) for inputs in changed}
    assert len(keys) == len(changed) and key not in keys

    monkeypatch.setattr(sys, "prefix", "/another/venv")
    monkeypatch.setenv("CXX", "clang++")
    assert build.build_environment() == {**environment, "prefix": "/another/venv", "compiler": "clang++"}


def test_source_files_follow_the_headers_included_with_quotes(tmp_path: Path):
    (tmp_path / "include").mkdir()
    (tmp_path / "kernel.cpp").write_text('#include <vector>\n#include "include/common.h"\n')
    (tmp_path / "include" / "common.h").write_text('#pragma once\n  #  include "more.h"\n')
    (tmp_path / "include" / "more.h").write_text("// more\n")
    files = build.source_files(tmp_path / "kernel.cpp")
    assert sorted(files) == ["include/common.h", "include/more.h", "kernel.cpp"]
    key = build.build_key(files, [], [], {})
    (tmp_path / "include" / "more.h").write_text("// changed\n")
    assert build.build_key(build.source_files(tmp_path / "kernel.cpp"), [], [], {}) != key

    (tmp_path / "outside.cpp").write_text('#include "../elsewhere.h"\n')
    with pytest.raises(OSError, match="outside the source's folder"):
        build.source_files(tmp_path / "outside.cpp")


def test_a_second_checkout_neither_rebuilds_nor_disturbs_the_first(
    tmp_path: Path, extensions_dir: Path, caplog: pytest.LogCaptureFixture
):
    first = source_tree(tmp_path / "first")
    second = source_tree(tmp_path / "second", comment="the same module, another comment")
    same = source_tree(tmp_path / "same")
    with caplog.at_level(logging.WARNING, logger=build.logger.name):
        first_folder = build_folder(first)
        before = snapshot(first_folder)
        second_folder = build_folder(second)
        assert build_folder(same) == first_folder
    assert first_folder.parent == second_folder.parent == extensions_dir
    assert first_folder != second_folder and re.fullmatch("attnres_tiny_[0-9a-f]{16}", first_folder.name)
    assert building_messages(caplog.records) == [
        f"attnres: building the fused CPU kernels into {folder} (once per machine and environment, about a minute)"
        for folder in (first_folder, second_folder)
    ]
    assert snapshot(first_folder) == before
    assert compiles(first_folder) == compiles(second_folder) == 1

    # Another process: imports the build as it is, silently.
    command = [sys.executable, "-c", LOAD, str(first)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(first_folder / f"{first_folder.name}.so")
    assert "attnres" not in result.stderr
    assert snapshot(first_folder) == before


def test_processes_that_start_at_once_build_once_and_both_load(tmp_path: Path, extensions_dir: Path):
    source = source_tree(tmp_path / "checkout")
    ready = [tmp_path / f"ready{index}" for index in range(2)]
    go = tmp_path / "go"
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", LOAD_AT_ONCE, str(source), str(path), str(go)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for path in ready
    ]
    deadline = time.monotonic() + 120
    while not all(path.exists() for path in ready):
        assert all(process.poll() is None for process in processes) and time.monotonic() < deadline
        time.sleep(0.05)
    go.touch()
    results = [process.communicate(timeout=300) for process in processes]
    assert [process.returncode for process in processes] == [0, 0], [stderr for _, stderr in results]
    libraries = {stdout.strip() for stdout, _ in results}
    assert len(libraries) == 1
    folder = Path(libraries.pop()).parent
    assert sum(stderr.count("attnres: building") for _, stderr in results) == 1
    assert compiles(folder) == 1


def test_a_killed_build_leaves_nothing_that_blocks_the_next(tmp_path: Path, extensions_dir: Path):
    source = source_tree(tmp_path / "checkout")
    folder = build_folder(source)
    # What a build killed before it finished leaves: torch's lock file (which torch's builder would wait on forever),
    # and no mark that the build is complete. The OS released the killed process's own lock.
    (folder / "complete").unlink()
    (folder / "lock").touch()
    assert build_folder(source) == folder
    assert (folder / "complete").exists() and not (folder / "lock").exists()


def test_a_build_held_too_long_by_another_process_times_out(
    tmp_path: Path, extensions_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
):
    source = source_tree(tmp_path / "checkout")
    folder = build_folder(source)
    (folder / "complete").unlink()
    monkeypatch.setattr(build, "BUILD_WAIT_SECONDS", 0.5)
    caplog.clear()
    with open(folder / "build.lock") as held, caplog.at_level(logging.WARNING, logger=build.logger.name):
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match="another process has been building"):
            build.compiled(source, CFLAGS, LDFLAGS)
    assert [record.getMessage() for record in caplog.records] == [
        f"attnres: waiting for another process to build the CPU kernels in {folder}"
    ]
    assert os.path.exists(folder / "build.lock")
