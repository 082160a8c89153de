"""Training AttnRes models: optimizer groups, depth-only retrofits, the PEFT LoRA recipe, and the retrofit step.

    from attnres.training import AttnResTrainer, lora_config, train_depth_only, retrofit_depth

Pipeline parallelism, on PyTorch's engine, is `attnres.training.pipeline` (imported on its own).

Not imported by the modeling code, so checkpoints loaded with `trust_remote_code=True` never need it.
"""

from .data import shakespeare_dir, shakespeare_plays, token_stream, token_windows
from .depth import DEPTH_MODULE_NAMES, depth_parameter_names, is_depth_parameter, train_depth_only
from .lora import PROJECTION_TARGET_MODULES, lora_config
from .optimization import AttnResTrainer, decay_parameter_names, no_decay_parameter_names, optimizer_groups
from .retrofit import (
    RetrofitReport,
    demo_retrofit,
    depth_attention_table,
    evaluate_loss,
    plot_depth_attention,
    retrofit_depth,
)


__all__ = [
    "DEPTH_MODULE_NAMES",
    "PROJECTION_TARGET_MODULES",
    "AttnResTrainer",
    "RetrofitReport",
    "decay_parameter_names",
    "demo_retrofit",
    "depth_attention_table",
    "depth_parameter_names",
    "evaluate_loss",
    "is_depth_parameter",
    "lora_config",
    "no_decay_parameter_names",
    "optimizer_groups",
    "plot_depth_attention",
    "retrofit_depth",
    "shakespeare_dir",
    "shakespeare_plays",
    "token_stream",
    "token_windows",
    "train_depth_only",
]
