"""Kernels for Block AttnRes aggregation (docs/design.md §6), each beside the PyTorch reference it is tested against.

- Triton kernels, forward and backward, as PyTorch custom ops (`phase1.py`, `phase2.py`): `phase1` and
  `phase2_rms_norm` (phase 2 fused with the RMSNorm in front of the sublayer that reads its result) take and return
  exactly what `attnres.two_phase.phase1` / `phase2_rms_norm` do (the reference, re-exported as
  `attnres.kernels.reference`), accept fp32, bf16 and fp16 blocks and partial sums, accumulate in fp32, and support
  any hidden size and token count. They are registered as `torch.ops.attnres.phase1` /
  `torch.ops.attnres.phase2_rms_norm` with fake (meta) implementations and autograd formulas, so `torch.compile`
  traces them as opaque nodes and differentiates through them.
- Fused C++ forward passes for inference on the CPU (`cpu.cpp`, built and loaded by `attnres.kernels.cpu`).

Without Triton this package still imports (for `attnres.kernels.cpu`), without the Triton names.
`attnres.kernel_dispatch.depth_kernels` imports each kind of kernel only when it is selected (docs/design.md §8), so
the model runs without either, and CPU processes never JIT-compile the Triton kernels.
"""

try:
    from .phase1 import phase1
    from .phase2 import phase2_rms_norm
except ImportError:  # no Triton: `from attnres.kernels import phase1` fails as the caller expects
    pass


__all__ = ["phase1", "phase2_rms_norm"]
