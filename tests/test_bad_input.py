"""Every bad input through the Python API: the exception type and its exact one-line message, before any work.

Each row calls the API with one bad argument and names the error it must raise: `FileNotFoundError` for what does not
exist, `ValueError` (`ConversionError` in conversion) for any other bad value, with a message of the form
`name=value: what is allowed`. The functions that would start real work (reading weights, loading a model, running
lm-eval) are replaced by ones that fail the test, so each row also proves that the check comes first; conversion rows
also check that no destination or scratch folder appears and that the source is unchanged.
"""

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import huggingface_hub.constants
import pytest
import transformers
from transformers import BertConfig, BertForMaskedLM, LlamaConfig, LlamaForCausalLM

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.analysis import inspect_models
from attnres.conversion import ConversionError, convert
from attnres.conversion import converter as converter_module
from attnres.eval import evaluate
from attnres.eval import runner as runner_module
from attnres.families import FAMILIES
from attnres.training import demo_retrofit, retrofit_depth
from attnres_cli import default_demo_model
from conftest import TINY_SHAPE


HUB_ID = "attnres-tests/no-such-model"  # a well-formed Hub id that is neither cached nor local
HUB_OFF = (
    ": neither a local folder nor in the local Hub cache, and the Hugging Face Hub is off (HF_HUB_OFFLINE=1); pass a "
    "local folder, or unset HF_HUB_OFFLINE to download it"
)


@dataclass(frozen=True)
class Files:
    """What the rows point at: real checkpoints to misuse and things that only look like them."""

    llama: Path  # a tiny Llama checkpoint, 3 layers = 6 sublayers
    bert: Path  # a tiny BertForMaskedLM checkpoint (post-norm)
    attnres: Path  # a tiny AttnRes checkpoint without a tokenizer (texts are read as bytes)
    not_gguf: Path  # a file named .gguf that is not GGUF
    no_config: Path  # an empty folder
    taken: Path  # an existing folder, as a destination
    bad_config: Path  # an AttnRes checkpoint folder whose config.json has exact_retrofit="yes"
    out: Path  # a destination that does not exist


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bad-input")
    LlamaForCausalLM(LlamaConfig(**TINY_SHAPE)).save_pretrained(root / "llama")
    bert = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertForMaskedLM(bert).save_pretrained(root / "bert")
    config = AttnResConfig(**{**TINY_SHAPE, "vocab_size": 256}, residual_mode="block", block_size=2)
    AttnResForCausalLM(config).save_pretrained(root / "attnres")
    (root / "fake.gguf").write_bytes(b"PK\x03\x04 a zip archive, not a GGUF file")
    (root / "empty").mkdir()
    (root / "taken").mkdir()
    (root / "taken" / "keep.txt").write_text("mine")
    config.save_pretrained(root / "bad-config")
    fields = json.loads((root / "bad-config" / "config.json").read_text())
    (root / "bad-config" / "config.json").write_text(json.dumps({**fields, "exact_retrofit": "yes"}))
    return {
        "llama": root / "llama",
        "bert": root / "bert",
        "attnres": root / "attnres",
        "not_gguf": root / "fake.gguf",
        "no_config": root / "empty",
        "taken": root / "taken",
        "bad_config": root / "bad-config",
    }


@pytest.fixture
def files(checkpoints, tmp_path, monkeypatch) -> Files:
    """The checkpoints, a fresh destination, the Hub offline, and every expensive step replaced by a failure."""

    def expensive(*args, **kwargs):
        raise AssertionError("expensive work started before the bad input was reported")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(converter_module, "resolve_source", expensive)
    monkeypatch.setattr(converter_module, "write_weights", expensive)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", expensive)
    monkeypatch.setattr(runner_module, "as_lm", expensive)
    monkeypatch.setattr(runner_module, "resolve_benchmarks", expensive)
    return Files(**checkpoints, out=tmp_path / "out")


@dataclass(frozen=True)
class Case:
    call: Callable[[Files], object]
    error: type[Exception]
    message: str  # the exact message, with {field} of `Files` for paths


def convert_(source: Callable[[Files], Path | str] = lambda f: f.llama, **kwargs) -> Callable[[Files], object]:
    """A conversion of `source` (the tiny Llama by default) into a fresh destination, with `kwargs`."""
    return lambda f: convert(source(f), f.out, verify=False, progress=False, **kwargs)


