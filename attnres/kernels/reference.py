"""The PyTorch reference the kernels are tested against: `attnres.two_phase`, re-exported beside the kernels.

The reference lives in `two_phase.py`, a flat module of the package, because the model imports it from there and
`save_pretrained` copies it into remote-code checkpoints; it is re-exported here so each kernel sits beside its
reference.
"""

from ..two_phase import inverse_rms, phase1, phase2, phase2_rms_norm


__all__ = ["inverse_rms", "phase1", "phase2", "phase2_rms_norm"]
