"""Every bad input to the `attnres` command line: exit status 2, one line on stderr that names the argument as the
command line spells it (`--overwrite`, `SRC`, not the API's `overwrite=True`, `source`) and its value, no traceback,
nothing written, and, where no model's config is needed (ranges, text files, output folders, model paths, the Hub's
reach), torch never imported, so it answers at once. The Python API's half of the table is tests/test_bad_input.py."""

import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from conftest import TINY_SHAPE, error_lines
from test_cli import COMMANDS, run_probe


# The Hub online but unreachable, at once: its address is a closed local port, so no test uses the network.
HUB_UNREACHABLE = {"HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9"}


def case(
    name: str,
    argv: list[str],
    *names: str,
    absent: list[str] | None = None,
    env: dict[str, str] | None = None,
    loads_torch: bool = False,
):
    """`attnres *argv` must fail naming each of `names` and none of `absent` (the API's spellings of an option);
    only cases that need a model's config may import torch."""
    return pytest.param(argv, names, absent or [], env or {}, loads_torch, id=name)


CASES = [
    # convert: values, paths and files, before anything is read
    case("block-size-0", ["convert", "good", "out", "--block-size", "0"], "--block-size", "'0'"),
    case("block-size-negative", ["convert", "good", "out", "--block-size", "-2"], "--block-size", "'-2'"),
    case("block-size-not-a-number", ["convert", "good", "out", "--block-size", "two"], "--block-size", "'two'"),
    case(
        "block-size-above-sublayers",
        ["convert", "tiny", "out", "--block-size", "7"],
        "--block-size=7: must be an integer from 1 to 2 * num_hidden_layers = 6",
        absent=["block_size="],
        loads_torch=True,
    ),
    case("mode-unknown", ["convert", "good", "out", "--mode", "diagonal"], "--mode", "'diagonal'"),
    case("dtype-unknown", ["convert", "good", "out", "--dtype", "int8"], "--dtype", "'int8'"),
    case("arguments-missing", ["convert"], "SRC", "DST"),
    case("relative-path-missing", ["convert", "./does-not-exist", "out"], "SRC='./does-not-exist'", "no such file"),
    case("name-missing", ["convert", "does-not-exist", "out"], "SRC='does-not-exist'", "no such file"),
    case(
        "hub-id-offline",
        ["convert", "someone/not-cached", "out"],
        "SRC='someone/not-cached'",
        "neither a local folder nor in the local Hub cache",
        "HF_HUB_OFFLINE=1",
        "pass a local folder",
    ),
    case(
        "hub-id-unreachable",  # the Hub's address is a closed local port: no network is used, the answer is at once
        ["convert", "someone/not-cached", "out"],
        "SRC='someone/not-cached'",
        "neither a local folder nor reachable on the Hugging Face Hub (http://127.0.0.1:9: ",
        "pass a local folder",
        "HF_HUB_OFFLINE=1",
        env=HUB_UNREACHABLE,
    ),
    case("gguf-not-gguf", ["convert", "x.gguf", "out"], "SRC='x.gguf'", "not a GGUF file"),
    case(
        "gguf-file-missing", ["convert", "good", "out", "--gguf-file", "m.gguf"], "--gguf-file='m.gguf'", "SRC='good'"
    ),
    case("folder-without-config", ["convert", "empty", "out"], "SRC='empty'", "config.json"),
    case("file-not-a-model", ["convert", "notes.txt", "out"], "SRC='notes.txt'", "not a model folder"),
    case(
        "destination-exists",
        ["convert", "good", "exists"],
        "DST=",
        "exists': already exists; pass --overwrite to replace it",
        absent=["overwrite=True"],
    ),
    case("destination-inside-source", ["convert", "good", "good/sub"], "DST=", "overlaps SRC="),
    case(
        "text-file-missing", ["convert", "good", "out", "--text-file", "missing.txt"], "--text-file", "'missing.txt'"
    ),
    case(
        "text-file-not-utf8",
        ["convert", "good", "out", "--text-file", "latin1.txt"],
        "--text-file",
        "'latin1.txt'",
        "UTF-8",
    ),
    case("text-file-folder", ["convert", "good", "out", "--text-file", "empty"], "--text-file", "'empty'", "folder"),
    case(
        "text-file-empty", ["convert", "good", "out", "--text-file", "blank.txt"], "--text-file", "'blank.txt'", "empty"
    ),
    # demo
    case("demo-retrofit-steps-negative", ["demo", "--retrofit-steps", "-1"], "--retrofit-steps", "'-1'"),
    case("demo-block-size-0", ["demo", "--block-size", "0"], "--block-size", "'0'"),
    case("demo-model-missing", ["demo", "./nope", "--retrofit-steps", "0"], "MODEL='./nope'", "no such file"),
    case("demo-gguf-not-gguf", ["demo", "x.gguf", "--retrofit-steps", "0"], "MODEL='x.gguf'", "not a GGUF file"),
    case("demo-output-is-a-file", ["demo", "good", "--output", "notes.txt"], "--output='notes.txt'", "not a folder"),
    case("demo-plot-is-a-folder", ["demo", "good", "--plot", "empty"], "--plot='empty'", "not a PNG file"),
    case("demo-text-file-missing", ["demo", "--text-file", "missing.txt"], "--text-file", "'missing.txt'"),
    case(
        "demo-plays-missing",
        ["demo", "tiny"],
        "ATTNRES_SHAKESPEARE_DIR",
        env={"ATTNRES_SHAKESPEARE_DIR": "empty"},
        loads_torch=True,
    ),
    # eval
    case("eval-model-missing", ["eval", "/missing"], "MODEL='/missing'", "no such file or folder"),
    case("eval-model-hub-id-offline", ["eval", "someone/model"], "MODEL='someone/model'", "HF_HUB_OFFLINE=1"),
    case("eval-model-absent", ["eval"], "MODEL", "--list-tasks"),
    case(
        "eval-baseline-missing",
        ["eval", "good", "--baseline", "./nope"],
        "--baseline='./nope'",
        "no such file or folder",
    ),
    case("eval-limit-negative", ["eval", "good", "--limit", "-1"], "--limit", "'-1'"),
    case("eval-limit-0", ["eval", "good", "--limit", "0"], "--limit", "'0'"),
    case("eval-limit-fraction-above-1", ["eval", "good", "--limit", "1.5"], "--limit", "'1.5'"),
    case("eval-batch-size-0", ["eval", "good", "--batch-size", "0"], "--batch-size", "'0'"),
    case("eval-batch-size-word", ["eval", "good", "--batch-size", "big"], "--batch-size", "'big'"),
    case(
        "eval-include-path-missing",
        ["eval", "good", "--include-path", "nope"],
        "--include-path='nope'",
        "no such folder",
    ),
    case(
        "eval-output-dir-is-a-file",
        ["eval", "good", "--output-dir", "notes.txt"],
        "--output-dir='notes.txt'",
        "a file",
    ),
    # inspect: every model is checked before the first is loaded
    case("inspect-model-missing", ["inspect", "/missing", "--text", "hi"], "MODEL='/missing'", "no such folder"),
    case(
        "inspect-second-model-missing", ["inspect", "good", "./bad", "--text", "hi"], "MODEL='./bad'", "no such folder"
    ),
    case("inspect-folder-without-config", ["inspect", "empty", "--text", "hi"], "MODEL='empty'", "config.json"),
    case(
        "inspect-hub-id-offline",
        ["inspect", "someone/not-cached", "--text", "hi"],
        "MODEL='someone/not-cached'",
        "HF_HUB_OFFLINE=1",
    ),
    case("inspect-text-absent", ["inspect", "good"], "--text", "--text-file"),
    case(
        "inspect-text-twice", ["inspect", "good", "--text", "hi", "--text-file", "notes.txt"], "--text-file", "--text"
    ),
    case(
        "inspect-text-file-missing", ["inspect", "good", "--text-file", "missing.txt"], "--text-file", "'missing.txt'"
    ),
    case("inspect-max-tokens-0", ["inspect", "good", "--text", "hi", "--max-tokens", "0"], "--max-tokens", "'0'"),
    case(
        "inspect-labels-count",
        ["inspect", "good", "good", "--text", "hi", "--labels", "one"],
        "--labels=['one']",
        "2 models",
        loads_torch=True,
    ),
    case(
        "inspect-output-dir-is-a-file",
        ["inspect", "good", "--text", "hi", "--output-dir", "notes.txt"],
        "--output-dir='notes.txt'",
        "a file",
    ),
    # export
    case("export-model-missing", ["export", "./nope", "out", "--to", "fla"], "MODEL='./nope'", "no such folder"),
    case(
        "export-destination-exists",
        ["export", "good", "exists", "--to", "fla"],
        "DST=",
        "pass --overwrite",
        absent=["overwrite=True"],
    ),
    case(
        "export-hub-id-unreachable",
        ["export", "someone/not-cached", "out", "--to", "fla"],
        "MODEL='someone/not-cached'",
        "neither a local folder nor reachable on the Hugging Face Hub",
        env=HUB_UNREACHABLE,
    ),
    # serve, and the command itself
    case("serve-model-missing", ["serve", "./nope"], "MODEL='./nope'", "no such folder"),
    case("serve-folder-without-config", ["serve", "empty"], "MODEL='empty'", "config.json"),
    case(
        "serve-hub-id-unreachable",
        ["serve", "someone/not-cached", "--port", "8000"],
        "MODEL='someone/not-cached'",
        "neither a local folder nor reachable on the Hugging Face Hub",
        env=HUB_UNREACHABLE,
    ),
    case("serve-model-absent", ["serve"], "required: MODEL (see", absent=["OPTION"]),
    case("command-unknown", ["frobnicate"], "'frobnicate'"),
    case("command-absent", [], "COMMAND"),
]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The files the cases name, in the folder the command runs in."""
    root = tmp_path_factory.mktemp("bad-input")
    (root / "good").mkdir()
    (root / "good" / "config.json").write_text("{}")  # a folder that looks like a checkpoint: only the CLI runs
    LlamaForCausalLM(LlamaConfig(**TINY_SHAPE)).save_pretrained(root / "tiny")  # 6 sublayers
    (root / "empty").mkdir()
    (root / "exists").mkdir()
    (root / "x.gguf").write_bytes(b"not a GGUF file")
    (root / "notes.txt").write_text("notes", encoding="utf-8")
    (root / "blank.txt").write_text(" \n", encoding="utf-8")
    (root / "latin1.txt").write_bytes("café".encode("latin-1"))
    return root


@pytest.mark.parametrize("argv, names, absent, env, loads_torch", CASES)
def test_bad_input_is_one_line_and_exit_2(workspace, argv, names, absent, env, loads_torch):
    before = sorted(workspace.rglob("*"))
    result = run_probe(argv, cwd=workspace, env={**os.environ, "HF_HUB_OFFLINE": "1", **env})

    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = error_lines(result.stderr)
    assert len(lines) == 1, result.stderr
    prog = f"attnres {argv[0]}" if argv and argv[0] in COMMANDS else "attnres"
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    for name in names:
        assert name in lines[0], f"{name!r} not in {lines[0]!r}"
    for name in absent:
        assert name not in lines[0], f"{name!r} in {lines[0]!r}"
    if not loads_torch:
        assert result.stdout.splitlines()[-1] == "[]", f"torch or transformers imported for {argv}"
    assert sorted(workspace.rglob("*")) == before, "a refused command must write nothing"


class _FakeHub(BaseHTTPRequestHandler):
    """Answers a file's metadata request (HEAD .../{owner}/{name}/resolve/{revision}/{file}) the way the Hub does
    for a repository that does not exist, a gated one, a missing revision and a missing file."""

    ANSWERS = {
        "unknown-org": (401, "RepoNotFound"),
        "gated-org": (403, "GatedRepo"),
        "no-such-branch": (404, "RevisionNotFound"),
        "no-config": (404, "EntryNotFound"),
        "missing.gguf": (404, "EntryNotFound"),
    }

    def do_HEAD(self):
        parts = self.path.split("/")
        status, code = next((answer for key, answer in self.ANSWERS.items() if key in parts), (200, None))
        self.send_response(status)
        if code is not None:
            self.send_header("X-Error-Code", code)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def fake_hub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeHub)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["unknown-org/model"], "SRC='unknown-org/model': neither a local folder nor a repository on the Hugging Face"),
        (["gated-org/model"], "SRC='gated-org/model': a gated repository on the Hugging Face Hub"),
        (
            ["known-org/model", "--revision", "no-such-branch"],
            "--revision='no-such-branch': no such revision of SRC='known-org/model'",
        ),
        (["known-org/no-config"], "SRC='known-org/no-config': a Hugging Face Hub repository without config.json"),
        (["known-org/model", "--gguf-file", "missing.gguf"], "--gguf-file='missing.gguf': no such file in SRC="),
    ],
    ids=["no-such-repository", "gated", "no-such-revision", "no-config", "no-such-gguf-file"],
)
def test_what_the_hub_answers_is_one_line_before_torch(tmp_path, fake_hub, argv, message):
    """The Hub's answers to the one request that checks a Hub id (a local stand-in for the Hub, so no network)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_ENDPOINT": fake_hub}
    result = run_probe(["convert", argv[0], "out", *argv[1:]], cwd=tmp_path, env=env)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert message in result.stderr and result.stdout.splitlines()[-1] == "[]", result.stderr
    assert not (tmp_path / "out").exists()
