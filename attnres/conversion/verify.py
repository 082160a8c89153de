"""Proof that a converted checkpoint computes what its source computes.

Both models run the same probes: a few prompts (through the chat template when the tokenizer has one) and a text
sample. A checkpoint without a tokenizer reads them as UTF-8 bytes (one token id per byte, as byte-level models do),
or, when its vocabulary has fewer than 256 ids, runs on random token ids and takes no text. The report says which,
and compares their logits position by position, their greedy generations, and their perplexity on the text. Only
one model is in memory at a time: the source's outputs are recorded, the source is freed, then the converted model
runs and is compared against the record.

Tolerance (float32, exact retrofit): max |dlogit| <= 1e-3, perplexity within 0.1%, every *decisive* position (the
source's top-2 logit margin above twice the logit tolerance) with the same top-1 token, and identical greedy
generations unless they part at such a near-tie. Exactly retrofitted models stay well inside (SmolLM2-135M: 8e-5, the
float rounding of a different summation order); without the exact retrofit the RMSNorm eps gap shows (docs/design.md
§5).
"""

import copy
import gc
import math
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import torch
from torch.nn import functional as F
from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel

from ..modeling_attnres import AttnResForCausalLM
from .sources import causal_lm_class


PROBE_PROMPTS = (
    "What is the capital of France?",
    "Write one sentence about the sea.",
    "Explain in a few words why the sky is blue.",
)
DEFAULT_NEW_TOKENS = 20
DEFAULT_TEXT_TOKENS = 256
# The files Transformers builds a tokenizer from; a checkpoint with none of them has no tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")
BYTE_VOCABULARY = 256  # token ids a model needs to read text as UTF-8 bytes


def sample_text() -> str:
    """The English passage shipped with the package (original prose), used for perplexity when none is given."""
    return resources.files("attnres.conversion").joinpath("sample_text.txt").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Tolerance:
    """How far a converted model may drift from its source and still pass verification."""

    max_abs_logit: float = 1e-3
    perplexity_rel: float = 1e-3

    @property
    def tie_margin(self) -> float:
        """A top-2 margin this small can flip under a perturbation within `max_abs_logit`: a near-tie."""
        return 2 * self.max_abs_logit


@dataclass
class GenerationComparison:
    """One probe prompt's greedy continuation by the source and by the converted model."""

    prompt: str
    source_ids: list[int]
    converted_ids: list[int]
    source_text: str
    converted_text: str
    near_tie: bool = False  # they part where the source's top-2 margin is within the tolerance

    @property
    def identical(self) -> bool:
        return self.source_ids == self.converted_ids


