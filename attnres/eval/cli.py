"""`attnres eval MODEL [--baseline MODEL] [--tasks ...] [--limit N] [--batch-size B] [--output-dir DIR]`.

`add_parser` registers the subcommand on `attnres`'s sub-parsers and sets `handler` to `run`, following
`attnres.cli`'s convention; lm-eval and torch are imported only when the command runs.
"""

import argparse
import sys
from pathlib import Path


EXIT_INVALID = 2  # attnres.cli's status for invalid input: here unknown tasks, unavailable data, refused code execution


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "eval",
        help="run the paper's benchmark table (lm-eval) on an AttnRes model and a baseline",
        description="Evaluate MODEL (and --baseline) with lm-eval on the attnres task suites and write "
        "results_attnres.json, results_baseline.json, table.md (the paper's layout) and chart.png to --output-dir. "
        "Suites: attnres_paper (the paper's 14 benchmarks; needs their Hub datasets or a filled cache) and "
        "attnres_smoke (offline data shipped with the package). HumanEval and MBPP execute model-written code and "
        "run only with --allow-code-execution.",
    )
    parser.add_argument("model", metavar="MODEL", help="AttnRes model: a local folder or .gguf file")
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
    parser.add_argument("--batch-size", default="1", type=_batch_size, metavar="B", help="an integer or 'auto'")
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
    parser.add_argument("--list-tasks", action="store_true", help="list the benchmarks with their settings and exit")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from .suite import (
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
            from .report import render_settings

            print(render_settings(resolve_benchmarks(tasks or [PAPER_SUITE, SMOKE_SUITE], args.include_path)), end="")
            return 0

        from .runner import evaluate

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
    except (KeyError, CodeExecutionNotAllowedError, MissingExtraError, DatasetUnavailableError) as error:
        print(f"error: {error.args[0] if isinstance(error, KeyError) else error}", file=sys.stderr)
        return EXIT_INVALID
    print(report.markdown)
    print("Wrote " + ", ".join(str(path) for path in report.files.values()))
    return 0


def _limit(text: str) -> int | float:
    value = float(text)
    if value <= 0 or (value >= 1 and not value.is_integer()):
        raise argparse.ArgumentTypeError("--limit takes a whole number of examples or a fraction below 1")
    return value if value < 1 else int(value)


def _batch_size(text: str) -> int | str:
    return text if text.startswith("auto") else int(text)
