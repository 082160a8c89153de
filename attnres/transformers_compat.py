"""What the model code needs that differs across the Transformers versions it supports: 5.16.1 (what vLLM pins) to
the newest 5.x.

Transformers 5.20 renamed the key-value cache from `past_key_values` to `cache`, in the arguments of models, masks
and `generate` and in the fields of model outputs, and added `slice_logits_to_keep`. The model is written against
the newest names; this file maps them onto the installed version, so every difference sits in one place.

This file is copied flat into remote-code checkpoints, so it imports only torch and transformers.
"""

import functools
import inspect
from collections.abc import Callable

import torch
import transformers
from packaging import version
from transformers.utils.deprecation import deprecate_kwarg


TRANSFORMERS_VERSION = version.parse(transformers.__version__).release
# The name under which the installed version passes the key-value cache to models and returns it in their outputs.
CACHE_NAME = "cache" if TRANSFORMERS_VERSION >= (5, 20) else "past_key_values"


def recurrent_cache_name(mixer: torch.nn.Module) -> str:
    """The keyword under which the installed version passes the cache to the recurrent token mixer `mixer`: `cache`
    from 5.20, the same rename; before it `cache_params` (Gated DeltaNet, KDA, Mamba 2) or, for LFM2's short
    convolutions, `past_key_values`."""
    if CACHE_NAME == "cache":
        return "cache"
    return "cache_params" if "cache_params" in inspect.signature(mixer.forward).parameters else "past_key_values"


def keywords_taken(forward: Callable) -> frozenset[str] | None:
    """The keywords `forward` takes, or `None` where it takes any (`**kwargs`): before 5.20 LFM2's short convolution
    takes none beyond its own, where the newer versions' mixers take the attention keyword arguments too."""
    parameters = inspect.signature(forward).parameters.values()
    if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        return None
    return frozenset(parameter.name for parameter in parameters)


def accepts_past_key_values(forward: Callable) -> Callable:
    """Let `forward(cache=...)` also take the cache as `past_key_values`, as Llama does: deprecated (with Llama's
    warning) from Transformers 5.20, and before it the name that `generate` itself passes, taken silently. From 5.20
    it takes `cache_params` too (`accepts_cache_params`)."""
    if CACHE_NAME == "cache":
        return accepts_cache_params(deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward))

    @functools.wraps(forward)
    def renamed(*args, **kwargs):
        if type(kwargs.get("cache")).__name__ == "PagedAttentionCache":
            # Before 5.20 continuous batching hands its paged cache to the attention functions as `cache`, the
            # name this model gives its key-value cache.
            raise NotImplementedError(
                "continuous batching (generate_batch) needs transformers>=5.20; "
                f"{transformers.__version__} is installed"
            )
        if "past_key_values" in kwargs:
            kwargs.setdefault("cache", kwargs.pop("past_key_values"))
        return forward(*args, **kwargs)

    return renamed


def accepts_cache_params(forward: Callable) -> Callable:
    """From Transformers 5.20, let `forward(cache=...)` also take the cache as `cache_params`, deprecated, as the
    families of recurrent layers alone take it (Mamba 2); before 5.20, `forward` unchanged."""
    if CACHE_NAME == "cache":
        return deprecate_kwarg("cache_params", "5.40.0", new_name="cache")(forward)
    return forward


def output_with_cache(output_class: type, cache, **fields):
    """`output_class(**fields)` with the cache in the field the installed version names it (`cache` or
    `past_key_values`), where `generate` looks for it."""
    return output_class(**fields, **{CACHE_NAME: cache})


def output_cache(outputs):
    """The cache a model output holds, whichever the installed version names its field."""
    return getattr(outputs, CACHE_NAME)


try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # Transformers < 5.20

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        """The positions `logits_to_keep` selects, as Transformers >= 5.20 does: an `int` keeps the last ones (`0`
        all), a 1D tensor these positions, a 2D integer tensor per-sample positions, a 2D bool tensor a mask (the
        result then flattened to `[num_true, D]`)."""
        if isinstance(logits_to_keep, torch.Tensor) and logits_to_keep.ndim == 2:
            if logits_to_keep.dtype == torch.bool:
                return hidden_states[logits_to_keep]
            return torch.take_along_dim(hidden_states, logits_to_keep[..., None], dim=1)
        if isinstance(logits_to_keep, int):
            logits_to_keep = slice(-logits_to_keep, None)
        return hidden_states[:, logits_to_keep, :]
