"""Optimizer parameter groups for AttnRes: which parameters get weight decay, and a Trainer that uses the rule.

Weight decay pulls every decayed parameter towards zero. For most matrices that is a mild regulariser, but the
parameters of the residual path have a meaningful *non-zero* state, or a zero state that is not neutral:

- a pseudo-query `w_l` at zero is uniform depth attention (docs/design.md §3, §5). Decaying it drags every sublayer back
to
  averaging its sources, i.e. it fights exactly what the depth mixing is supposed to learn; and since a
  pseudo-query has only `hidden_size` entries, the decay term is not small next to its gradient;
- RMSNorm gains (the key norms of the depth-mixing steps, the pre-norms and the final norm) start at one and scale
  their inputs; decay shrinks them towards zero, which rescales the keys (flattening the depth softmax) and the
  sublayer inputs rather than regularising anything;
- the comparison residuals (docs/design.md §9) keep their mixing coefficients in the same `*_residual` modules, some
  of them matrices (Hyper-Connections' identity-initialised `static_residual`, mHC's `residual_bias`): decaying them
  would pull the residual connection itself towards zero.

So every parameter of a `*_residual` module (pseudo-queries, key norms, comparison coefficients), every other norm,
every bias and every remaining parameter with fewer than two dimensions goes into a group with `weight_decay=0`;
matrices (projections, embeddings, the LM head, MoE routers and experts) keep the decay. `transformers.Trainer`'s
own rule already exempts norms and biases, but not the pseudo-queries.
"""

import re

from torch import nn
from transformers import Trainer


# Parameter names that must never be decayed, whatever their shape. Shapes alone are not enough: under FSDP1 the
# parameters are flattened, and a name outlives any wrapping (PEFT's `modules_to_save.default.` or FSDP prefixes).
_NO_DECAY_NAME = re.compile(r"_residual\.|(?:bias|norm\.weight)$")


def no_decay_parameter_names(model: nn.Module) -> list[str]:
    """The names of `model`'s parameters that must not be weight-decayed: everything in a depth-mixing / residual
    module (`attn_residual`, `mlp_residual`, `output_residual`), every norm gain, biases, and any other parameter
    with fewer than two dimensions."""
    return [name for name, parameter in model.named_parameters() if _NO_DECAY_NAME.search(name) or parameter.ndim < 2]


def decay_parameter_names(model: nn.Module) -> list[str]:
    """The names of `model`'s parameters that get weight decay: every parameter not in `no_decay_parameter_names`."""
    exempt = set(no_decay_parameter_names(model))
    return [name for name, _ in model.named_parameters() if name not in exempt]


def optimizer_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Parameter groups for any `torch.optim` optimizer: trainable matrices with `weight_decay`, trainable
    pseudo-queries, norms, biases and other 1-D parameters without. Frozen parameters are left out.

    Use it in your own loop, or hand Trainer a ready optimizer (`optimizers=(AdamW(optimizer_groups(model, 0.1),
    lr=...), None)`); with Trainer, `AttnResTrainer` is simpler because it keeps `args.optim` and friends.
    """
    exempt = set(no_decay_parameter_names(model))
    trainable = [(name, parameter) for name, parameter in model.named_parameters() if parameter.requires_grad]
    return [
        {"params": [p for name, p in trainable if name not in exempt], "weight_decay": weight_decay},
        {"params": [p for name, p in trainable if name in exempt], "weight_decay": 0.0},
    ]


class AttnResTrainer(Trainer):
    """`transformers.Trainer` with the AttnRes weight-decay rule (see the module docstring).

    Only `get_decay_parameter_names` changes, the hook `Trainer.create_optimizer` uses to split the two groups, so
    every optimizer `TrainingArguments.optim` offers, the learning-rate schedule, FSDP, DeepSpeed and PEFT models
    work as with the plain Trainer.
    """

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        return decay_parameter_names(model)