@dataclass
class VerificationReport:
    dtype: str
    tolerance: Tolerance
    max_abs_logit_diff: float
    mean_abs_logit_diff: float
    top1_agreement: float
    num_positions: int
    decisive_disagreements: int
    perplexity_source: float
    perplexity_converted: float
    text_tokens: int
    new_tokens: int
    generations: list[GenerationComparison] = field(default_factory=list)
    probes: str = ""  # what the models ran on: which text, and how it became token ids

    @property
    def perplexity_rel_diff(self) -> float:
        return abs(self.perplexity_converted - self.perplexity_source) / self.perplexity_source

    @property
    def failures(self) -> list[str]:
        """Why verification failed; empty when it passed."""
        failures = []
        if not self.max_abs_logit_diff <= self.tolerance.max_abs_logit:  # also catches NaN
            failures.append(
                f"max |dlogit| {self.max_abs_logit_diff:.3g} exceeds the tolerance {self.tolerance.max_abs_logit:g}"
            )
        if self.decisive_disagreements:
            failures.append(f"{self.decisive_disagreements} positions change their top-1 token outside a near-tie")
        diverged = [g for g in self.generations if not g.identical and not g.near_tie]
        if diverged:
            failures.append(f"{len(diverged)} greedy generations differ (first: {diverged[0].prompt!r})")
        if not self.perplexity_rel_diff <= self.tolerance.perplexity_rel:
            failures.append(
                f"perplexity changes by {100 * self.perplexity_rel_diff:.3g}%, tolerance "
                f"{100 * self.tolerance.perplexity_rel:g}%"
            )
        return failures

    @property
    def passed(self) -> bool:
        return not self.failures

    def format(self) -> str:
        identical = sum(g.identical for g in self.generations)
        ties = sum(g.near_tie for g in self.generations)
        tie_note = f", {ties} parting at a near-tie" if ties else ""
        ok = {True: "ok", False: "FAIL"}
        lines = [
            f"Verification ({self.dtype}) on {self.probes}",
            f"  max |dlogit|         {self.max_abs_logit_diff:.3e}   tolerance {self.tolerance.max_abs_logit:g}   "
            f"{ok[self.max_abs_logit_diff <= self.tolerance.max_abs_logit]}",
            f"  mean |dlogit|        {self.mean_abs_logit_diff:.3e}",
            f"  top-1 agreement      {100 * self.top1_agreement:.2f}% of {self.num_positions} positions   "
            f"{ok[self.decisive_disagreements == 0]}",
            f"  greedy generations   {identical}/{len(self.generations)} identical over {self.new_tokens} new "
            f"tokens{tie_note}   {ok[identical + ties == len(self.generations)]}",
            f"  perplexity           {self.perplexity_source:.4f} -> {self.perplexity_converted:.4f} "
            f"(change {100 * self.perplexity_rel_diff:.5f}%, tolerance {100 * self.tolerance.perplexity_rel:g}%)   "
            f"{ok[self.perplexity_rel_diff <= self.tolerance.perplexity_rel]}",
            f"  result               {'PASS' if self.passed else 'FAIL: ' + '; '.join(self.failures)}",
        ]
        return "\n".join(lines)


class VerificationError(RuntimeError):
    """The converted model does not match its source within the tolerance; nothing was written to DST.

    `report` is the conversion's report (a `ConversionReport`); `report.verification` holds the findings.
    """

    def __init__(self, report, message: str):
        super().__init__(message)
        self.report = report


@dataclass
class _Probes:
    """Token ids both models run: prompts to continue and a text to score, and what they are, for the report."""

    prompts: list[str]
    prompt_ids: list[torch.Tensor]
    text_ids: torch.Tensor
    description: str


