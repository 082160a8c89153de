"""The PEFT recipe for AttnRes: LoRA on the family's projections, plus the depth-mixing modules trained in full.

    from peft import get_peft_model
    model = get_peft_model(AutoModelForCausalLM.from_pretrained("smollm2-attnres"), lora_config())
    ...train...
    model.save_pretrained("adapter")                       # LoRA weights + the depth modules, a few MB
    merged = model.merge_and_unload()                      # a plain AttnResForCausalLM again
    merged.save_pretrained("merged")                       # loads with AutoModelForCausalLM

The shared weights keep the family's names, so the familiar target names work. The depth modules are tiny (two vectors
per sublayer) and start from the retrofit identity, so they are trained in full through `modules_to_save` rather
than given adapters: a low-rank update of a vector is no saving, and PEFT then saves, loads and merges them with
the adapter.
"""

from collections.abc import Sequence

from peft import LoraConfig, TaskType

from .depth import DEPTH_MODULE_NAMES


PROJECTION_TARGET_MODULES = (
    "q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj", "c_fc",
    "c_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
    "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "c_attn", "fc1",
    "fc2", "input_linear", "output_linear", "q_gate_proj",
    "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "in_proj", "g_proj", "w1", "w2", "w3", "x_proj",
    "linear_x", "linear_y", "linear_out", "Wqkv", "query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h",
    "a_proj", "f_proj", "fc1_latent_proj", "fc2_latent_proj", "Wi", "Wo", "Wq", "Wk", "Wv",
    "ffn.0", "ffn.2", "kv_proj", "r_proj", "q", "k", "v", "ogate_preact", "proj_up", "proj_up_gate", "proj_down",
    "qkv_opreact", "proj_up_gate_z",
)
"""The attention, token-mixer and dense-MLP projections of every family (`families.py`): Llama's names, Phi-3's fused
`qkv_proj` and `gate_up_proj`, StarCoder2's MLP (`c_fc`, `c_proj`), GPT-2's and GPT-BigCode's fused `c_attn`, OPT's,
BioGPT's and XGLM's `out_proj`, `fc1` and `fc2`, the low-rank projections of DeepSeek-V3's latent
attention and those of the linear attentions (Gated DeltaNet's `in_proj_qkvz`, `in_proj_ba` and `out_proj` in
Qwen3-Next, its `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` in Qwen3.5; Kimi Delta Attention's beta
`b_proj` and its low-rank forget gate `f_a_proj`, `f_b_proj` and output gate `g_a_proj`, `g_b_proj`; LFM2's short
convolution `in_proj`, `out_proj`, its MLP `w1`, `w2`, `w3`, and LFM3's attention gate `g_proj`; the Mamba mixers'
`in_proj`, `out_proj` (Granite 4, Bamba, Falcon-H1) and Jamba's `x_proj`, whose time-step projection `dt_proj` it
multiplies by its weight, which an adapter would not reach; RecurrentGemma's recurrent block `linear_x`, `linear_y`,
`linear_out`), the shared MLP of Granite MoE Shared and Granite 4 (`input_linear`, `output_linear`), A.X K2's
attention output gate (`q_gate_proj`), MPT's fused `Wqkv` (with `out_proj`, `up_proj`, `down_proj`), BLOOM's,
GPT-NeoX Japanese's and Persimmon's fused `query_key_value`, `dense`, `dense_h_to_4h` and `dense_4h_to_h`, OLMo
Hybrid's Gated DeltaNet `a_proj`, Bailing's linear-attention `f_proj`, Nemotron-H's latent projections around its
experts (`fc1_latent_proj`, `fc2_latent_proj`), ModernBERT decoder's attention output `Wo` and gated MLP `Wi`, `Wo`
(its prediction head's `dense` too), CTRL's `Wq`, `Wk`, `Wv`, `dense` and its MLP, an `nn.Sequential` whose linear
layers are named by their index (`ffn.0`, `ffn.2`: an index alone would name decoder layers too), JetMoE's key-value
projection `kv_proj` (its query and output projections are experts), Inkling's projection of the states its relative
position bias reads (`r_proj`), xLSTM's mLSTM layer `q`, `k`, `v`, its output gate `ogate_preact` and `out_proj`
(fused, `qkv_opreact`) and its MLP `proj_up`, `proj_up_gate`, `proj_down` (fused, `proj_up_gate_z`); its input and
forget gates, one scalar per head, are left out, as a router is. MoE models fuse their experts into 3-D parameters
(`mlp.experts.gate_up_proj`), which these names do not reach: there LoRA adapts the attention and any dense or
shared-expert MLP."""


def lora_config(
    r: int = 16,
    lora_alpha: int = 32,
    lora_dropout: float = 0.0,
    target_modules: Sequence[str] = PROJECTION_TARGET_MODULES,
    train_depth: bool = True,
    **kwargs,
) -> LoraConfig:
    """A causal-LM `LoraConfig` for AttnRes models.

    Args:
        r, lora_alpha, lora_dropout: the usual LoRA hyper-parameters.
        target_modules: module names that get LoRA adapters (default: every projection of every family).
        train_depth: also train the pseudo-queries and key norms in full, by listing the depth-mixing modules in
            `modules_to_save` (saved with the adapter, swapped in by `merge_and_unload`).
        **kwargs: any other `LoraConfig` field.
    """
    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=r,
        lora_alpha=lora_alpha,
        lora_dropout=lora_dropout,
        target_modules=list(target_modules),
        modules_to_save=list(DEPTH_MODULE_NAMES) if train_depth else None,
        **kwargs,
    )
