"""Depth-attention maps, magnitude and gradient profiles of AttnRes (and any Llama-layout) models, as PNG and JSON.

`attnres inspect MODEL [MODEL ...] --text TEXT` runs `inspect_models`; `depth_profile` measures one loaded model.
"""

from .inspection import inspect_models
from .plots import write_pictures
from .profiles import DepthProfile, attention_matrices, depth_profile


__all__ = ["DepthProfile", "attention_matrices", "depth_profile", "inspect_models", "write_pictures"]
