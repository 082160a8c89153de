"""Triton kernels for Block AttnRes aggregation (SPEC §6), forward and backward, as PyTorch custom ops.

`phase1` and `phase2_rms_norm` (phase 2 fused with the RMSNorm in front of the sublayer that reads its result) take
and return exactly what `attnres.two_phase.phase1` / `phase2_rms_norm` do (the reference, re-exported as
`attnres.kernels.reference`), accept fp32, bf16 and fp16 blocks and partial sums, accumulate in fp32, and support
any hidden size and token count. They are registered as `torch.ops.attnres.phase1` /
`torch.ops.attnres.phase2_rms_norm` with fake (meta) implementations and autograd formulas, so `torch.compile`
traces them as opaque nodes and differentiates through them.

Importing this package imports Triton; `attnres.depth_mixing.two_phase_ops` imports it only when the kernels are
selected, so the model runs without Triton and CPU processes never JIT-compile these kernels (which also lets
tests set `TRITON_INTERPRET=1` before the first import).
"""

from .phase1 import phase1
from .phase2 import phase2_rms_norm


__all__ = ["phase1", "phase2_rms_norm"]
