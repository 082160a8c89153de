"""The numbers behind `attnres inspect`: where each sublayer reads from, how large its activations and gradients are.

The paper's analysis (Figure 8 and its training-dynamics figures) contrasts a PreNorm baseline, whose hidden state
grows with depth while the gradients concentrate in the first layers, with AttnRes, whose sublayers choose their
sources. For one text this module measures, per sublayer l = 1..L (docs/design.md §1 numbering):

- the depth-attention weights of the mixing step in front of it, averaged over the tokens (AttnRes models only);
- the RMS of its input h_l (the residual stream in a PreNorm model, the depth-mixed input under AttnRes) and of
  its raw output v_l;
- the norm of the language-modelling loss gradient with respect to its own weights (its pre-norm included).

Any Llama-layout causal LM works (`model.model.layers[i]` with `self_attn`, `mlp` and the two pre-norms), so a
Llama checkpoint can be profiled beside its AttnRes conversion.
"""

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from ..depth_mixing import PendingInput
from .depth_attention import DepthAttentionTable, tabulate_depth_attention


@dataclass
class DepthProfile:
    """Per-sublayer measurements of one model on one text; lists are indexed by sublayer l - 1."""

    label: str
    residual_mode: str
    num_tokens: int
    loss: float
    input_rms: list[float]
    output_rms: list[float]
    gradient_norms: list[float]
    final_input_rms: float  # the RMS of what the final norm reads
    # Depth-mixing module name -> mean weights over the tokens, one per source (b_0 = embedding first). Empty for
    # models without depth attention.
    attention_weights: dict[str, list[float]] = field(default_factory=dict)
    depth_block_size: int | None = None  # sublayers per block, for models with depth attention

    def depth_attention(self) -> DepthAttentionTable:
        """The depth-attention weights on the grid `attnres demo` draws too (`attnres.analysis.depth_attention`)."""
        return tabulate_depth_attention(self.attention_weights, self.depth_block_size, self.num_sublayers)

    @property
    def num_sublayers(self) -> int:
        return len(self.output_rms)


def _rms(tensor: torch.Tensor | PendingInput) -> float:
    """The RMS of a tensor, or of the input a depth-attention step hands its pre-norm uncomputed."""
    if isinstance(tensor, PendingInput):
        tensor = tensor.value()
    return tensor.detach().float().pow(2).mean().sqrt().item()


def _sublayers(decoder: nn.Module) -> list[tuple[nn.Module, nn.Module]]:
    """(pre-norm, sublayer) for sublayers 1..L in order."""
    sublayers = []
    for layer in decoder.layers:
        sublayers.append((layer.input_layernorm, layer.self_attn))
        sublayers.append((layer.post_attention_layernorm, layer.mlp))
    return sublayers


def depth_profile(model: nn.Module, input_ids: torch.Tensor, label: str = "model") -> DepthProfile:
    """Measure `model` (a causal LM with `.model.layers`) on `input_ids` `[1, seq]`: one forward and backward pass
    for magnitudes and gradients, plus one forward pass for the depth-attention weights when the model has them."""
    decoder = model.model
    sublayers = _sublayers(decoder)
    input_rms = [math.nan] * len(sublayers)
    output_rms = [math.nan] * len(sublayers)
    final_input_rms = math.nan
    handles = []

    def record(index: int):
        def pre_norm_hook(module, args):
            input_rms[index] = _rms(args[0])

        def sublayer_hook(module, args, output):
            output_rms[index] = _rms(output[0] if isinstance(output, tuple) else output)

        return pre_norm_hook, sublayer_hook

    for index, (norm, sublayer) in enumerate(sublayers):
        pre_norm_hook, sublayer_hook = record(index)
        handles.append(norm.register_forward_pre_hook(pre_norm_hook))
        handles.append(sublayer.register_forward_hook(sublayer_hook))

    def final_norm_hook(module, args):
        nonlocal final_input_rms
        final_input_rms = _rms(args[0])

    handles.append(decoder.norm.register_forward_pre_hook(final_norm_hook))
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    try:
        logits = model(input_ids=input_ids, use_cache=False).logits.float()
        loss = nn.functional.cross_entropy(logits[0, :-1], input_ids[0, 1:])
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    gradient_norms = []
    for norm, sublayer in sublayers:
        grads = [
            p.grad.float().pow(2).sum() for p in (*norm.parameters(), *sublayer.parameters()) if p.grad is not None
        ]
        gradient_norms.append(torch.stack(grads).sum().sqrt().item() if grads else 0.0)
    model.zero_grad(set_to_none=True)

    attention_weights = {}
    if callable(getattr(decoder, "depth_attention_weights", None)):
        for name, weights in decoder.depth_attention_weights(input_ids).items():
            attention_weights[name] = weights.float().mean(dim=(0, 1)).tolist()
    model.train(was_training)
    return DepthProfile(
        label=label,
        residual_mode=getattr(model.config, "residual_mode", "standard"),
        num_tokens=input_ids.shape[1],
        loss=loss.item(),
        input_rms=input_rms,
        output_rms=output_rms,
        gradient_norms=gradient_norms,
        final_input_rms=final_input_rms,
        attention_weights=attention_weights,
        depth_block_size=model.config.depth_block_size if attention_weights else None,
    )
