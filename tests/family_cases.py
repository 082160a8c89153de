"""Tiny random checkpoints of every decoder family the conversion covers (`attnres/families.py`): hidden 64, 3 layers,
grouped-query attention, windows shorter than the test prompts, the family's own features turned on (q/k norms,
soft-capping, multipliers, shared experts, dense layers among MoE ones, partial rotary, biases, dropouts), and every
norm gain and bias perturbed away from its initial value, so that a norm read in the wrong place, or with the wrong
eps, shows in the logits."""

from pathlib import Path

import torch
from transformers import PreTrainedModel

from attnres.families import FAMILIES


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
# DeepSeek-V3's and GLM-4.5's MoE: a dense first layer, a shared expert, the top-k chosen within the best of 2 groups.
DEEPSEEK_MOE = dict(
    n_routed_experts=4,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
)
# Multi-head latent attention: low-rank queries and keys/values, a rotary part and a position-free part per head.
# Its keys and values have as many heads as its queries.
MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
# DeepSeek-V3.2's sparse attention over latent attention, and its MoE after a dense first layer.
DSA = dict(
    **DEEPSEEK_MOE,
    **MLA,
    num_key_value_heads=4,
    mlp_layer_types=["dense", "sparse", "sparse"],
    index_topk=4,
    index_head_dim=16,
    index_n_heads=2,
)
# Gated DeltaNet between attention layers (Qwen3-Next, Qwen3.5): two heads of keys, four of values.
GATED_DELTANET = dict(
    head_dim=32,
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=3,
)
# Llama 3's RoPE scaling, from a context shorter than the tiny models'.
LLAMA3_ROPE = dict(
    rope_type="llama3",
    rope_theta=10000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=32,
)

# Kimi Delta Attention between NoPE latent-attention layers (Kimi Linear): four heads of 16 channels.
KIMI_DELTA_ATTENTION = dict(
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_heads=4,
    linear_head_dim=16,
    linear_conv_kernel_dim=3,
)
# OLMo Hybrid's Gated DeltaNet layers around an attention layer: two heads of keys, four of values.
OLMO_HYBRID = dict(
    layer_types=["linear_attention", "full_attention", "linear_attention"],
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_conv_kernel_dim=3,
)
# Gated short convolutions between attention layers (LFM2), with their bias.
SHORT_CONVOLUTION = dict(layer_types=["conv", "full_attention", "conv"], conv_L_cache=3, conv_bias=True)

# Mamba's layers of one mixer and no MLP (Mamba, Falcon Mamba): a selective scan after a short convolution, with biases.
MAMBA = dict(state_size=8, conv_kernel=3, time_step_rank=8, use_bias=True)
# Mamba 2's scan: 4 heads of 32 channels (expand * hidden_size), 2 groups, chunks shorter than the test prompts.
MAMBA2 = dict(num_heads=4, head_dim=32, n_groups=2, state_size=16, conv_kernel=3, chunk_size=4, use_bias=True)

