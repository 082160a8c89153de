"""Data loader of the offline smoke suite (`attnres_smoke`).

The smoke tasks read small JSONL files shipped inside the package instead of Hub datasets. lm-eval resolves a
relative `data_files` path against the working directory, which is not where an installed package lives, so the
tasks name this loader as their `custom_dataset` and give file names relative to the package's data folder.
"""

import json
from pathlib import Path
from typing import Any

import datasets


SMOKE_DATA_DIR = Path(__file__).resolve().parent / "tasks" / "smoke" / "data"


def load_shipped_dataset(data_files: dict[str, str], **metadata: Any) -> datasets.DatasetDict:
    """Build a `DatasetDict` with one split per entry of `data_files` (split name -> JSONL file name).

    lm-eval calls `custom_dataset(**task_metadata, **dataset_kwargs)`; the task metadata (version, config source, ...)
    is not needed here. Building the splits in memory skips the datasets cache, which keeps the smoke run free of
    disk side effects and fast.
    """
    splits = {}
    for split, file_name in data_files.items():
        path = Path(file_name) if Path(file_name).is_absolute() else SMOKE_DATA_DIR / file_name
        with path.open(encoding="utf-8") as handle:
            rows = [json.loads(line) for line in handle if line.strip()]
        splits[split] = datasets.Dataset.from_list(rows)
    return datasets.DatasetDict(splits)
