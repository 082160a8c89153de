"""Tiny random checkpoints of every decoder family the conversion covers (`attnres/families.py`): hidden 64, 3 layers,
grouped-query attention, windows shorter than the test prompts, the family's own features turned on (q/k norms,
soft-capping, multipliers, shared experts, dense layers among MoE ones), and every norm gain perturbed away from its
initial value, so that a norm read in the wrong place, or with the wrong eps, shows in the logits."""

from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel


COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, hidden_activation="gelu_pytorch_tanh")
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1])

# case name -> (model_type, config fields beside COMMON)
CASES = {
    "llama": ("llama", dict(attention_bias=True)),
    "llama-llama3": (
        "llama",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=10000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=32,
            )
        ),
    ),
    "llama-yarn": (
        "llama",
        dict(
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64)
        ),
    ),
    "llama-linear": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "mistral": ("mistral", dict(sliding_window=4)),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2": ("qwen2", {}),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=4, shared_expert_intermediate_size=48, **MOE)),
    "qwen3": ("qwen3", dict(head_dim=32)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=4, head_dim=32, **MOE)),
    "smollm3": ("smollm3", dict(no_rope_layer_interval=2)),
    "phi3": ("phi3", dict(partial_rotary_factor=0.5)),
    "granite": (
        "granite",
        dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=4.0),
    ),
    "gemma": ("gemma", dict(head_dim=16, hidden_activation="gelu_pytorch_tanh")),
    "gemma2": (
        "gemma2",
        dict(sliding_window=4, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, **GEMMA),
    ),
    "gemma3_text": ("gemma3_text", dict(sliding_window=4, sliding_window_pattern=2, **GEMMA)),
    "olmo2": ("olmo2", {}),
    "olmo3": ("olmo3", dict(sliding_window=4)),
}


def source_model(case: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """The family's own `*ForCausalLM` for `case` (with `overrides` of its config), random, in fp32, with every norm
    gain perturbed."""
    model_type, fields = CASES[case]
    config = AutoConfig.for_model(model_type, **{**COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    model.config.architectures = [type(model).__name__]  # as `save_pretrained` records it
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" in name:
                parameter.add_(0.2 * torch.randn(parameter.shape, generator=generator))
    return model


def save_source(case: str, folder: Path, **overrides) -> Path:
    source_model(case, **overrides).save_pretrained(folder)
    return folder


def prompt_ids(vocab_size: int = COMMON["vocab_size"], batch: int = 2, length: int = 11) -> torch.Tensor:
    """Longer than every window above, so that sliding-window layers and their caches matter."""
    return torch.randint(3, vocab_size, (batch, length), generator=torch.Generator().manual_seed(0))
