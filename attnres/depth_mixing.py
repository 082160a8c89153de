"""Depth mixing: what a sublayer reads instead of the residual stream.

One module sits in front of every attention sublayer, every MLP sublayer and the final norm. It turns the *depth
state* (what the network has produced so far) into the sublayer's input, and folds the sublayer's output back into
the state. The state is a tuple of tensors owned by the model's forward loop and passed positionally through the
decoder layers, so reentrant activation checkpointing sees every tensor:

- standard PreNorm (SPEC §2): `(residual_stream,)`; the input is the stream, the output is added to it.
- Block / Full AttnRes (SPEC §3-§4): `(blocks, blocks_inv_rms, partial)`: the completed block representations
  stacked `[N, batch, seq, D]` (b_0 = embedding), their inverse RMS (keys are normalised once per block and
  reused by every later query), and the running sum of the current block (`None` before its first sublayer).
"""

import math

import torch
from torch import nn

from .two_phase import inverse_rms, phase1, phase2


def num_depth_sources(position: int, block_size: int, num_sublayers: int) -> int:
    """How many sources the depth-mixing step in front of sublayer `position` (1..L, or L + 1 for the output)
    attends over: the completed blocks b_0..b_{n-1}, plus the running partial sum unless the sublayer opens its
    block (SPEC §4). With zero pseudo-queries the step returns the sum of these sources divided by this count."""
    if position > num_sublayers:
        return math.ceil(num_sublayers / block_size) + 1
    completed_blocks = (position - 1) // block_size + 1
    opens_block = (position - 1) % block_size == 0
    return completed_blocks if opens_block else completed_blocks + 1


def initial_depth_state(residual_mode: str, inputs_embeds: torch.Tensor, eps: float) -> tuple:
    """The depth state before the first sublayer: the embedding is the whole residual stream, or block b_0."""
    if residual_mode == "standard":
        return (inputs_embeds,)
    return inputs_embeds.unsqueeze(0), inverse_rms(inputs_embeds, eps).unsqueeze(0), None


class DepthKeyRMSNorm(nn.Module):
    """The gain gamma of a depth-mixing step's key RMSNorm, applied to the pseudo-query instead of the keys.

    `w . (gamma * RMSNorm(v)) == (w * gamma) . RMSNorm(v)`, so folding the gain into the query is exact and lets
    every query share the same normalised keys (SPEC §6). Folding happens in this module's forward so the gain is
    only read through a module call, which keeps accelerate's offloading hooks (`device_map` with disk / CPU
    offload) in charge of loading it.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, pseudo_query: torch.Tensor) -> torch.Tensor:
        return pseudo_query.float() * self.weight.float()


class StandardResidual(nn.Module):
    """The PreNorm residual connection `h_{l+1} = h_l + f_l(h_l)`, bit-compatible with Llama and Mixtral."""

    def forward(self, residual: torch.Tensor) -> torch.Tensor:
        return residual

    def update(self, residual: torch.Tensor, output: torch.Tensor) -> tuple[torch.Tensor]:
        return (residual + output,)


class DepthAttention(nn.Module):
    """Block AttnRes in front of one sublayer: softmax attention over the completed blocks and the partial sum.

    Holds the sublayer's pseudo-query `w_l` (zero-initialised, so a new model starts from uniform weights) and its
    key RMSNorm gain. Full AttnRes is the same module with block size 1. The input is computed the two-phase way
    (SPEC §6): phase 1 over the completed blocks, then the online-softmax merge with the partial sum.
    """

    def __init__(self, hidden_size: int, eps: float, position: int, block_size: int, num_sublayers: int):
        super().__init__()
        self.pseudo_query = nn.Parameter(torch.zeros(hidden_size))
        self.key_norm = DepthKeyRMSNorm(hidden_size)
        self.eps = eps
        self.position = position
        # The block is closed after its last sublayer and after the network's last sublayer, so the output step
        # (position L + 1) always sees complete blocks only.
        self.closes_block = position % block_size == 0 or position == num_sublayers

    def forward(
        self, blocks: torch.Tensor, blocks_inv_rms: torch.Tensor, partial: torch.Tensor | None
    ) -> torch.Tensor:
        query = self.key_norm(self.pseudo_query)
        obar, lse = phase1(blocks, blocks_inv_rms, query.unsqueeze(0))
        if partial is None:
            return obar[0].to(blocks.dtype)
        return phase2(obar[0], lse[0], partial, query, self.eps)

    def update(
        self, blocks: torch.Tensor, blocks_inv_rms: torch.Tensor, partial: torch.Tensor | None, output: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        partial = output if partial is None else partial + output
        if not self.closes_block:
            return blocks, blocks_inv_rms, partial
        blocks = torch.cat([blocks, partial.unsqueeze(0)])
        blocks_inv_rms = torch.cat([blocks_inv_rms, inverse_rms(partial, self.eps).unsqueeze(0)])
        return blocks, blocks_inv_rms, None

    def attention_weights(
        self, blocks: torch.Tensor, blocks_inv_rms: torch.Tensor, partial: torch.Tensor | None
    ) -> torch.Tensor:
        """The depth-attention weights `[batch, seq, num_sources]` over [b_0, ..., b_{n-1}, partial], for analysis."""
        sources = blocks if partial is None else torch.cat([blocks, partial.unsqueeze(0)])
        logits = (sources.float() @ self.key_norm(self.pseudo_query)) * inverse_rms(sources, self.eps)
        return torch.softmax(logits, dim=0).movedim(0, -1)

    def extra_repr(self) -> str:
        return f"sublayer={self.position}, closes_block={self.closes_block}"


def depth_mixer(config, position: int) -> nn.Module:
    """The depth-mixing module in front of sublayer `position` (1..L; L + 1 is the output) for `config`'s mode."""
    if config.residual_mode == "standard":
        return StandardResidual()
    return DepthAttention(
        config.hidden_size, config.rms_norm_eps, position, config.depth_block_size, config.num_sublayers
    )


def pre_norm_eps(config, position: int) -> float:
    """The eps of the RMSNorm that reads the output of depth-mixing step `position`.

    With `exact_retrofit`, eps / k**2 for a step with k sources (SPEC §5): zero pseudo-queries average the sources,
    and RMSNorm(sum / k, eps / k**2) == RMSNorm(sum, eps), so a converted PreNorm checkpoint is reproduced exactly.
    """
    if config.residual_mode == "standard" or not config.exact_retrofit:
        return config.rms_norm_eps
    k = num_depth_sources(position, config.depth_block_size, config.num_sublayers)
    return config.rms_norm_eps / k**2
