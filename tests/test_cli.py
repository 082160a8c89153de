"""The `attnres` command line: it starts without torch, reads `--text-file`, and the demo keeps what it writes."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from attnres_cli import build_parser, main
from conftest import TINY_SHAPE


COMMANDS = ("convert", "demo", "eval", "export", "inspect", "serve")
# Runs the command line in a fresh interpreter and reports, on stdout's last line, which heavy modules it imported.
PROBE = """
import sys
import attnres_cli
try:
    status = attnres_cli.main(sys.argv[1:])
except SystemExit as stop:
    status = stop.code
print(sorted({"torch", "transformers"} & set(sys.modules)))
sys.exit(status)
"""


def run_probe(
    argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`attnres *argv` in a fresh interpreter; stdout's last line lists torch / transformers if they were imported."""
    return subprocess.run(
        [sys.executable, "-c", PROBE, *argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    "argv, status",
    [(["--help"], 0), *[([command, "--help"], 0) for command in COMMANDS], (["convert"], 2), (["frobnicate"], 2)],
    ids=["help", *[f"{command}-help" for command in COMMANDS], "missing-arguments", "unknown-command"],
)
def test_help_and_usage_errors_never_import_torch(argv, status):
    result = run_probe(argv)
    assert result.returncode == status, result.stderr
    assert result.stdout.splitlines()[-1] == "[]", "torch or transformers was imported"
    if status:
        assert len(result.stderr.splitlines()) == 1 and "(see attnres" in result.stderr, result.stderr


def test_text_file_is_read_for_convert_demo_and_inspect(tmp_path):
    text = tmp_path / "text.txt"
    text.write_text("Sein oder Nichtsein, das ist hier die Frage.", encoding="utf-8")
    parser = build_parser()
    for argv in (["convert", "SRC", "DST"], ["demo"], ["inspect", "MODEL"]):
        assert parser.parse_args([*argv, "--text-file", str(text)]).text == text.read_text(encoding="utf-8")
    assert parser.parse_args(["inspect", "MODEL", "--text", "literal"]).text == "literal"


@pytest.fixture
def tokenizerless_llama(tmp_path, monkeypatch) -> Path:
    """A tiny random Llama saved without a tokenizer, and two stand-in plays so the demo's retrofit could run."""
    folder = tmp_path / "llama"
    LlamaForCausalLM(LlamaConfig(**TINY_SHAPE)).save_pretrained(folder)
    plays = tmp_path / "plays"
    plays.mkdir()
    for play in ("hamlet", "macbeth"):
        (plays / f"{play}_gut.txt").write_text("To be, or not to be. " * 50, encoding="utf-8")
    monkeypatch.setenv("ATTNRES_SHAKESPEARE_DIR", str(plays))
    return folder


def test_demo_on_a_checkpoint_without_tokenizer_keeps_its_output(tokenizerless_llama, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    argv = ["demo", str(tokenizerless_llama), "--block-size", "2", "--retrofit-steps", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "result               PASS" in out and "no tokenizer, so the retrofit step" in out
    model = tmp_path / "attnres-demo" / "model"  # the default --output, in the current folder
    assert json.loads((model / "config.json").read_text())["model_type"] == "attnres"
    assert f"The demo wrote:\n  {Path('attnres-demo', 'model')}  the exact conversion" in out
    assert not (tmp_path / "attnres-demo" / "retrofitted").exists()  # nothing was trained

    # A second run replaces the demo's own model; a folder the demo did not write is never replaced.
    assert main(argv) == 0
    capsys.readouterr()
    (model / "config.json").write_text('{"model_type": "llama"}')
    assert main(argv) == 2
    assert "not an AttnRes model the demo can replace" in capsys.readouterr().err
    assert json.loads((model / "config.json").read_text())["model_type"] == "llama"


def _perplexity_line(report: str) -> str:
    return next(line for line in report.splitlines() if line.strip().startswith("perplexity"))


def test_text_file_is_read_as_bytes_without_a_tokenizer(tmp_path, capsys):
    """A checkpoint without a tokenizer but with 256 ids or more reads --text-file as UTF-8 bytes: the perplexity
    follows the file, and the report says what the probes were."""
    LlamaForCausalLM(LlamaConfig(**{**TINY_SHAPE, "vocab_size": 300})).save_pretrained(tmp_path / "bytes")
    texts = {"hamlet": "To be, or not to be, that is the question. " * 4, "digits": "0123456789 " * 20}
    lines = {}
    for name, text in texts.items():
        (tmp_path / f"{name}.txt").write_text(text, encoding="utf-8")
        argv = ["convert", str(tmp_path / "bytes"), str(tmp_path / name), "--text-file", str(tmp_path / f"{name}.txt")]
        assert main(argv) == 0
        report = capsys.readouterr().out
        assert f"3 prompts and {len(text.encode())} tokens of the given text, as UTF-8 bytes" in report, report
        assert "(the checkpoint has no tokenizer)" in report and "result               PASS" in report
        lines[name] = _perplexity_line(report)
    assert lines["hamlet"] != lines["digits"], lines

    assert main(["convert", str(tmp_path / "bytes"), str(tmp_path / "default")]) == 0
    assert "tokens of the package's sample text, as UTF-8 bytes" in capsys.readouterr().out


def test_text_file_is_refused_where_it_cannot_be_read(tmp_path, capsys):
    """Below 256 ids a checkpoint without a tokenizer is verified on random token ids, so --text-file is refused in
    one line before any weight is written; so is --text-file with --no-verify, which would not read it."""
    LlamaForCausalLM(LlamaConfig(**TINY_SHAPE)).save_pretrained(tmp_path / "small")  # 96 ids
    (tmp_path / "text.txt").write_text("To be, or not to be.", encoding="utf-8")
    source = str(tmp_path / "small")
    capsys.readouterr()  # what saving the model printed
    for extra, message in (
        ([], f"--text-file: SRC={source!r} has no tokenizer, and its vocabulary of 96 ids is too small"),
        (["--no-verify"], "--text-file: used only by the verification, which --no-verify skips"),
    ):
        assert main(["convert", source, str(tmp_path / "out"), "--text-file", str(tmp_path / "text.txt"), *extra]) == 2
        error = capsys.readouterr().err
        assert len(error.strip().splitlines()) == 1 and message in error, error
        assert not (tmp_path / "out").exists() and len(list(tmp_path.iterdir())) == 2  # no partial folder left

    assert main(["convert", source, str(tmp_path / "out")]) == 0
    report = capsys.readouterr().out
    assert "text tokens, all random token ids (the checkpoint has no tokenizer, and its 96 ids" in report, report
