"""Transformers' own common model tests (`ModelTesterMixin`), imported from the installed version's source
distribution, which `scripts/setup.sh` lays out under `data/transformers-<version>-tests/transformers_tests/`.

The sdist ships `tests/test_modeling_common.py` and `tests/test_configuration_common.py` but not three small files
they import; this module registers stand-ins for them before the import:

- `generation/test_utils.py`: `GenerationTesterMixin`, the generate tests. Not shipped, so not run here: an empty
  mixin that only satisfies `test_generation_tester_mixin_inheritance`. `tests/test_generation.py` tests generation.
- `exporters/test_export.py`: `ExportTesterMixin`, the `torch.export` tests; an empty mixin.
- `utils/test_configuration_utils.py`: `config_common_kwargs`, every `PreTrainedConfig` field with a non-default
  value, which `ConfigTester` checks a config accepts and keeps.

`PipelineTesterMixin` is not used: its module reads `tests/utils/tiny_model_summary.json` (not shipped) and its tests
load tiny models from the Hub.
"""

import importlib
import sys
import types
from pathlib import Path

import transformers


TESTS_ROOT = Path(__file__).resolve().parents[1] / "data" / f"transformers-{transformers.__version__}-tests"
PACKAGE = "transformers_tests"


class GenerationTesterMixin:
    """Stand-in for `tests/generation/test_utils.py::GenerationTesterMixin`, which the sdist does not ship."""


class ExportTesterMixin:
    """Stand-in for `tests/exporters/test_export.py::ExportTesterMixin`, which the sdist does not ship."""


CONFIG_COMMON_KWARGS = {
    "output_hidden_states": True,
    "return_dict": False,
    "dtype": "float16",
    "chunk_size_feed_forward": 5,
    "architectures": ["AttnResForCausalLM"],
    "id2label": {0: "negative", 1: "neutral", 2: "positive"},
    "label2id": {"negative": 0, "neutral": 1, "positive": 2},
    "problem_type": "single_label_classification",
}


def _register_stand_ins() -> None:
    stand_ins = {
        "generation.test_utils": {"GenerationTesterMixin": GenerationTesterMixin},
        "exporters.test_export": {"ExportTesterMixin": ExportTesterMixin},
        "utils.test_configuration_utils": {"config_common_kwargs": CONFIG_COMMON_KWARGS},
    }
    for dotted, attributes in stand_ins.items():
        parent, child = dotted.split(".")
        package = sys.modules.setdefault(f"{PACKAGE}.{parent}", types.ModuleType(f"{PACKAGE}.{parent}"))
        package.__path__ = []
        module = types.ModuleType(f"{PACKAGE}.{dotted}")
        module.__dict__.update(attributes)
        sys.modules[f"{PACKAGE}.{dotted}"] = module
        setattr(package, child, module)


def import_common_tests() -> tuple[types.ModuleType, types.ModuleType]:
    """`(test_modeling_common, test_configuration_common)` of the installed Transformers version."""
    if not (TESTS_ROOT / PACKAGE / "test_modeling_common.py").is_file():
        raise RuntimeError(
            f"Transformers {transformers.__version__}'s common tests are not in {TESTS_ROOT}: "
            "run `bash scripts/setup.sh`"
        )
    if str(TESTS_ROOT) not in sys.path:
        sys.path.insert(0, str(TESTS_ROOT))
    _register_stand_ins()
    return (
        importlib.import_module(f"{PACKAGE}.test_modeling_common"),
        importlib.import_module(f"{PACKAGE}.test_configuration_common"),
    )
