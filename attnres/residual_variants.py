"""Residual connections from other papers, as depth-mixing modules, to compare AttnRes against (docs/design.md §9).

Every class follows the protocol of `depth_state.py`: `forward(state, context)` returns the input of the sublayer the
module sits in front of, and `absorb(output, state, context)` folds that sublayer's raw output back into the state;
none of them reads the context. The states:

- DenseFormer (Pagliardini et al., arXiv:2402.02622): `DenseFormerState`. A depth-weighted average acts per decoder
  *block*, not per sublayer, so the module behind a block's last sublayer (its MLP, or the one mixer of a Mamba
  block), which closes the block, records the block output and replaces the stream by the average.
- Hyper-Connections (Zhu et al., arXiv:2409.19606) and mHC (Xie et al., arXiv:2512.24880): `HyperStreams`; the
  embedding starts in every stream.

HC and mHC compute their coefficients and mix the streams in fp32 whatever the model dtype, and with autocast off
(`full_precision`); DenseFormer's scalar averages run in the stream's dtype, also with autocast off. This file is
copied flat into remote-code checkpoints, so it imports nothing from the `attnres` package.
"""

import math
from typing import NamedTuple

import torch
from torch import nn
from transformers import initialization as init

from .depth_state import DepthContext, DepthMixer, full_precision
from .transformers_compat import slice_logits_to_keep
from .two_phase import inverse_rms


MHC_GATE_INIT = 0.01  # mHC's alpha: the dynamic (input-dependent) part starts as a small perturbation
HC_SCALE_INIT = 0.01  # HC's s_alpha, s_beta: likewise for the tanh part of Hyper-Connections


