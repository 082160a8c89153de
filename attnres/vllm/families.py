"""The decoder families that vLLM's own modules serve natively, and how (docs/serving.md#vllm).

Each row names the family's vLLM decoder layer, whose modules (attention on the paged KV cache with its rotary
embedding, the fused MLP or MoE, its norms, its tensor-parallel linears) an AttnRes layer holds under the family's
names, and the family's vLLM model, whose `hf_to_vllm_mapper` stacks the checkpoint's q/k/v and gate/up into vLLM's
fused parameters as the weights load. The row says where the family's layer differs from Llama's: the MLP's name,
the pre-norm of the MLP, Gemma's post-norms (the sublayer's output as it joins the depth state, docs/design.md §1),
Gemma's scaled embedding and its `1 + w` norm. A family without a row is served by vLLM's Transformers backend.
"""

import importlib
from dataclasses import dataclass, field

from torch import nn


@dataclass(frozen=True)
class NativeFamily:
    """How one family's vLLM implementation provides AttnRes's sublayers.

    module: the family's module under `vllm.model_executor.models`.
    layer: its decoder layer class; model: its model class (whose `hf_to_vllm_mapper` maps checkpoint names).
    takes_vllm_config: whether the layer is built from the whole `VllmConfig` (Llama's), else from the config, cache
        and quantization configs.
    mlp: the name of the layer's MLP or MoE module; mlp_norm: the pre-norm in front of it.
    post_norms: the norms on the attention's and the MLP's outputs (Gemma 3's sandwich norms), or `None`.
    norm: the final norm's class in `vllm.model_executor.layers.layernorm`.
    embedding_scale: whether the token embedding is multiplied by sqrt(hidden_size) (Gemma's).
    renamed: checkpoint-name substrings the family's vLLM model names otherwise (Transformers' fused experts,
        `mlp.experts.gate_up_proj`, in Mixtral's `block_sparse_moe.experts.w13`).
    """

    module: str
    layer: str
    model: str
    takes_vllm_config: bool = False
    mlp: str = "mlp"
    mlp_norm: str = "post_attention_layernorm"
    post_norms: tuple[str | None, str | None] = (None, None)
    norm: str = "RMSNorm"
    embedding_scale: bool = False
    renamed: dict[str, str] = field(default_factory=dict)

    def cls(self, name: str) -> type:
        return getattr(importlib.import_module(f"vllm.model_executor.models.{self.module}"), name)

    def decoder_layer(self, vllm_config, prefix: str) -> nn.Module:
        """The family's vLLM decoder layer at `prefix` (`model.layers.{i}`, from which vLLM's modules read its
        index)."""
        layer_class = self.cls(self.layer)
        if self.takes_vllm_config:
            return layer_class(vllm_config=vllm_config, prefix=prefix)
        config = vllm_config.model_config.hf_config
        return layer_class(config, vllm_config.cache_config, vllm_config.quant_config, prefix=prefix)


NATIVE_FAMILIES: dict[str, NativeFamily] = {
    "llama": NativeFamily("llama", "LlamaDecoderLayer", "LlamaModel", takes_vllm_config=True),
    "mistral": NativeFamily("mistral", "MistralDecoderLayer", "MistralModel", takes_vllm_config=True),
    "qwen2": NativeFamily("qwen2", "Qwen2DecoderLayer", "Qwen2Model"),
    "qwen3": NativeFamily("qwen3", "Qwen3DecoderLayer", "Qwen3Model"),
    "mixtral": NativeFamily(
        "mixtral",
        "MixtralDecoderLayer",
        "MixtralModel",
        mlp="block_sparse_moe",
        renamed={
            ".mlp.gate.": ".block_sparse_moe.gate.",
            ".mlp.experts.gate_up_proj": ".block_sparse_moe.experts.w13",
            ".mlp.experts.down_proj": ".block_sparse_moe.experts.w2",
        },
    ),
    "gemma3_text": NativeFamily(
        "gemma3",
        "Gemma3DecoderLayer",
        "Gemma3Model",
        mlp_norm="pre_feedforward_layernorm",
        post_norms=("post_attention_layernorm", "post_feedforward_layernorm"),
        norm="GemmaRMSNorm",
        embedding_scale=True,
    ),
}
# The residual modes the native model computes; the comparison residuals and the ablations are served by the
# Transformers backend.
NATIVE_MODES = ("standard", "full", "block")


def why_not_native(config) -> str | None:
    """Why the native model does not serve `config` (a one-line reason), or `None` where it does."""
    if config.family not in NATIVE_FAMILIES:
        return f"family {config.family!r} has no native vLLM model here (native: {', '.join(NATIVE_FAMILIES)})"
    if config.residual_mode not in NATIVE_MODES:
        return f"residual_mode={config.residual_mode!r} is not native (native: {', '.join(NATIVE_MODES)})"
    if getattr(config, "depth_ablation", None) is not None:
        return f"depth_ablation={config.depth_ablation!r} is not native"
    return None

