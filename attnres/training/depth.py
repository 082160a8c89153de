"""Selecting the depth-mixing parameters: the pseudo-queries and key norms AttnRes adds to a model.

Retrofitting a converted checkpoint starts from uniform depth attention, which reproduces the source model
(docs/design.md §5). The cheapest useful adaptation trains only these parameters (two vectors of `hidden_size` per
sublayer plus the output step; 70k parameters for SmolLM2-135M) and leaves every pretrained weight untouched.
"""

import re

from torch import nn


DEPTH_MODULE_NAMES = ("attn_residual", "mlp_residual", "output_residual")
"""Module names of the depth-mixing steps (`model.layers.{i}.attn_residual`, `.mlp_residual`,
`model.output_residual`): the `modules_to_save` of the PEFT recipe."""

# `attn_residual.query.pseudo_query`, and the same below a wrapper (PEFT: `attn_residual.modules_to_save.default.…`).
_DEPTH_PARAMETER = re.compile(r"_residual\.(?:.+\.)?query\.(?:pseudo_query|key_norm_weight)$")


def is_depth_parameter(name: str) -> bool:
    """Whether the parameter called `name` is a pseudo-query or a depth key-norm gain (also inside PEFT wrappers)."""
    return _DEPTH_PARAMETER.search(name) is not None


def depth_parameter_names(model: nn.Module) -> list[str]:
    """The names of `model`'s pseudo-queries and depth key-norm gains (empty for a standard-mode model)."""
    return [name for name, _ in model.named_parameters() if is_depth_parameter(name)]


def train_depth_only(model: nn.Module) -> list[str]:
    """Freeze every parameter of `model` except the pseudo-queries and depth key norms; return the trainable names.

    Also makes the input embeddings' output require grad (`enable_input_require_grads`) when the model offers it:
    with the embeddings frozen, *reentrant* activation checkpointing would otherwise see no checkpointed input
    that requires grad and silently drop the gradients of every pseudo-query inside the checkpointed layers.

    Raises:
        ValueError: the model has no depth parameters (a standard-mode model has nothing to train here).
    """
    names = depth_parameter_names(model)
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no depth-mixing parameters (query.pseudo_query / query.key_norm_weight under "
            f"{', '.join(DEPTH_MODULE_NAMES)}): depth-only training needs residual_mode='block' or 'full'."
        )
    trainable = set(names)
    for name, parameter in model.named_parameters():
        parameter.requires_grad_(name in trainable)
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    return names