@dataclass
class _Outputs:
    logits: list[torch.Tensor]  # one [T, V] fp32 tensor per prompt, then the text's
    nll: float  # mean next-token negative log-likelihood on the text
    generations: list[torch.Tensor]  # new token ids per prompt
    margins: list[torch.Tensor]  # top-2 margin of each generation step's scores


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` holds a file Transformers builds a tokenizer from."""
    return any((Path(folder) / name).is_file() for name in TOKENIZER_FILES)


def check_verification_text(folder: str | Path, vocab_size: int, text: str | None, shown: str) -> None:
    """Refuse a verification `text` that the checkpoint `shown` in `folder` could not read: without a tokenizer, a
    vocabulary below 256 ids holds no UTF-8 bytes, and the probes are random token ids instead."""
    if text is not None and not has_tokenizer(folder) and vocab_size < BYTE_VOCABULARY:
        raise ValueError(
            f"text: {shown} has no tokenizer, and its vocabulary of {vocab_size} ids is too small for the text's "
            f"UTF-8 bytes ({BYTE_VOCABULARY} ids); without a text it is verified on random token ids"
        )


def _probes(tokenizer, vocab_size: int, text: str | None, max_text_tokens: int) -> _Probes:
    """Probe prompts and text as token ids: the tokenizer's, else UTF-8 bytes, else random ids (then `text` must be
    None, see `check_verification_text`)."""
    which = "the given text" if text is not None else "the package's sample text"
    text = text if text is not None else sample_text()
    prompts = list(PROBE_PROMPTS)
    if tokenizer is None and vocab_size >= BYTE_VOCABULARY:
        prompt_ids = [torch.tensor(list(p.encode("utf-8"))) for p in prompts]
        text_ids = torch.tensor(list(text.encode("utf-8"))[:max_text_tokens])
        how = "as UTF-8 bytes (the checkpoint has no tokenizer)"
    elif tokenizer is None:
        generator = torch.Generator().manual_seed(0)
        prompt_ids = [torch.randint(vocab_size, (12,), generator=generator) for _ in PROBE_PROMPTS]
        text_ids = torch.randint(vocab_size, (min(max_text_tokens, 128),), generator=generator)
        description = (
            f"{len(prompt_ids)} prompts and {len(text_ids)} text tokens, all random token ids (the checkpoint has "
            f"no tokenizer, and its {vocab_size} ids are too few for UTF-8 bytes)"
        )
        return _Probes([f"<random token ids #{i}>" for i in range(len(prompt_ids))], prompt_ids, text_ids, description)
    else:
        if tokenizer.chat_template:
            formatted = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False
                )
                for p in prompts
            ]
            prompt_ids = [torch.tensor(tokenizer(f, add_special_tokens=False)["input_ids"]) for f in formatted]
        else:
            prompt_ids = [torch.tensor(tokenizer(p)["input_ids"]) for p in prompts]
        text_ids = torch.tensor(tokenizer(text)["input_ids"][:max_text_tokens])
        how = "with the checkpoint's tokenizer"
    if len(text_ids) < 2:
        raise ValueError("The verification text must be at least two tokens long.")
    description = f"{len(prompts)} prompts and {len(text_ids)} tokens of {which}, {how}"
    return _Probes(prompts, prompt_ids, text_ids, description)


@torch.no_grad()
def _predicted_vocab_size(model: PreTrainedModel) -> int:
    """The number of token ids the model computes logits for, those the probes may hold: the vocabulary, less the
    padding rows of a head whose logits the family drops (Inkling's `unpadded_vocab_size`)."""
    return model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=model.device), use_cache=False).logits.shape[-1]


@torch.no_grad()
def _run(model: PreTrainedModel, probes: _Probes, generation_config: GenerationConfig) -> _Outputs:
    logits = [model(input_ids=ids[None], use_cache=False).logits[0].float() for ids in probes.prompt_ids]
    text_logits = model(input_ids=probes.text_ids[None], use_cache=False).logits[0].float()
    logits.append(text_logits)
    nll = F.cross_entropy(text_logits[:-1], probes.text_ids[1:]).item()
    generations, margins = [], []
    for ids in probes.prompt_ids:
        out = model.generate(
            input_ids=ids[None],
            attention_mask=torch.ones_like(ids[None]),
            generation_config=generation_config,
        )
        generations.append(out.sequences[0, len(ids) :])
        top2 = torch.stack([score[0].float().topk(2).values for score in out.scores])
        margins.append(top2[:, 0] - top2[:, 1])
    return _Outputs(logits, nll, generations, margins)


def verification_summary(report: VerificationReport | None, unverified_reason: str | None = None) -> str:
    """The verification's part of a conversion's or an export's report: its findings, or why there are none."""
    if report is not None:
        return report.format()
    if unverified_reason is not None:
        return f"Not verified: {unverified_reason}."
    return "Verification skipped."


def verify_conversion(
    source: str | Path,
    converted: str | Path,
    *,
    tolerance: Tolerance = Tolerance(),
    dtype: torch.dtype = torch.float32,
    weights_dtype: torch.dtype | None = None,
    text: str | None = None,
    max_text_tokens: int = DEFAULT_TEXT_TOKENS,
    new_tokens: int = DEFAULT_NEW_TOKENS,
    source_generates_with_cache: bool = True,
) -> VerificationReport:
    """Run `source` (any Transformers causal LM folder) and `converted` (an AttnRes folder) on the same probes.

    Args:
        source, converted: local folders.
        tolerance: what passes (see the module docstring); the report records it.
        dtype: the dtype both models run in. The default tolerance is calibrated for float32; lower precisions
            round the two summation orders differently and need a looser one.
        weights_dtype: the dtype the conversion cast the weights to, if it cast them. The source's weights are
            rounded to it before running, so the check measures the conversion, not the requested rounding.
        text: English text for the perplexity (defaults to the passage shipped with the package), cut to
            `max_text_tokens` tokens. Refused (`ValueError`) for a source without a tokenizer whose vocabulary
            cannot hold UTF-8 bytes, which is verified on random token ids.
        new_tokens: length of the greedy generations compared.
        source_generates_with_cache: whether the source's `generate` uses its KV cache. FLA 0.6.0's cached
            generation under Transformers 5.24 does not follow its own forward pass (measured), so for FLA models
            every step is a full forward pass instead.
    """
    source, converted = Path(source), Path(converted)
    tokenizer = AutoTokenizer.from_pretrained(source) if has_tokenizer(source) else None

    model = causal_lm_class(source).from_pretrained(source, dtype=weights_dtype or dtype).to(dtype)
    vocab_size = _predicted_vocab_size(model)
    check_verification_text(source, vocab_size, text, f"source={str(source)!r}")
    probes = _probes(tokenizer, vocab_size, text, max_text_tokens)
    eos = model.generation_config.eos_token_id
    pad = model.generation_config.pad_token_id
    generation_config = GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=False,
        eos_token_id=eos,
        pad_token_id=pad if pad is not None else (eos[0] if isinstance(eos, list) else eos),
        output_scores=True,
        return_dict_in_generate=True,
    )
    reference_config = copy.deepcopy(generation_config)
    reference_config.use_cache = source_generates_with_cache
    reference = _run(model, probes, reference_config)
    del model  # one model in memory at a time
    gc.collect()

    model, loading = AttnResForCausalLM.from_pretrained(converted, dtype=dtype, output_loading_info=True)
    problems = {kind: keys for kind, keys in loading.items() if keys and kind != "error_msgs"}
    if problems:
        raise RuntimeError(f"The converted checkpoint does not load cleanly: {problems}")
    result = _run(model, probes, generation_config)
    del model
    gc.collect()

    return _compare(reference, result, probes, tokenizer, tolerance, dtype, new_tokens)


def _compare(
    reference: _Outputs,
    result: _Outputs,
    probes: _Probes,
    tokenizer,
    tolerance: Tolerance,
    dtype: torch.dtype,
    new_tokens: int,
) -> VerificationReport:
    diffs = torch.cat([(a - b).abs().flatten() for a, b in zip(reference.logits, result.logits)])
    source_logits = torch.cat(reference.logits)
    converted_logits = torch.cat(result.logits)
    top2 = source_logits.topk(2, dim=-1).values
    decisive = (top2[:, 0] - top2[:, 1]) > tolerance.tie_margin
    agree = source_logits.argmax(-1) == converted_logits.argmax(-1)

    def decode(ids: torch.Tensor) -> str:
        return tokenizer.decode(ids, skip_special_tokens=True) if tokenizer is not None else str(ids.tolist())

    generations = []
    for prompt, ours, theirs, margins in zip(
        probes.prompts, reference.generations, result.generations, reference.margins
    ):
        comparison = GenerationComparison(prompt, ours.tolist(), theirs.tolist(), decode(ours), decode(theirs))
        if not comparison.identical:
            split = next(
                (i for i, (a, b) in enumerate(zip(comparison.source_ids, comparison.converted_ids)) if a != b),
                min(len(ours), len(theirs)),
            )
            comparison.near_tie = split < len(margins) and margins[split].item() <= tolerance.tie_margin
        generations.append(comparison)

    return VerificationReport(
        dtype=str(dtype).removeprefix("torch."),
        tolerance=tolerance,
        max_abs_logit_diff=diffs.max().item(),
        mean_abs_logit_diff=diffs.mean().item(),
        top1_agreement=agree.float().mean().item(),
        num_positions=len(agree),
        decisive_disagreements=int((~agree & decisive).sum()),
        perplexity_source=math.exp(reference.nll),
        perplexity_converted=math.exp(result.nll),
        text_tokens=len(probes.text_ids),
        new_tokens=new_tokens,
        generations=generations,
        probes=probes.description,
    )
