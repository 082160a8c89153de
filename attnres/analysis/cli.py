"""`attnres inspect MODEL [MODEL ...] --text TEXT [--output-dir DIR] [--labels ...] [--max-tokens N]`.

`add_parser` registers the subcommand on `attnres`'s sub-parsers and sets `handler` to `run`, following
`attnres.cli`'s convention; torch, transformers and matplotlib are imported only when the command runs.
"""

import argparse
import sys
from pathlib import Path


EXIT_INVALID = 2  # attnres.cli's status for invalid input


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "inspect",
        help="picture where each sublayer reads from (depth attention), activation magnitudes and gradient norms",
        description="Run MODEL (and any further models, e.g. a baseline and its AttnRes twin) on TEXT and write "
        "depth_attention.png (the paper's Figure 8: depth-attention weights of every sublayer, pre-attention and "
        "pre-MLP apart), magnitudes.png (RMS of each sublayer's input and output), gradient_norms.png (norm of the "
        "loss gradient of each sublayer's weights) and profiles.json to --output-dir. Models without a tokenizer "
        "read the text as UTF-8 bytes.",
    )
    parser.add_argument("models", metavar="MODEL", nargs="+", help="model folders or Hub ids, shown side by side")
    parser.add_argument("--text", required=True, help="the text to run the models on")
    parser.add_argument("--output-dir", type=Path, default=Path("attnres_inspect"), metavar="DIR")
    parser.add_argument("--labels", nargs="+", default=None, help="one name per model (default: folder names)")
    parser.add_argument("--max-tokens", type=int, default=512, metavar="N", help="truncate the text to N tokens")
    parser.add_argument("--device", default="cpu")
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from .inspection import inspect_models

    try:
        profiles, paths = inspect_models(
            args.models, args.text, args.output_dir, labels=args.labels, max_tokens=args.max_tokens, device=args.device
        )
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_INVALID
    for profile in profiles:
        print(
            f"{profile.label}: {profile.residual_mode}, {profile.num_sublayers} sublayers, "
            f"{profile.num_tokens} tokens, loss {profile.loss:.4f}"
        )
    for path in paths:
        print(f"wrote {path}")
    return 0
