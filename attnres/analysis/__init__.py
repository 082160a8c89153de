"""Depth-attention maps, magnitude and gradient profiles of AttnRes (and any Llama-layout) models, as PNG and JSON.

`attnres inspect MODEL [MODEL ...] --text TEXT` runs `inspect_models`; `depth_profile` measures one loaded model.
"""

from .depth_attention import DepthAttentionTable, draw_depth_attention, tabulate_depth_attention
from .inspection import inspect_models
from .plots import write_pictures
from .profiles import DepthProfile, depth_profile


__all__ = [
    "DepthAttentionTable",
    "DepthProfile",
    "depth_profile",
    "draw_depth_attention",
    "inspect_models",
    "tabulate_depth_attention",
    "write_pictures",
]