BLOCK_RULE = "must be an integer from 1 to 2 * num_hidden_layers{}, the source's number of sublayers"

CASES = {
    # conversion: options
    "convert block_size=0": Case(convert_(block_size=0), ConversionError, "block_size=0: " + BLOCK_RULE.format("")),
    "convert block_size=-2": Case(convert_(block_size=-2), ConversionError, "block_size=-2: " + BLOCK_RULE.format("")),
    "convert block_size=7": Case(convert_(block_size=7), ConversionError, "block_size=7: " + BLOCK_RULE.format(" = 6")),
    "convert block_size=2.5": Case(
        convert_(block_size=2.5), ConversionError, "block_size=2.5: " + BLOCK_RULE.format("")
    ),
    "convert mode": Case(
        convert_(mode="dense"), ConversionError, "mode='dense': must be one of 'standard', 'full', 'block'"
    ),
    "convert dtype int8": Case(
        convert_(dtype="int8"),
        ConversionError,
        "dtype='int8': must be a floating-point torch dtype, e.g. 'bfloat16' or 'float32'",
    ),
    "convert dtype unknown": Case(
        convert_(dtype="float33"),
        ConversionError,
        "dtype='float33': must be a floating-point torch dtype, e.g. 'bfloat16' or 'float32'",
    ),
    "convert empty text": Case(
        convert_(text=""), ConversionError, "text='': must be a non-empty text (None uses the built-in passage)"
    ),
    "convert max_text_tokens": Case(
        convert_(max_text_tokens=1),
        ConversionError,
        "max_text_tokens=1: must be an integer >= 2 (the perplexity needs two tokens)",
    ),
    # conversion: source and destination
    "convert missing relative path": Case(
        convert_(lambda f: "./does-not-exist"), FileNotFoundError, "source='./does-not-exist': no such file or folder"
    ),
    "convert missing absolute path": Case(
        convert_(lambda f: "/does-not-exist/model"),
        FileNotFoundError,
        "source='/does-not-exist/model': no such file or folder",
    ),
    "convert Hub id offline": Case(
        convert_(lambda f: HUB_ID),
        ConversionError,
        f"source='{HUB_ID}'" + HUB_OFF,
    ),
    "convert file named .gguf that is not GGUF": Case(
        convert_(lambda f: f.not_gguf),
        ConversionError,
        "source='{not_gguf}': not a GGUF file (it does not start with b'GGUF')",
    ),
    "convert other file": Case(
        convert_(lambda f: f.llama / "config.json"),
        ConversionError,
        "source='{llama}/config.json': not a model folder or a .gguf file",
    ),
    "convert folder without config.json": Case(
        convert_(lambda f: f.no_config),
        FileNotFoundError,
        "source='{no_config}': a folder without config.json, not a Transformers checkpoint",
    ),
    "convert missing gguf_file": Case(
        convert_(lambda f: f.no_config, gguf_file="model.gguf"),
        FileNotFoundError,
        "gguf_file='model.gguf': no such file in source='{no_config}'",
    ),
    "convert existing destination": Case(
        lambda f: convert(f.llama, f.taken, verify=False, progress=False),
        ConversionError,
        "destination='{taken}': already exists; pass overwrite=True to replace it",
    ),
    "convert destination inside source": Case(
        lambda f: convert(f.llama, f.llama / "inside", verify=False, progress=False),
        ConversionError,
        "destination='{llama}/inside': overlaps source='{llama}', which is only ever read, never written",
    ),
    "convert post-norm BertForMaskedLM": Case(
        convert_(lambda f: f.bert),
        ConversionError,
        "BertForMaskedLM uses true post-norm sublayers, norm(h + f(h)): the norm is applied to the residual stream "
        "itself, so the stream is not a plain sum of the sublayers' outputs; AttnRes conversion is exact only for "
        "residual-sum decoders.",
    ),
    # configuration
    "config exact_retrofit": Case(
        lambda f: AttnResConfig(exact_retrofit="yes"),
        ValueError,
        "AttnResConfig.exact_retrofit='yes': must be a bool (True or False)",
    ),
    "config router_aux_loss_coef": Case(
        lambda f: AttnResConfig(family="mixtral", router_aux_loss_coef=-1),
        ValueError,
        "AttnResConfig.router_aux_loss_coef=-1: must be a number >= 0",
    ),
    "config field of another family": Case(
        lambda f: AttnResConfig(family="llama", num_local_experts=4),
        ValueError,
        "AttnResConfig.num_local_experts=4: must be 0: family 'llama' has no such field",
    ),
    "config hidden_size and heads": Case(
        lambda f: AttnResConfig(hidden_size=30, num_attention_heads=4),
        ValueError,
        "AttnResConfig.hidden_size=30: must be a multiple of 2 * num_attention_heads = 8 (head_dim = hidden_size / "
        "num_attention_heads must be even: rotary embeddings rotate pairs of channels), or set head_dim",
    ),
    "config num_attention_heads=0": Case(
        lambda f: AttnResConfig(num_attention_heads=0),
        ValueError,
        "AttnResConfig.num_attention_heads=0: must be a positive integer",
    ),
    "config residual_mode": Case(
        lambda f: AttnResConfig(residual_mode="dense"),
        ValueError,
        "AttnResConfig.residual_mode='dense': must be one of 'standard' | 'full' | 'block' | 'denseformer' | 'hc' | "
        "'mhc'",
    ),
    "config block_size": Case(
        lambda f: AttnResConfig(num_hidden_layers=2, block_size=5),
        ValueError,
        "AttnResConfig.block_size=5: must be an integer from 1 to 2 * num_hidden_layers = 4",
    ),
    "config hybrid layer_types": Case(
        lambda f: AttnResConfig(
            family="qwen3_next", num_hidden_layers=2, layer_types=["linear_attention", "sliding_attention"]
        ),
        ValueError,
        "AttnResConfig.layer_types=['linear_attention', 'sliding_attention']: must be a list of 'full_attention' | "
        "'linear_attention'",
    ),
    "config num_experts_per_tok": Case(
        lambda f: AttnResConfig(num_local_experts=4, num_experts_per_tok=5),
        ValueError,
        "AttnResConfig.num_experts_per_tok=5: must be an integer from 1 to num_local_experts = 4",
    ),
    # DBRX's experts are counted in its `ffn_config` (from Transformers 5.25).
    **(
        {
            "config top-k in a sub-config": Case(
                lambda f: AttnResConfig(family="dbrx", ffn_config=dict(moe_num_experts=4, moe_top_k=5)),
                ValueError,
                "AttnResConfig.ffn_config.moe_top_k=5: must be an integer from 1 to ffn_config.moe_num_experts = 4",
            )
        }
        if "dbrx" in FAMILIES
        else {}
    ),
    "config attention_dropout": Case(
        lambda f: AttnResConfig(attention_dropout=1.5),
        ValueError,
        "AttnResConfig.attention_dropout=1.5: must be a probability in [0, 1]",
    ),
    "config hidden_act": Case(
        lambda f: AttnResConfig(hidden_act="swishy"),
        ValueError,
        "AttnResConfig.hidden_act='swishy': must be the name of a Transformers activation, e.g. 'silu' or 'gelu'",
    ),
    "config from_pretrained": Case(
        lambda f: AttnResConfig.from_pretrained(f.bad_config),
        ValueError,
        "AttnResConfig.exact_retrofit='yes': must be a bool (True or False)",
    ),
    "config from_pretrained override": Case(
        lambda f: AttnResConfig.from_pretrained(f.attnres, block_size=0),
        ValueError,
        "AttnResConfig.block_size=0: must be an integer from 1 to 2 * num_hidden_layers = 6",
    ),
    # inspection
    "inspect missing folder": Case(
        lambda f: inspect_models(["/missing"], "text", f.out), FileNotFoundError, "models[0]='/missing': no such folder"
    ),
    "inspect bad later model": Case(
        lambda f: inspect_models([f.attnres, "./missing"], "text", f.out),
        FileNotFoundError,
        "models[1]='./missing': no such folder",
    ),
    "inspect file": Case(
        lambda f: inspect_models([f.attnres, f.not_gguf], "text", f.out),
        ValueError,
        "models[1]='{not_gguf}': not a model folder",
    ),
    "inspect Hub id offline": Case(
        lambda f: inspect_models([HUB_ID], "text", f.out),
        ValueError,
        f"models[0]='{HUB_ID}'" + HUB_OFF,
    ),
    "inspect one model as a string": Case(
        lambda f: inspect_models(str(f.attnres), "text", f.out),
        ValueError,
        "models='{attnres}': must be a non-empty list of model folders or Hub ids",
    ),
    "inspect empty text": Case(
        lambda f: inspect_models([f.attnres], "", f.out), ValueError, "text='': must be a non-empty string"
    ),
    "inspect one-token text": Case(
        lambda f: inspect_models([f.attnres], "x", f.out),
        ValueError,
        "text='x': must give at least 2 tokens with '{attnres}''s tokenizer (the loss predicts each token from the "
        "previous one)",
    ),
    "inspect max_tokens": Case(
        lambda f: inspect_models([f.attnres], "text", f.out, max_tokens=0),
        ValueError,
        "max_tokens=0: must be an integer >= 2 (the loss predicts each token from the previous one)",
    ),
    "inspect labels": Case(
        lambda f: inspect_models([f.attnres], "text", f.out, labels=["a", "b"]),
        ValueError,
        "labels=['a', 'b']: must give one label per model (1 models)",
    ),
    # evaluation
    "eval missing model": Case(
        lambda f: evaluate("/missing", output_dir=f.out), FileNotFoundError, "model='/missing': no such file or folder"
    ),
    "eval missing baseline": Case(
        lambda f: evaluate(f.attnres, baseline="./missing", output_dir=f.out),
        FileNotFoundError,
        "baseline='./missing': no such file or folder",
    ),
    "eval baseline not a model": Case(
        lambda f: evaluate(f.attnres, baseline=3, output_dir=f.out),
        ValueError,
        "baseline=3: must be a model folder, a .gguf file, a Hub id, a PreTrainedModel or an lm-eval LM",
    ),
    "eval limit=0": Case(
        lambda f: evaluate(f.attnres, limit=0, output_dir=f.out),
        ValueError,
        "limit=0: must be None, a positive number of examples, or a fraction in (0, 1)",
    ),
    "eval limit=1.5": Case(
        lambda f: evaluate(f.attnres, limit=1.5, output_dir=f.out),
        ValueError,
        "limit=1.5: must be None, a positive number of examples, or a fraction in (0, 1)",
    ),
    "eval batch_size=0": Case(
        lambda f: evaluate(f.attnres, batch_size=0, output_dir=f.out),
        ValueError,
        "batch_size=0: must be a positive integer, 'auto' or 'auto:N'",
    ),
    "eval batch_size='many'": Case(
        lambda f: evaluate(f.attnres, batch_size="many", output_dir=f.out),
        ValueError,
        "batch_size='many': must be a positive integer, 'auto' or 'auto:N'",
    ),
    # training
    "retrofit steps=0": Case(
        lambda f: retrofit_depth(None, None, ["text"], ["text"], steps=0),
        ValueError,
        "steps=0: must be a positive integer",
    ),
    "retrofit learning_rate": Case(
        lambda f: retrofit_depth(None, None, ["text"], ["text"], learning_rate=-1e-3),
        ValueError,
        "learning_rate=-0.001: must be a positive number",
    ),
    "demo retrofit steps=-1": Case(
        lambda f: demo_retrofit(f.attnres, steps=-1), ValueError, "steps=-1: must be a positive integer"
    ),
}


def tree_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        digest.update(str(path.relative_to(folder)).encode())
        if path.is_file():
            digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bad_input_raises_one_line_naming_it(case, files, tmp_path):
    sources = {name: tree_digest(getattr(files, name)) for name in ("llama", "bert", "taken")}
    with pytest.raises(case.error) as caught:
        case.call(files)
    message = str(caught.value)
    assert message == case.message.format(**{name: str(path) for name, path in vars(files).items()})
    assert "\n" not in message
    assert {name: tree_digest(getattr(files, name)) for name in sources} == sources  # sources are never modified
    assert not files.out.exists()
    assert not [path for folder in (tmp_path, files.llama.parent) for path in folder.glob(".*.attnres-partial")]


def test_gguf_block_size_is_refused_before_dequantising(files):
    with pytest.raises(ConversionError) as caught:
        convert(default_demo_model(), files.out, block_size=99, verify=False, progress=False)
    assert str(caught.value) == "block_size=99: " + BLOCK_RULE.format(" = 60")