def _stacked_at_positions(stacked: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
    """`slice_logits_to_keep` on every entry of a stack `[n, *tokens, D]`."""
    return slice_logits_to_keep(stacked.movedim(0, -2), logits_to_keep).movedim(-2, 0)


class DenseFormerState(NamedTuple):
    """The PreNorm residual stream `[batch, seq, D]` and the stacked outputs of the decoder blocks so far
    `[i + 1, batch, seq, D]` (x_0 = the embedding)."""

    stream: torch.Tensor
    history: torch.Tensor

    def at_positions(self, logits_to_keep: int | torch.Tensor) -> "DenseFormerState":
        stream = slice_logits_to_keep(self.stream, logits_to_keep)
        return DenseFormerState(stream, _stacked_at_positions(self.history, logits_to_keep))


class HyperStreams(NamedTuple):
    """The n residual streams of Hyper-Connections and mHC, stacked `[n, batch, seq, D]`."""

    streams: torch.Tensor

    def at_positions(self, logits_to_keep: int | torch.Tensor) -> "HyperStreams":
        return HyperStreams(_stacked_at_positions(self.streams, logits_to_keep))


class DepthWeightedAverage(DepthMixer):
    """DenseFormer: a PreNorm residual stream, replaced after decoder blocks by a depth-weighted average (DWA).

    After decoder block i (1-based) the stream becomes `y_i = sum_j a_{i,j} x_j` over the embedding x_0 and the block
    outputs x_j (the stream after block j, before its own average), with learned static scalars. Dilation k keeps
    only j = i, i - k, i - 2k, ...; period p places an average after every p-th block, and always after the last so
    that the output reads one. `a_{i,i} = 1` and the others 0 make each average the identity, so a fresh model is
    exactly the PreNorm baseline.
    """

    def __init__(self, position: int, layer_offsets: tuple[int, ...], dilation: int, period: int):
        super().__init__()
        self.position = position
        # The last sublayer of decoder block i (its MLP, or its one mixer) sits at `layer_offsets[i]`: the module behind
        # it sees the whole block output.
        self.closes_block = position in layer_offsets[1:]
        self.block = layer_offsets.index(position) if self.closes_block else None
        self.dilation = dilation
        num_blocks = len(layer_offsets) - 1
        has_average = self.closes_block and (self.block % period == 0 or self.block == num_blocks)
        # x_j for j = i, i - k, ... >= 0: i // k + 1 sources, oldest first.
        self.dwa_weights = nn.Parameter(torch.zeros(self.block // dilation + 1)) if has_average else None

    def initial_state(self, inputs_embeds: torch.Tensor, queries: None, record_inputs: bool):
        return DenseFormerState(inputs_embeds, inputs_embeds.unsqueeze(0)), DepthContext(record_inputs=record_inputs)

    def forward(self, state: DenseFormerState, context: DepthContext | None = None) -> torch.Tensor:
        return state.stream

    @full_precision
    def absorb(
        self, output: torch.Tensor, state: DenseFormerState, context: DepthContext | None = None
    ) -> DenseFormerState:
        stream = state.stream + output
        if not self.closes_block:
            return DenseFormerState(stream, state.history)
        history = torch.cat([state.history, stream.unsqueeze(0)])
        if self.dwa_weights is None:
            return DenseFormerState(stream, history)
        sources = history[self.block % self.dilation :: self.dilation]
        return DenseFormerState(torch.tensordot(self.dwa_weights.to(sources.dtype), sources, dims=1), history)

    def init_residual_parameters(self, std: float) -> None:
        if self.dwa_weights is not None:
            identity = torch.zeros_like(self.dwa_weights)
            identity[-1] = 1.0
            init.copy_(self.dwa_weights, identity)

    def extra_repr(self) -> str:
        return f"sublayer={self.position}, closes_block={self.closes_block}, dilation={self.dilation}"


def _per_stream(vector: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`vector` `[n]` shaped to broadcast against per-stream, per-token coefficients `[n, *tokens]`."""
    return vector.float().view(-1, *([1] * (like.dim() - 1)))


def _mix_streams(weights: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """`sum_j weights[j] * streams[j]` in fp32, for per-token weights `[n, *tokens]` and streams `[n, *tokens, D]`."""
    return torch.einsum("j...,j...d->...d", weights, streams.float())


def _initial_streams(inputs_embeds: torch.Tensor, num_streams: int, record_inputs: bool):
    """The embedding in every one of the streams."""
    streams = inputs_embeds.unsqueeze(0).expand(num_streams, *inputs_embeds.shape)
    return HyperStreams(streams), DepthContext(record_inputs=record_inputs)


class HyperConnection(DepthMixer):
    """Hyper-Connections in front of one sublayer: n residual streams, read and written through learned matrices.

    With H the streams, the sublayer reads `h = A_m^T H` and the streams become `H' = B^T f(h) + A_r^T H`. Each of
    A_m `[n]`, A_r `[n, n]` and B `[n]` is a static matrix plus a dynamic, per-token part `s * tanh(norm(H) W)`
    computed from the RMS-normalised streams (no gain: it would only rescale W). Initialisation A_m = e_{l mod n},
    A_r = I, B = 1 and W = 0 keeps every stream equal to the PreNorm residual stream, which with the mean of the
    streams as the output (`StreamAverage`) makes a fresh model exactly the baseline.

    The coefficients are recomputed in `absorb` rather than cached from `forward`, so the module stays a pure
    function of the depth state (activation checkpointing recomputes it; hooks see every call).
    """

    def __init__(self, hidden_size: int, position: int, num_streams: int, eps: float):
        super().__init__()
        self.position = position
        self.eps = eps
        self.static_input = nn.Parameter(torch.zeros(num_streams))  # A_m
        self.static_residual = nn.Parameter(torch.zeros(num_streams, num_streams))  # A_r, [from stream, to stream]
        self.static_output = nn.Parameter(torch.zeros(num_streams))  # B
        self.dynamic_input = nn.Parameter(torch.zeros(hidden_size))  # W_m
        self.dynamic_residual = nn.Parameter(torch.zeros(hidden_size, num_streams))  # W_r
        self.dynamic_output = nn.Parameter(torch.zeros(hidden_size))  # W_beta
        self.input_scale = nn.Parameter(torch.zeros(()))  # s_alpha, shared by A_m and A_r as in the paper
        self.output_scale = nn.Parameter(torch.zeros(()))  # s_beta

    def _normalized(self, streams: torch.Tensor) -> torch.Tensor:
        return streams.float() * inverse_rms(streams, self.eps).unsqueeze(-1)

    def initial_state(self, inputs_embeds: torch.Tensor, queries: None, record_inputs: bool):
        return _initial_streams(inputs_embeds, self.static_input.shape[0], record_inputs)

    @full_precision
    def forward(self, state: HyperStreams, context: DepthContext | None = None) -> torch.Tensor:
        streams = state.streams
        dynamic = torch.tanh(self._normalized(streams) @ self.dynamic_input.float())  # [n, *tokens]
        weights = _per_stream(self.static_input, dynamic) + self.input_scale.float() * dynamic
        return _mix_streams(weights, streams).to(streams.dtype)

    @full_precision
    def absorb(self, output: torch.Tensor, state: HyperStreams, context: DepthContext | None = None) -> HyperStreams:
        streams = state.streams
        normalized = self._normalized(streams)
        dynamic_residual = torch.tanh(normalized @ self.dynamic_residual.float())  # [n_from, *tokens, n_to]
        residual = self.static_residual.float().view(streams.shape[0], *([1] * (streams.dim() - 2)), -1)
        residual = residual + self.input_scale.float() * dynamic_residual
        dynamic_output = torch.tanh(normalized @ self.dynamic_output.float())  # [n, *tokens]
        write = _per_stream(self.static_output, dynamic_output) + self.output_scale.float() * dynamic_output
        mixed = torch.einsum("j...i,j...d->i...d", residual, streams.float())
        return HyperStreams((mixed + write.unsqueeze(-1) * output.float()).to(streams.dtype))

    def init_residual_parameters(self, std: float) -> None:
        num_streams = self.static_input.shape[0]
        reads = torch.zeros(num_streams)
        reads[(self.position - 1) % num_streams] = 1.0
        init.copy_(self.static_input, reads)
        init.copy_(self.static_residual, torch.eye(num_streams))
        init.ones_(self.static_output)
        for weight in (self.dynamic_input, self.dynamic_residual, self.dynamic_output):
            init.zeros_(weight)
        init.constant_(self.input_scale, HC_SCALE_INIT)
        init.constant_(self.output_scale, HC_SCALE_INIT)

    def extra_repr(self) -> str:
        return f"sublayer={self.position}, streams={self.static_input.shape[0]}"


def sinkhorn_knopp(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """mHC's Sinkhorn-Knopp (Xie et al., arXiv:2512.24880, Eq. 9): from `M = exp(logits)` `[..., n, n]`, apply
    `M <- T_r(T_c(M))` `iterations` times, where T_c normalises the columns and T_r the rows.

    Rows come last, so `H_res @ 1 = 1` holds exactly: with `H'_i = sum_j H_res[i, j] H_j` every new stream is a convex
    combination of the old ones. The columns sum to 1 up to the iteration's residual error.

    The first iteration runs on `log M`, each normalisation a log-softmax: in the linear domain an entry more than
    about 88 below its matrix's largest underflows to 0 in fp32, and a column of zeros turns T_c into 0 / 0 (at logit
    std 32, one matrix in a hundred). After it every column holds an entry of at least 1 / n^2 and every row one of at
    least 1 / n, and each later T_c, T_r keeps that, so the remaining iterations run in the linear domain (cheaper:
    a sum instead of a log-sum-exp) and never divide by zero; an entry they flush to zero is one whose exact value is
    far below fp32's resolution of the others.
    """
    matrix = torch.log_softmax(torch.log_softmax(logits, dim=-2), dim=-1).exp()  # T_r(T_c(exp(logits))), exactly
    for _ in range(iterations - 1):
        matrix = matrix / matrix.sum(dim=-2, keepdim=True)  # T_c
        matrix = matrix / matrix.sum(dim=-1, keepdim=True)  # T_r
    return matrix


class RecomputedSinkhornKnopp(torch.autograd.Function):
    """`sinkhorn_knopp` that keeps only its input for the backward pass and recomputes the iterations there.

    Differentiating the iterations directly keeps every intermediate matrix and normaliser alive until the backward
    pass: about 4 * iterations tensors of `[..., n, n]` per sublayer (80 for 20 iterations), several times the
    sublayer's own `[..., D]` activations for n = 4 and small D. Recomputing the iterations (cheap: n x n per token)
    when the gradient is needed stores one `[..., n, n]` tensor instead, the approach mHC takes in its kernels.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, iterations: int) -> torch.Tensor:
        ctx.save_for_backward(logits)
        ctx.iterations = iterations
        return sinkhorn_knopp(logits, iterations)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_matrix: torch.Tensor) -> tuple[torch.Tensor, None]:
        (logits,) = ctx.saved_tensors
        with torch.enable_grad():
            logits = logits.detach().requires_grad_()
            matrix = sinkhorn_knopp(logits, ctx.iterations)
        (grad_logits,) = torch.autograd.grad(matrix, logits, grad_matrix)
        return grad_logits, None


class ManifoldHyperConnection(DepthMixer):
    """mHC in front of one sublayer: Hyper-Connections whose stream-mixing matrix is kept doubly stochastic.

    From the RMS-normalised flattened streams x (`[*tokens, n * D]`, fp32, no gain since the projections absorb it):
    `H_pre = sigmoid(alpha_pre * x phi_pre + b_pre)`, `H_post = 2 sigmoid(alpha_post * x phi_post + b_post)` and
    `H_res = SinkhornKnopp(alpha_res * mat(x phi_res) + b_res)`; the sublayer reads `sum_j H_pre[j] H_j` and the
    streams become `H'_i = sum_j H_res[i, j] H_j + H_post[i] f(.)`. A doubly stochastic H_res neither amplifies nor
    attenuates the streams however many layers compose it, which is mHC's point.

    Initialisation: alpha = 0.01 and phi ~ N(0, std) make the dynamic part a small perturbation; the biases make the
    static part the PreNorm residual (b_pre = logit(1/n): the sublayer reads the mean stream; b_post = 0: each stream
    receives the output once; b_res = 0: the uniform doubly stochastic matrix, which leaves equal streams equal).
    Coefficients are recomputed in `absorb`, as in `HyperConnection`.
    """

    def __init__(self, hidden_size: int, position: int, num_streams: int, eps: float, sinkhorn_iterations: int):
        super().__init__()
        self.position = position
        self.eps = eps
        self.sinkhorn_iterations = sinkhorn_iterations
        width = num_streams * hidden_size
        self.input_proj = nn.Parameter(torch.zeros(width, num_streams))  # phi_pre
        self.output_proj = nn.Parameter(torch.zeros(width, num_streams))  # phi_post
        self.residual_proj = nn.Parameter(torch.zeros(width, num_streams * num_streams))  # phi_res
        self.input_bias = nn.Parameter(torch.zeros(num_streams))  # b_pre
        self.output_bias = nn.Parameter(torch.zeros(num_streams))  # b_post
        self.residual_bias = nn.Parameter(torch.zeros(num_streams, num_streams))  # b_res, [to stream, from stream]
        self.input_gate = nn.Parameter(torch.zeros(()))  # alpha_pre
        self.output_gate = nn.Parameter(torch.zeros(()))  # alpha_post
        self.residual_gate = nn.Parameter(torch.zeros(()))  # alpha_res

    def _flat_normalized(self, streams: torch.Tensor) -> torch.Tensor:
        flat = streams.movedim(0, -2).flatten(-2)  # [*tokens, n * D]
        return flat.float() * inverse_rms(flat, self.eps).unsqueeze(-1)

    def input_weights(self, streams: torch.Tensor) -> torch.Tensor:
        """H_pre `[*tokens, n]` in (0, 1), fp32."""
        x = self._flat_normalized(streams)
        return torch.sigmoid(self.input_gate.float() * (x @ self.input_proj.float()) + self.input_bias.float())

    def output_and_residual_weights(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """H_post `[*tokens, n]` in (0, 2) and the doubly stochastic H_res `[*tokens, n, n]`, fp32."""
        x = self._flat_normalized(streams)
        num_streams = streams.shape[0]
        post = 2 * torch.sigmoid(self.output_gate.float() * (x @ self.output_proj.float()) + self.output_bias.float())
        logits = self.residual_gate.float() * (x @ self.residual_proj.float()).unflatten(-1, (num_streams, -1))
        logits = logits + self.residual_bias.float()
        return post, RecomputedSinkhornKnopp.apply(logits, self.sinkhorn_iterations)

    def initial_state(self, inputs_embeds: torch.Tensor, queries: None, record_inputs: bool):
        return _initial_streams(inputs_embeds, self.input_bias.shape[0], record_inputs)

    @full_precision
    def forward(self, state: HyperStreams, context: DepthContext | None = None) -> torch.Tensor:
        streams = state.streams
        return _mix_streams(self.input_weights(streams).movedim(-1, 0), streams).to(streams.dtype)

    @full_precision
    def absorb(self, output: torch.Tensor, state: HyperStreams, context: DepthContext | None = None) -> HyperStreams:
        streams = state.streams
        post, residual = self.output_and_residual_weights(streams)
        mixed = torch.einsum("...ij,j...d->i...d", residual, streams.float())
        written = post.movedim(-1, 0).unsqueeze(-1) * output.float()
        return HyperStreams((mixed + written).to(streams.dtype))

    def init_residual_parameters(self, std: float) -> None:
        num_streams = self.input_bias.shape[0]
        for projection in (self.input_proj, self.output_proj, self.residual_proj):
            init.normal_(projection, mean=0.0, std=std)
        for gate in (self.input_gate, self.output_gate, self.residual_gate):
            init.constant_(gate, MHC_GATE_INIT)
        init.constant_(self.input_bias, -math.log(num_streams - 1))  # sigmoid(b_pre) = 1 / n
        init.zeros_(self.output_bias)
        init.zeros_(self.residual_bias)

    def extra_repr(self) -> str:
        streams, iterations = self.input_bias.shape[0], self.sinkhorn_iterations
        return f"sublayer={self.position}, streams={streams}, sinkhorn_iterations={iterations}"


class StreamAverage(DepthMixer):
    """The output of Hyper-Connections and mHC: the streams combined into one hidden state for the final norm.

    Hyper-Connections (Zhu et al., arXiv:2409.19606, §2.1) sum the last streams ("we sum the last hyper hidden matrix
    row-wise") and pass the sum to the final norm. The mean differs only by the factor 1/n, which the final RMSNorm
    removes except through its eps, and with it a fresh HC model (all streams equal) is exactly the PreNorm baseline.
    The mHC paper defines no output head of its own; giving mHC HC's is this project's choice. DeepSeek-V4's mHC
    (Transformers' `DeepseekV4HyperHead`) learns one instead: per-token weights `sigmoid(s * RMSNorm(vec(H)) phi + b)
    + eps` over the streams.
    """

    def forward(self, state: HyperStreams, context: DepthContext | None = None) -> torch.Tensor:
        return state.streams.mean(dim=0)
