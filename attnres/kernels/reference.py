"""The naive PyTorch reference every kernel here is tested against (`tests/test_kernels.py`,
`tests/test_cpu_kernels.py`): `attnres.two_phase`, re-exported beside the kernels.

The reference lives in `two_phase.py`, a flat module of the package, because the model imports it from there and
`save_pretrained` copies it into remote-code checkpoints.
"""

from ..two_phase import inverse_rms, phase1, phase1_rms_norm, phase2, phase2_rms_norm


__all__ = ["inverse_rms", "phase1", "phase1_rms_norm", "phase2", "phase2_rms_norm"]
