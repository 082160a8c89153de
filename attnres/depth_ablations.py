"""The paper's Table 4 ablations of AttnRes (docs/design.md §9), as depth-mixing modules.

Each changes one step of depth attention: the query (`query_for`), the scores (`logits`), how scores become weights
(`normalize`) or which sources are visible (`sources`). Each also breaks an assumption of the two-phase form (a static
query, the softmax merge, a shared key norm), so they compute the naive form from the sources, always with each
step's own query (the model gathers none for them): they exist to measure quality, not speed. Weights are
`[K, *tokens, heads]` (one head but for the multi-head ablation), in fp32.
"""

import torch
from torch import nn
from transformers import initialization as init

from .depth_mixing import DepthAttention, DepthQuery, num_depth_sources
from .depth_state import DepthContext, DepthState, full_precision
from .two_phase import inverse_rms


class DepthAttentionAblation(DepthAttention):
    """The naive form of depth attention (docs/design.md §3-§4) over explicitly listed sources, which each ablation
    changes in one place. Its state is AttnRes's, without gathered queries or phase 1."""

    two_phase = False

    def query_for(self, sources: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        """The query with the key-norm gain folded in: `[D]`, or `[*tokens, D]` when it depends on the input."""
        return self.query()

    def logits(self, sources: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        scores = (sources.float() * self.query_for(sources, inv_rms)).sum(-1) * inv_rms
        return scores.unsqueeze(-1)

    def normalize(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=0)

    @full_precision
    def forward(self, state: DepthState, context: DepthContext) -> torch.Tensor:
        sources, inv_rms = self.sources(state)
        weights = self.normalize(self.logits(sources, inv_rms))
        values = sources.float().unflatten(-1, (weights.shape[-1], -1))  # [K, *tokens, heads, D / heads]
        hidden = (weights.unsqueeze(-1) * values).sum(0).flatten(-2)
        return (hidden if self.output_scale == 1 else hidden * self.output_scale).to(sources.dtype)

    def attention_weights(self, state: DepthState, context: DepthContext) -> torch.Tensor:
        """The weights `[batch, seq, num_sources]` (averaged over heads), for analysis."""
        sources, inv_rms = self.sources(state)
        return self.normalize(self.logits(sources, inv_rms)).mean(-1).movedim(0, -1)


class InputDependentQueryDepthAttention(DepthAttentionAblation):
    """Ablation: a per-token query `w_l + W_l RMSNorm(h)`, with h the newest source (v_{l-1} in Full AttnRes, the
    running partial sum or the newest completed block in Block AttnRes), i.e. what the network has just computed.

    `W_l` (`query_proj`, D x D) starts at zero, so the model starts as AttnRes with zero pseudo-queries. It costs a
    D x D projection per sublayer, and the queries of a block can no longer be scored together (no phase 1).
    """

    def __init__(self, hidden_size: int, *args, **kwargs):
        super().__init__(hidden_size, *args, **kwargs)
        self.query_proj = nn.Parameter(torch.zeros(hidden_size, hidden_size))

    def query_for(self, sources: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        newest = sources[-1].float() * inv_rms[-1].unsqueeze(-1)
        return self.query(newest @ self.query_proj.float().T)

    def init_residual_parameters(self, std: float) -> None:
        init.zeros_(self.query_proj)


class SigmoidDepthAttention(DepthAttentionAblation):
    """Ablation: each source's weight is `sigmoid(logit)` on its own: sources do not compete and weights do not sum
    to 1. With zero pseudo-queries every weight is 1/2, so the input is half the sum of the sources."""

    def normalize(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(logits)


class NoKeyNormDepthAttention(DepthAttentionAblation):
    """Ablation: scores `w . v_i` on the raw sources, so a source's weight grows with its magnitude as well as its
    direction. There is no key RMSNorm and no gain (on raw keys a gain would only rescale the query)."""

    def __init__(self, hidden_size: int, *args, **kwargs):
        super().__init__(hidden_size, *args, **kwargs)
        self.query = DepthQuery(hidden_size, key_norm=False)

    def logits(self, sources: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        return (sources.float() @ self.query()).unsqueeze(-1)


class SlidingWindowDepthAttention(DepthAttentionAblation):
    """Ablation: attend over the embedding and the newest `window` sources only (docs/design.md §9).

    The state keeps b_0 and the newest `window` completed blocks, all that any later step can see, so depth memory
    is bounded by the window instead of growing with depth.
    """

    def __init__(
        self, hidden_size: int, eps: float, position: int, block_size: int, num_sublayers: int, window: int, **kwargs
    ):
        super().__init__(hidden_size, eps, position, block_size, num_sublayers, **kwargs)
        self.window = window
        self.num_unwindowed_sources = num_depth_sources(position, block_size, num_sublayers)

    def sources(self, state: DepthState) -> tuple[torch.Tensor, torch.Tensor]:
        sources, inv_rms = super().sources(state)
        start = max(1, sources.shape[0] - self.window)
        return torch.cat([sources[:1], sources[start:]]), torch.cat([inv_rms[:1], inv_rms[start:]])

    def absorb(self, output: torch.Tensor, state: DepthState, context: DepthContext) -> DepthState:
        state = super().absorb(output, state, context)
        if len(state.blocks) <= self.window + 1:
            return state
        blocks = (state.blocks[0], *state.blocks[-self.window :])
        blocks_inv_rms = torch.cat([state.blocks_inv_rms[:1], state.blocks_inv_rms[-self.window :]])
        return state._replace(blocks=blocks, blocks_inv_rms=blocks_inv_rms)

    def attention_weights(self, state: DepthState, context: DepthContext) -> torch.Tensor:
        """The weights over all the sources the unwindowed step would see, zero outside the window."""
        visible = super().attention_weights(state, context)
        hidden = visible.new_zeros(*visible.shape[:-1], self.num_unwindowed_sources - visible.shape[-1])
        return torch.cat([visible[..., :1], hidden, visible[..., 1:]], dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, window={self.window}"


class MultiHeadDepthAttention(DepthAttentionAblation):
    """Ablation: `heads` independent depth attentions, each scoring (with per-head key RMSNorm) and mixing its own
    `D / heads` channels, so different channel groups can read different depths."""

    def __init__(self, *args, heads: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.heads = heads

    def logits(self, sources: torch.Tensor, inv_rms: torch.Tensor) -> torch.Tensor:
        keys = sources.float().unflatten(-1, (self.heads, -1))  # [K, *tokens, heads, D / heads]
        keys = keys * inverse_rms(keys, self.eps).unsqueeze(-1)
        return (keys * self.query_for(sources, inv_rms).unflatten(-1, (self.heads, -1))).sum(-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, heads={self.heads}"


def depth_ablation(config, *args, **kwargs) -> DepthAttentionAblation:
    """The ablation `config.depth_ablation` in front of a sublayer; `args` and `kwargs` as `DepthAttention`'s."""
    if config.depth_ablation == "sliding_window":
        return SlidingWindowDepthAttention(*args, window=config.depth_window, **kwargs)
    if config.depth_ablation == "multi_head":
        return MultiHeadDepthAttention(*args, heads=config.depth_heads, **kwargs)
    ablations = {
        "input_query": InputDependentQueryDepthAttention,
        "sigmoid": SigmoidDepthAttention,
        "no_key_norm": NoKeyNormDepthAttention,
    }
    return ablations[config.depth_ablation](*args, **kwargs)