# case name -> (model_type, config fields beside COMMON)
CASES = {
    "llama": ("llama", dict(attention_bias=True)),
    "llama-llama3": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
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
    "ministral": (
        "ministral",
        dict(head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    ),
    "glm4": ("glm4", dict(head_dim=32, partial_rotary_factor=0.25, attention_bias=True)),
    "ernie4_5": ("ernie4_5", dict(head_dim=16, use_bias=True)),
    "seed_oss": (
        "seed_oss",
        dict(head_dim=32, attention_out_bias=True, mlp_bias=True, attention_dropout=0.1, residual_dropout=0.1),
    ),
    "helium": ("helium", dict(head_dim=16, attention_bias=True, mlp_bias=True)),
    "arcee": (
        "arcee",
        dict(
            head_dim=16,
            mlp_bias=True,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
        ),
    ),
    "hunyuan_v1_dense": (
        "hunyuan_v1_dense",
        dict(
            head_dim=16,
            attention_bias=True,
            rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=1.0, alpha=50.0),  # NTK alpha
        ),
    ),
    "exaone4": ("exaone4", dict(head_dim=16, sliding_window=4, sliding_window_pattern=2)),
    "apertus": ("apertus", dict(head_dim=16, attention_bias=True)),
    "internlm3": ("internlm3", dict(head_dim=16, attention_bias=True, mlp_bias=True)),
    # One residual dropout module after both sublayers (at the attention dropout's rate).
    "emu3_text_model": ("emu3_text_model", dict(attention_dropout=0.1)),
    "exaone": ("exaone", dict(head_dim=16, attention_bias=True, mlp_bias=True)),
    "iquestcoder": ("iquestcoder", dict(head_dim=16, attention_bias=True, mlp_bias=True)),
    "glm": ("glm", dict(head_dim=32, partial_rotary_factor=0.25, attention_bias=True)),
    "cwm": (
        "cwm",
        dict(
            head_dim=16,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            rope_parameters=LLAMA3_ROPE,
        ),
    ),
    "bitnet": ("bitnet", dict(head_dim=16)),  # norms inside its attention and MLP too (`attn_sub_norm`, `ffn_sub_norm`)
    "diffllama": ("diffllama", dict(head_dim=16, attention_bias=True)),  # differential attention: two maps per head
    "apertus1p5_text": ("apertus1p5_text", dict(head_dim=16, attention_bias=True, rope_parameters=LLAMA3_ROPE)),
    "stablelm": (
        "stablelm",
        dict(partial_rotary_factor=0.5, qk_layernorm=True, use_qkv_bias=True, hidden_dropout=0.1),
    ),
    "starcoder2": ("starcoder2", dict(sliding_window=4, residual_dropout=0.1, embedding_dropout=0.1)),
    "deepseek_v3": ("deepseek_v3", dict(**DEEPSEEK_MOE, **MLA, num_key_value_heads=4)),
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4)),
    "glm4_moe": ("glm4_moe", dict(**DEEPSEEK_MOE, head_dim=16, use_qk_norm=True, partial_rotary_factor=0.5)),
    "olmoe": ("olmoe", dict(num_experts=4, num_experts_per_tok=2)),
    "granitemoe": (
        "granitemoe",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=4.0,
        ),
    ),
    # Partial RoPE as every supported Transformers reads it: before 5.19 its config ignores the released checkpoints'
    # `rotary_dim`, and the family's own model then rotates whole heads.
    "minimax_m2": (
        "minimax_m2",
        dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, partial_rotary_factor=0.5),
    ),
    "ernie4_5_moe": (
        "ernie4_5_moe",
        dict(moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_num_shared_experts=1, moe_layer_start_index=1),
    ),
    "hunyuan_v1_moe": (
        "hunyuan_v1_moe",
        dict(num_experts=4, moe_topk=2, moe_intermediate_size=32, use_qk_norm=True, head_dim=16),
    ),
    # A dense layer between MoE ones, a NoPE layer (the last: no rotary embedding, temperature-tuned queries) and
    # chunked attention in the others.
    "llama4_text": (
        "llama4_text",
        dict(
            num_local_experts=4,
            num_experts_per_tok=1,
            intermediate_size_mlp=96,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=3,
            attention_chunk_size=4,
            floor_scale=4,
            head_dim=16,
        ),
    ),
    # A dense first layer; q/k norms; shared experts added to the routed ones in fp32.
    "hy_v3": (
        "hy_v3",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            moe_intermediate_size=32,
            mlp_layer_types=["dense", "sparse", "sparse"],
            head_dim=16,
        ),
    ),
    # Attention sinks and windows, a dense first layer, a shared expert.
    "flint": (
        "flint",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            head_dim=16,
        ),
    ),
    "aria_text": ("aria_text", dict(moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1, head_dim=16)),
    # Windowed layers before a full one, q/k norms, a dense first layer, a shared expert, grouped routing.
    "exaone_moe": (
        "exaone_moe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            moe_intermediate_size=32,
            mlp_layer_types=["dense", "sparse", "sparse"],
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            sliding_window=4,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            head_dim=16,
        ),
    ),
    "dots1": (
        "dots1",
        dict(
            **DEEPSEEK_MOE,
            head_dim=16,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),
    ),
    # Multi-head latent attention over a dense first layer and MoE layers that route within groups.
    "deepseek_v2": (
        "deepseek_v2",
        dict(**DEEPSEEK_MOE, **MLA, num_key_value_heads=4, topk_method="group_limited_greedy"),
    ),
    "glm4_moe_lite": (
        "glm4_moe_lite",
        dict(**DEEPSEEK_MOE, **MLA, num_key_value_heads=4, mlp_layer_types=["dense", "sparse", "sparse"]),
    ),
    "axk1": ("axk1", dict(**DEEPSEEK_MOE, **MLA, num_key_value_heads=4, mlp_layer_types=["dense", "sparse", "sparse"])),
    # DeepSeek-V3.2's sparse attention: an indexer picks fewer keys than the prompts hold, from the causal mask.
    "deepseek_v32": ("deepseek_v32", DSA),
    # Dots 3 Note's text decoder: the same, and a windowed layer of latent attention of another shape.
    "dots3_note_text": (
        "dots3_note_text",
        dict(
            DSA,
            layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
            sliding_window=4,
            shared_experts_intermediate_size=32,
            swa_num_attention_heads=2,
            swa_num_key_value_heads=2,
            swa_q_lora_rank=24,
            swa_kv_lora_rank=8,
            swa_head_dim=24,
            swa_qk_nope_head_dim=16,
            swa_v_head_dim=8,
        ),
    ),
    # GLM-5: the same, whose `shared` layers reuse the keys the last indexer chose.
    "glm_moe_dsa": ("glm_moe_dsa", dict(DSA, indexer_types=["full", "shared", "shared"])),
    # The same, with norms that gate their output before attention and before the MoE.
    "axk2": ("axk2", dict(DSA, gated_norm_rank=8)),
    # OLMo 2's norms after each branch, q/k norms over all heads, MoE layers.
    "flex_olmo": ("flex_olmo", dict(num_experts=4, num_experts_per_tok=2)),
    "granitemoeshared": (
        "granitemoeshared",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=48,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=4.0,
        ),
    ),
    "hyperclovax": (
        "hyperclovax",
        dict(
            head_dim=16,
            use_post_norm=True,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=0.25,
        ),
    ),
    # Norms before and after each branch, gated attention with q/k norms, windowed layers before a full one, a dense
    # first layer, shared experts, muP's scaled embedding.
    "afmoe": (
        "afmoe",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            num_shared_experts=1,
            moe_intermediate_size=32,
            num_dense_layers=1,
            sliding_window=4,
            global_attn_every_n_layers=3,
            mup_enabled=True,
            head_dim=16,
        ),
    ),
    "qwen3_next": ("qwen3_next", dict(num_experts=4, shared_expert_intermediate_size=48, **GATED_DELTANET, **MOE)),
    "qwen3_5_text": ("qwen3_5_text", GATED_DELTANET),
    "qwen3_5_moe_text": (
        "qwen3_5_moe_text",
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
        | GATED_DELTANET,
    ),
    # GPT-2: learned positions added to the embeddings, LayerNorms with bias, `Conv1D` projections, attention scores
    # scaled down by the layer's index, dropouts on the embeddings, the attention and the branches.
    "gpt2": ("gpt2", dict(n_inner=96, scale_attn_by_inverse_layer_idx=True, activation_function="gelu_new")),
    # GPT-Neo: GPT-2's layout with global and windowed ("local") attention layers, the window inside the attention.
    # Four layers, the depth tests/test_pipeline.py splits, since the config's layer pattern fixes the depth.
    "gpt_neo": ("gpt_neo", dict(num_hidden_layers=4, attention_types=[[["global", "local"], 2]], window_size=4)),
    # GPT-BigCode: GPT-2's layout with multi-query attention.
    "gpt_bigcode": ("gpt_bigcode", dict(n_inner=96, multi_query=True)),
    # OPT: learned positions counted over the attention mask and offset by 2, biases, an MLP of the layer's own
    # `fc1` and `fc2`.
    "opt": ("opt", dict(ffn_dim=96, enable_bias=True, activation_function="gelu")),
    # BioGPT: OPT's layer, its positions counted from the cache's length, the embedding scaled by sqrt(hidden_size).
    "biogpt": ("biogpt", dict(scale_embedding=True)),
    # XGLM: OPT's layer, sinusoidal positions offset by 2, the embedding scaled by sqrt(d_model).
    "xglm": ("xglm", dict(ffn_dim=96, scale_embedding=True)),
    # MPT: ALiBi over `max_seq_len` positions, queries, keys and values clipped, its own softmax scale, an MLP that
    # adds the residual itself; the cache on, which MPT's config leaves off. (Its attention config types `attn_pdrop`
    # as an int, so no dropout can be set.)
    "mpt": ("mpt", dict(max_seq_len=256, use_cache=True, attn_config=dict(clip_qkv=0.5, softmax_scale=0.3))),
    # BLOOM: ALiBi counted over the padding mask, a LayerNorm on the embeddings, attention and residual dropouts, the
    # output projections summed over two tensor-parallel slices as it was pretrained (`slow_but_exact`).
    "bloom": (
        "bloom",
        dict(hidden_dropout=0.1, attention_dropout=0.1, pretraining_tp=2, slow_but_exact=True),
    ),
    # GPT-NeoX Japanese: attention and residual dropouts, the output projection's bias in the last layer, an MLP twice
    # as wide as the hidden states. Its rotary embedding spans whole heads: in Transformers 5.16 its own model fails
    # with a partial one (the embedding ignores `partial_rotary_factor`, which the attention applies).
    "gpt_neox_japanese": (
        "gpt_neox_japanese",
        dict(intermediate_multiple_size=2, hidden_dropout=0.1, attention_dropout=0.1),
    ),
    # KDA and latent attention; a dense first layer (the default `first_k_dense_replace`), then MoE with a shared
    # expert and grouped top-k routing.
    "kimi_linear": (
        "kimi_linear",
        dict(
            **KIMI_DELTA_ATTENTION,
            **MLA,
            num_key_value_heads=4,
            num_local_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_shared_experts=1,
            n_group=2,
            topk_group=1,
        ),
    ),
    "lfm2": ("lfm2", dict(**SHORT_CONVOLUTION, block_multiple_of=16)),
    # A dense first layer, then sigmoid routing with an expert bias.
    "lfm2_moe": (
        "lfm2_moe",
        dict(**SHORT_CONVOLUTION, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1),
    ),
    # A convolution, a windowed and a full attention layer (RoPE bases per type, partial in the full one), sandwich
    # norms and gated attention.
    "lfm3": (
        "lfm3",
        dict(
            layer_types=["conv", "sliding_attention", "full_attention"],
            sliding_window=4,
            head_dim=16,
            conv_L_cache=3,
            conv_bias=True,
        ),
    ),
    # Mamba 2 between attention layers with RoPE on, an MoE and the shared MLP beside it, Granite's multipliers.
    "granitemoehybrid": (
        "granitemoehybrid",
        dict(
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            position_embedding_type="rope",
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=48,
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_d_conv=3,
            mamba_chunk_size=8,
            mamba_proj_bias=True,
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=4.0,
        ),
    ),
    # Windowed and full layers with a different number of query heads each (RoPE bases per type, partial in the full
    # one), heads gated after attention, q/k norms, a dense first layer, then sigmoid routing with soft-capped logits
    # and a shared expert.
    "laguna": (
        "laguna",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            moe_routed_scaling_factor=2.5,
            moe_router_logit_softcapping=30.0,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            num_attention_heads_per_layer=[4, 8, 4],
            head_dim=16,
        ),
    ),
    # Windowed and full layers, q/k norms, a dense first layer.
    "mellum": (
        "mellum",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            mlp_layer_types=["dense", "sparse", "sparse"],
            head_dim=16,
        ),
    ),
    # LayerNorms, every layer windowed, biases on the attention and the LM head.
    "phimoe": (
        "phimoe",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=4, attention_bias=True, lm_head_bias=True),
    ),
    # Gated attention, a dense first layer, a shared expert, the top-k within the best of 2 groups.
    "minicpm5_moe": (
        "minicpm5_moe",
        dict(
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            mlp_layer_types=["dense", "sparse", "sparse"],
            n_group=2,
            topk_group=1,
            head_dim=16,
        ),
    ),
    # A full layer, then sparse ones whose indexer keeps 2 blocks of 2 keys (and the local one) per query group;
    # partial RoPE; a dense first layer; clamped SwiGLU experts beside a shared expert.
    "minimax_m3_vl_text": (
        "minimax_m3_vl_text",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            intermediate_size=32,
            dense_intermediate_size=96,
            shared_intermediate_size=48,
            mlp_layer_types=["dense", "sparse", "sparse"],
            layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
            rotary_dim=8,
            index_n_heads=2,
            index_head_dim=16,
            index_block_size=2,
            index_topk_blocks=2,
            head_dim=16,
        ),
    ),
    # GLM-4.5's model with biases on the queries, keys and values, which their checkpoints fuse (`query_key_value`).
    "param2moe": ("param2moe", dict(**DEEPSEEK_MOE, head_dim=16, attention_bias=True)),
    "sarvam_moe": ("sarvam_moe", dict(**DEEPSEEK_MOE, head_dim=16, attention_bias=True)),
    # DeepSeek-V3's model.
    "sarvam_mla": ("sarvam_mla", dict(**DEEPSEEK_MOE, **MLA, num_key_value_heads=4)),
    # Linear attention between latent-attention layers, a dense first layer, then grouped sigmoid routing and a shared
    # expert, both clamping their SwiGLU.
    "bailing_hybrid": (
        "bailing_hybrid",
        dict(
            num_local_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            first_k_dense_replace=1,
            n_group=2,
            topk_group=1,
            **MLA,
            num_key_value_heads=4,
            head_dim=16,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            short_conv_kernel_size=3,
            expert_swiglu_limit_list=[0, 2.0, 2.0],
            share_expert_swiglu_limit_list=[0, 2.0, 2.0],
        ),
    ),
    # Gated DeltaNet, a windowed layer with RoPE and a global NoPE one, each followed by the MoE with a shared expert.
    "lara_mini": (
        "lara_mini",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            head_dim=16,
            layer_types=["linear_attention", "sliding_attention", "full_attention"],
            sliding_window=4,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_conv_kernel_dim=3,
        ),
    ),
    # Gated DeltaNet with pre-norms between attention layers with OLMo 2's norms after each branch and q/k norms over
    # all heads; RoPE in the attention layers where the config sets a base, NoPE (as released) where it sets none.
    "olmo_hybrid": ("olmo_hybrid", OLMO_HYBRID),
    "olmo_hybrid-nope": ("olmo_hybrid", dict(OLMO_HYBRID, rope_parameters=dict(rope_type="default", rope_theta=None))),
    # A sparse NoPE layer whose indexer picks a pool of candidate keys, a windowed layer with RoPE, and a sparse layer
    # that picks its keys from that pool and reads the first layer's keys and values; GLM-4's norms; a dense first
    # layer, then MoE with a routing bias and a shared expert.
    "kolibri1_1": (
        "kolibri1_1",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            mlp_only_layers=[0],
            mlp_only_intermediate_size=96,
            head_dim=16,
            sliding_window=4,
            layer_types=["indexed_attention", "sliding_attention", "indexed_attention"],
            index_layers=[0],
            kv_source_layers=[0, 1, 0],
            index_topk=4,
            index_pool_size=8,
            index_compression=2,
            index_num_heads=2,
            index_num_local_tokens=2,
            index_num_sink_tokens=1,
        ),
    ),
    # A full NoPE layer, then windowed ones with RoPE bases of their own; attention sinks; the MoE and the shared MLP
    # beside it; Granite's multipliers.
    "granitemoe_swa": (
        "granitemoe_swa",
        dict(
            num_local_experts=4,
            num_experts_per_tok=2,
            shared_intermediate_size=48,
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            layer_rope_theta=[0, 10000.0, 500000.0],
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=4.0,
        ),
    ),
    # A full NoPE layer, then windowed ones with RoPE bases of their own; Granite's multipliers.
    "granite_swa": (
        "granite_swa",
        dict(
            sliding_window=4,
            layer_types=["full_attention", "sliding_attention", "sliding_attention"],
            layer_rope_theta=[0, 10000.0, 500000.0],
            embedding_multiplier=3.0,
            residual_multiplier=0.5,
            attention_multiplier=0.2,
            logits_scaling=4.0,
        ),
    ),
    "mamba": ("mamba", MAMBA),
    "mamba2": ("mamba2", MAMBA2),
    "falcon_mamba": ("falcon_mamba", MAMBA),
    # Each layer type once: Mamba 2, an MoE (sigmoid routing within groups, a latent projection around the experts, a
    # shared expert), a NoPE attention and a plain MLP.
    "nemotron_h": (
        "nemotron_h",
        dict(
            num_hidden_layers=4,
            layers_block_type=["linear_attention", "moe", "full_attention", "mlp"],
            head_dim=16,
            mamba_num_heads=4,
            mamba_head_dim=16,
            n_groups=2,
            ssm_state_size=16,
            conv_kernel=3,
            chunk_size=4,
            use_bias=True,
            mlp_bias=True,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_group=2,
            topk_group=1,
            moe_intermediate_size=32,
            moe_shared_expert_intermediate_size=48,
            moe_latent_size=32,
        ),
    ),
    # Mamba, attention (NoPE), Mamba; MoE in the Mamba layers, a dense MLP in the attention one.
    "jamba": (
        "jamba",
        dict(
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=0,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=16,
            mamba_d_conv=3,
            mamba_dt_rank=8,
            mamba_proj_bias=True,
        ),
    ),
    # Mamba 2, attention with half-rotary RoPE, Mamba 2; biases, and the z-loss on the logits.
    "bamba": (
        "bamba",
        dict(
            attn_layer_indices=[1],
            mamba_n_heads=4,
            mamba_d_head=32,
            mamba_d_state=16,
            mamba_d_conv=3,
            mamba_chunk_size=8,
            mamba_proj_bias=True,
            attention_bias=True,
            mlp_bias=True,
            z_loss_coefficient=0.1,
        ),
    ),
    # Mamba 2 (its gated norm on) beside attention in every layer, every muP multiplier away from 1, biases.
    "falcon_h1": (
        "falcon_h1",
        dict(
            mamba_d_ssm=None,
            mamba_n_heads=4,
            mamba_d_state=16,
            mamba_d_conv=3,
            mamba_chunk_size=8,
            mamba_rms_norm=True,
            mamba_proj_bias=True,
            projectors_bias=True,
            attention_bias=True,
            mlp_bias=True,
            embedding_multiplier=3.0,
            lm_head_multiplier=0.5,
            mlp_multipliers=[0.8, 1.2],
            key_multiplier=0.7,
            attention_in_multiplier=1.3,
            attention_out_multiplier=0.6,
            ssm_multipliers=[0.9, 1.1, 1.2, 0.8, 1.05],
            ssm_in_multiplier=1.1,
            ssm_out_multiplier=0.9,
        ),
    ),
    # A recurrent block, windowed attention with biases, a recurrent block; hidden 48, so that the embedding's scale,
    # sqrt(48) held in bf16, is rounded.
    "recurrent_gemma": (
        "recurrent_gemma",
        dict(
            hidden_size=48,
            block_types=["recurrent", "attention", "recurrent"],
            attention_window_size=4,
            conv1d_width=3,
            attention_bias=True,
        ),
    ),
    # Windows, and Llama 4's query scaling, which grows past every `original_max_position_embeddings` positions.
    "ministral3": (
        "ministral3",
        dict(
            head_dim=16,
            sliding_window=4,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=1000000.0,
                factor=32.0,
                original_max_position_embeddings=8,
                llama_4_scaling_beta=0.1,
            ),
        ),
    ),
    # Windowed and full layers, soft-capped attention and logits.
    "vaultgemma": (
        "vaultgemma",
        dict(sliding_window=4, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, **GEMMA),
    ),
    # MoE in every layer with a shared expert, grouped routing with a routing bias.
    "solar_open": (
        "solar_open",
        dict(
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=2,
            topk_group=1,
            head_dim=16,
        ),
    ),
    "youtu": ("youtu", dict(**MLA, num_key_value_heads=4)),
    # LayerNorms with biases, biases in attention and MLP, relu^2.
    "jais2": ("jais2", dict(head_dim=16, attention_bias=True, mlp_bias=True)),
    # Weightless norms (the final one on the embeddings too), q/k norms, relu^2, soft-capped logits.
    "nanochat": ("nanochat", dict(attention_bias=True, final_logit_softcapping=15.0)),
    # LayerNorms with a gain of 1 + w, partial rotary, biases.
    "nemotron": (
        "nemotron",
        dict(head_dim=16, partial_rotary_factor=0.5, attention_bias=True, mlp_bias=True),
    ),
    # Weightless LayerNorms, queries, keys and values clipped (below the tiny model's largest).
    "olmo": ("olmo", dict(clip_qkv=0.1, attention_bias=True)),
    # LayerNorms, q/k LayerNorms, partial rotary, a dropout after the MLP; multi-head attention.
    "persimmon": (
        "persimmon",
        dict(partial_rotary_factor=0.5, qk_layernorm=True, hidden_dropout=0.1, num_key_value_heads=4),
    ),
    # A full layer, then windowed ones with twice its key heads and attention sinks; RoPE bases and partial rotary
    # per type; smaller value heads; a dense first layer, then MoE with grouped routing and a routing bias.
    "mimo_v2_flash": (
        "mimo_v2_flash",
        dict(
            head_dim=16,
            v_head_dim=8,
            sliding_window=4,
            rope_parameters={
                "full_attention": dict(rope_type="default", rope_theta=5000000.0, partial_rotary_factor=0.5),
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
            },
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            n_group=2,
            topk_group=1,
        ),
    ),
    # GLM-4's norms after each branch, windowed and full layers, MoE in every layer with a shared expert.
    "kolibri1": (
        "kolibri1",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=48,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            head_dim=16,
        ),
    ),
    # A mixture of attention heads and an MoE, both routed; the final norm's eps, the config's, other than the layers'
    # norms' (their class's default).
    "jetmoe": (
        "jetmoe",
        dict(num_local_experts=4, num_experts_per_tok=2, kv_channels=16, rms_norm_eps=1e-5, aux_loss_coef=0.1),
    ),
    # Windowed, full and windowed layers, each branch through a short convolution; relative position biases over
    # fewer positions than the prompts, the full layer's queries scaled up past position 4; a dense layer, then MoE
    # with a shared expert; the LM head padded past the 128 tokens of its vocabulary.
    "inkling_text": (
        "inkling_text",
        dict(
            head_dim=16,
            swa_num_attention_heads=4,
            swa_num_key_value_heads=2,
            swa_head_dim=16,
            sliding_window_size=4,
            layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"],
            d_rel=4,
            rel_extent=8,
            log_scaling_n_floor=4,
            conv_kernel_size=3,
            mlp_layer_types=["dense", "sparse", "sparse"],
            moe_intermediate_size=32,
            n_routed_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            logits_mup_width_multiplier=4.0,
            vocab_size=136,
            unpadded_vocab_size=128,
        ),
    ),
    # Latent attention; the embedding scaled by `scale_emb`, each branch by scale_depth / sqrt(layers), the LM head's
    # input divided by hidden_size / dim_model_base.
    "minicpm3": (
        "minicpm3",
        dict(**MLA, num_key_value_heads=4, scale_emb=3.0, scale_depth=1.4, dim_model_base=16),
    ),
    # ModernBERT's decoder: the embedding's LayerNorm before the first layer (whose pre-norm is an identity), a full,
    # a windowed and a full layer with RoPE bases per type, biases on the norms, projections and LM head, dropouts on
    # the embedding, the attention and the MLP, a prediction head before the LM head.
    "modernbert-decoder": (
        "modernbert-decoder",
        dict(
            global_attn_every_n_layers=2,
            local_attention=8,
            norm_bias=True,
            attention_bias=True,
            mlp_bias=True,
            embedding_dropout=0.1,
            attention_dropout=0.1,
            mlp_dropout=0.1,
            rope_parameters={
                "full_attention": dict(rope_type="default", rope_theta=160000.0),
                "sliding_attention": dict(rope_type="default", rope_theta=10000.0),
            },
        ),
    ),
    # CTRL: the embedding scaled by sqrt(n_embd) plus sinusoidal positions, an attention called with its input three
    # times, dropouts on the embedding and after each branch, an LM head with a bias.
    "ctrl": ("ctrl", dict(n_embd=64, n_layer=3, n_head=4, dff=96, n_positions=256, resid_pdrop=0.1, embd_pdrop=0.1)),
    # DBRX: the attention between the LayerNorms of `norm_attn_norm`, its fused queries, keys and values clipped,
    # dropouts on the attention and after each branch; MoE in every layer, its settings in `ffn_config`. Its
    # attention reads a `rope_theta` from `attn_config`, which that config does not declare. `d_model` given by its
    # name: the config copies it into `ffn_config` before it sets the aliased `hidden_size`.
    "dbrx": (
        "dbrx",
        dict(
            d_model=64,
            resid_pdrop=0.1,
            attn_config=dict(kv_n_heads=2, clip_qkv=0.5, attn_pdrop=0.1, rope_theta=10000.0),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=4, moe_top_k=2, moe_loss_weight=0.05),
        ),
    ),
    # xLSTM: mLSTM blocks with biases on their norms and projections, its recurrent state in its own cache, chunks
    # shorter than the test prompts (its native kernel runs the state through them), gate and logit soft caps low
    # enough to bind.
    "xlstm": (
        "xlstm",
        dict(
            embedding_dim=64,
            num_heads=4,
            use_bias=True,
            chunk_size=4,
            # Its cache sizes the states by widths rounded up to a multiple of 64, its layers by the widths themselves:
            # with narrower queries its own model fails with a cache.
            qk_dim_factor=1.0,
            ffn_round_up_to_multiple_of=32,
            gate_soft_cap=5.0,
            output_logit_soft_cap=3.0,
        ),
    ),
}
# The families the installed Transformers has (InternLM3 from after 5.19).
CASES = {case: spec for case, spec in CASES.items() if spec[0] in FAMILIES}


def source_model(case: str, seed: int = 0, **overrides) -> PreTrainedModel:
    """The family's own `*ForCausalLM` for `case` (with `overrides` of its config), random, in fp32, with every norm
    gain perturbed."""
    model_type, fields = CASES[case]
    config = FAMILIES[model_type].config_class(**{**COMMON, **fields, **overrides})
    torch.manual_seed(seed)
    # The family's own class: `AutoModelForCausalLM` does not map every family's config (Emu3's text config).
    model = FAMILIES[model_type].causal_lm_class._from_config(config, dtype=torch.float32).eval()
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
