"""Which source checkpoints convert, how their configs map onto `AttnResConfig`, and how their tensors are named.

A checkpoint converts exactly when its residual stream is a plain sum of its sublayers' outputs, `h + g(h)` with any
norms inside `g`, because then the AttnRes model with zero pseudo-queries computes the same function
(docs/design.md §5). Every family in `attnres/families.py` is such a decoder, and the AttnRes model is built from the
family's own modules, so its config maps field by field and its tensors keep their names. True post-norm
(`norm(h + f(h))`), parallel residuals, streams scaled or mixed rather than summed, encoders and the decoders of
encoder-decoders break the identity (or are no decoder family) and are refused with the reason.
"""

import re
from collections.abc import Iterator

import torch
from transformers import PreTrainedConfig
from transformers.conversion_mapping import get_checkpoint_conversion_mapping
from transformers.core_model_loading import Concatenate, WeightConverter, WeightRenaming

from ..configuration_attnres import AttnResConfig
from ..families import FAMILIES, Family
from ..modeling_attnres import AttnResForCausalLM


try:
    from transformers.core_model_loading import Split
except ImportError:  # Transformers 5.16, whose conversion mappings split no tensor
    Split = None


class ConversionError(ValueError):
    """The source cannot be converted (unsupported architecture, malformed checkpoint, unsafe paths...)."""


# The architectures a source may declare: its family's (InternLM3 runs, and Transformers saves, `LlamaForCausalLM`).
SUPPORTED_ARCHITECTURES = tuple(dict.fromkeys(family.architecture for family in FAMILIES.values()))

# Model types whose residual layout has no exact AttnRes counterpart, with the reason given to the user; keyed by
# model type so that every head of a family (BertForMaskedLM as much as BertLMHeadModel) gets the reason.
_POST_NORM = (
    "true post-norm sublayers, norm(h + f(h)): the norm is applied to the residual stream itself, so the stream is "
    "not a plain sum of the sublayers' outputs"
)
# BLOOM's `apply_residual_connection_post_layernorm=True` (BloomBlock.forward: `residual = layernorm_output` before
# each sublayer's add).
_NORMED_RESIDUAL = (
    "a normed residual, norm(h) + f(norm(h)) (apply_residual_connection_post_layernorm=True): each sublayer adds to "
    "the normed stream, so the stream is not a plain sum of the sublayers' outputs"
)
_PARALLEL = (
    "a parallel residual, h + attn(h) + mlp(h): attention and MLP read the same input, so there is no sublayer order "
    "to attend over"
)
_HYPER_CONNECTIONS = (
    "hyper-connections, several residual streams mixed by learned, input-dependent matrices around each layer: the "
    "stream is not a plain sum of the sublayers' outputs"
)
_ALTUP = (
    "AltUp, several residual streams that each layer predicts and corrects with learned coefficients: the stream is "
    "not a plain sum of the sublayers' outputs"
)
_STREAM_SCALE = (
    "a learned per-channel scale or gate on the whole stream, s * h + f(h): the stream is not a plain sum of the "
    "sublayers' outputs"
)
_DEPTH_SCALED = (
    "a stream rescaled at every residual add, sqrt((i - 1) / i) * h + f(h) / sqrt(i): the stream is not a plain sum "
    "of the sublayers' outputs"
)
# `RwkvModel.forward` in inference: `hidden_states / 2` after every `rescale_every`-th block, whose output weights
# `_rescale_layers` divides by 2 ** (i // rescale_every) to match.
_HALVED_STREAM = (
    "a stream halved every `rescale_every` layers in inference, h <- (h + f(h)) / 2, the layers' output weights "
    "divided by 2**(i // rescale_every) to match (on by default and in RWKV's checkpoints; without it the layers still "
    "thread a per-layer state list through both sublayers, not a cache): the stream is not a plain sum of the "
    "sublayers' outputs"
)
_REVERSIBLE = (
    "reversible residual layers, two streams that each add the other's sublayer, Y1 = X1 + attn(X2) and "
    "Y2 = X2 + ffn(Y1), concatenated at the end: there is no single residual stream"
)
_HIERARCHICAL_RECURRENCE = (
    "a hierarchical recurrence, two layer stacks run in cycles over a slow and a fast stream, each stack's output "
    "normalised as a whole and added into the other stack's input: the stream is not a plain sum of the sublayers' "
    "outputs"
)
_OWN_DEPTH_ATTENTION = (
    "its own block attention residuals: each layer's attention and MLP read a learned attention over a bank of "
    "earlier block states (`attention_input(block_states, hidden_states)`), not the residual stream; already a "
    "depth-attention model, not a residual-sum decoder"
)
_SHARED_BLOCK_INTO_MAMBA = (
    "Mamba layers with a shared attention block: the block (tied across layers, no residual adds of its own) reads "
    "the stream concatenated with the original embeddings, and its projected output is added to the next Mamba "
    "layer's input, not to the stream: no decoder of attention and MLP sublayers"
)
_ENCODER = (
    "an encoder's layers (BERT-style, bidirectional unless is_decoder=True): an encoder, not a decoder family"
)
_ENCODER_DECODER = (
    "the decoder of an encoder-decoder model, whose layers cross-attend to the encoder: not a decoder-only family"
)
_LAYER_SCALAR = (
    "a per-layer scalar on the whole stream: h <- s_i * (h + attn(h) + mlp(h)) at the end of each layer "
    "(`layer_scalar`, a buffer the checkpoint sets), so the stream is not a plain sum of the sublayers' outputs"
)
_GEMMA4_MULTIMODAL = (
    "a multimodal model: image and audio inputs embedded beside a Gemma 4 text decoder, which is refused too: it "
    "multiplies the whole stream by a per-layer scalar (`layer_scalar`) at the end of each layer"
)
_CROSS_ATTENTION_LAYERS = (
    "gated cross-attention layers among the text decoder's layers: h + tanh(g) * cross_attn(h, image states) at the "
    "`cross_attention_layers`, which read the vision encoder's states and are skipped without an image; a "
    "vision-language decoder, not a decoder-only family"
)


def _multimodal(inputs: str, text_family: str, text_architecture: str) -> str:
    """A model whose causal-LM class holds other modalities' encoders beside a text decoder that the family table has:
    the whole model has no counterpart, its text decoder converts alone."""
    return (
        f"a multimodal model: {inputs} beside a `{text_family}` text decoder, which converts alone: save the language "
        f"model with the LM head as a {text_architecture} checkpoint and convert that"
    )


# Each entry read off the family's modeling code in Transformers 5.25 (its decoder layer's forward; for multimodal
# models, the `*Model` that holds the encoders and the text decoder).
REFUSED_MODEL_TYPES = {
    **dict.fromkeys(
        (
            "bert",
            "roberta",
            "xlm-roberta",
            "distilbert",
            "electra",
            "camembert",
            "data2vec-text",
            "ernie",
            "roc_bert",
            "roformer",
            "rembert",
            "xmod",
            "big_bird",
            "bert-generation",
            "git",
            "openai-gpt",
            "xlnet",
            "xlm",
        ),
        _POST_NORM,
    ),
    **dict.fromkeys(
        ("gpt_neox", "gptj", "phi", "cohere", "cohere2", "cohere2_moe", "cohere_compass_text", "codegen"), _PARALLEL
    ),
    **dict.fromkeys(("deepseek_v4", "hy_v4"), _HYPER_CONNECTIONS),
    **dict.fromkeys(("gemma3n", "gemma3n_text"), _ALTUP),
    **dict.fromkeys(("doge", "ergo", "zaya"), _STREAM_SCALE),
    "beam": _DEPTH_SCALED,
    "rwkv": _HALVED_STREAM,
    "reformer": _REVERSIBLE,
    # HrmTextModel.forward: `L_module(z_L + z_H)` L_cycles times, then `z_H = H_module(z_H + z_L)`, H_cycles times;
    # HrmTextStack.forward ends in `final_norm(hidden_states)`.
    "hrm_text": _HIERARCHICAL_RECURRENCE,
    **dict.fromkeys(("megatron-bert", "roberta-prelayernorm", "xlm-roberta-xl"), _ENCODER),
    **dict.fromkeys(
        (
            "bart",
            "mbart",
            "blenderbot",
            "blenderbot-small",
            "marian",
            "pegasus",
            "plbart",
            "mvp",
            "bigbird_pegasus",
            "prophetnet",
            "trocr",
            "whisper",
            "musicgen",
            "musicgen_melody",
        ),
        _ENCODER_DECODER,
    ),
    # `Inkling2SlidingDecoderLayer.forward` and `Inkling2FullDecoderLayer.forward` (and their loop layers') take
    # `block_states` and compute each sublayer's input as `self.attention_input(block_states, hidden_states)` and
    # `self.mlp_input(block_states, hidden_states)`; the model ends in `final_input(block_states, hidden_states)`.
    **dict.fromkeys(("inkling2_text", "inkling2_loop_text"), _OWN_DEPTH_ATTENTION),
    # `ZambaHybridLayer.forward` and `Zamba2HybridLayer.forward`: `shared_transf(concatenate([hidden_states,
    # original_hidden_states]))` then `linear`, passed as `transformer_hidden_states`, which the Mamba layer adds to
    # its input before its norm, after taking `residual = hidden_states`.
    **dict.fromkeys(("zamba", "zamba2"), _SHARED_BLOCK_INTO_MAMBA),
    # `LongcatFlashDecoderLayer.forward`: `shortcut_mlp_output = self.mlp(hidden_states)` beside `mlps[0]`, added in
    # `residual + hidden_states + shortcut_mlp_output` after `self_attn[1]` and `mlps[1]`.
    "longcat_flash": (
        "a shortcut MoE: it reads the first MLP's input and its output joins the stream only after the layer's second "
        "attention and MLP, which read a stream without it: the stream is not a sum of outputs of sublayers in order"
    ),
    # `MiniMaxDecoderLayer.forward`: `hidden_states = self.input_layernorm(hidden_states); residual = hidden_states`,
    # then `residual * self.attn_alpha_factor + hidden_states * self.attn_beta_factor`, the same around the MoE.
    "minimax": (
        "a normed, scaled residual, alpha * norm(h) + beta * f(norm(h)): each sublayer adds to the normed stream "
        "scaled by alpha, so the stream is not a plain sum of the sublayers' outputs"
    ),
    # `Gemma4TextDecoderLayer.forward` and `Gemma4UnifiedTextDecoderLayer.forward` end with
    # `hidden_states *= self.layer_scalar`, after both residual adds (and Gemma 4's per-layer-input branch).
    **dict.fromkeys(("gemma4_text", "gemma4_unified_text"), _LAYER_SCALAR),
    # `Gemma4Model` holds a vision and an audio tower beside the text model, `Gemma4UnifiedModel` patch and waveform
    # embedders; both text models are the layer-scaled decoders above.
    **dict.fromkeys(("gemma4", "gemma4_unified"), _GEMMA4_MULTIMODAL),
    # `Gemma4UnifiedAssistantForCausalLM.forward` takes no token ids: it projects the target model's hidden states
    # (`pre_projection`), and its config makes every layer reuse the target's keys and values (`num_kv_shared_layers`).
    # `Gemma4AssistantForCausalLM.forward` raises without `inputs_embeds` (the target's states, projected by
    # `pre_projection`) and `shared_kv_states`, and runs them through a Gemma 4 text model.
    **dict.fromkeys(
        ("gemma4_assistant", "gemma4_unified_assistant"),
        (
            "a drafter for Gemma 4's assisted decoding: it reads the target model's hidden states and attends to the "
            "target's keys and values, through Gemma 4 layers that multiply the whole stream by a per-layer scalar: "
            "not a standalone decoder"
        ),
    ),
    # `DoryDecoderLayer.forward`: `hidden_states = self.input_layernorm(hidden_states)` (an L2 norm), then
    # `hidden_states + attention_rate * (attn_output - hidden_states)` with `attn_output` L2-normed, the same around
    # the MLP; `DoryModel` runs its middle layers `n_recurrent_loops` times.
    "dory": (
        "a stream on the unit sphere (nGPT): each sublayer moves the normalised stream towards its own normalised "
        "output at a learned per-channel rate, h <- n(h) + a * (n(f(n(h))) - n(h)), and the middle layers run in "
        "loops: the stream is not a plain sum of the sublayers' outputs"
    ),
    # `Qwen4ExpTextDecoderLayer.forward`: `attn_hyper_connection(hidden_states)` mixes `hc_count` streams into the
    # sublayer's input, and `hyper_input + (output * injection_weights).flatten(-2)` injects its output into each
    # stream with a weight of its own; the multimodal model's text decoder is the same.
    **dict.fromkeys(("qwen4_exp", "qwen4_exp_text"), _HYPER_CONNECTIONS),
    # `MllamaTextModel` builds `MllamaCrossAttentionDecoderLayer` at the `cross_attention_layers` indices, residuals
    # gated by `cross_attn_attn_gate.tanh()` and `cross_attn_mlp_gate.tanh()`, skipped when no image states are given.
    **dict.fromkeys(("mllama", "mllama_text_model"), _CROSS_ATTENTION_LAYERS),
    # `MoshiForConditionalGeneration` (the checkpoints' class) holds the audio codec, the temporal transformer that
    # `MoshiForCausalLM` is, fed the sum of the text and audio-codebook embeddings, and `MoshiDepthDecoder`.
    "moshi": (
        "a speech-text model with a depth decoder (Moshi): a temporal transformer over the sum of the text and "
        "audio-codebook embeddings, and a depth decoder that predicts each step's audio codebooks from its output; "
        "MoshiForCausalLM is the temporal transformer with its text head alone, not a text decoder family"
    ),
    # `BltModel` holds `BltLocalEncoder`, `BltGlobalTransformer`, `BltLocalDecoder` and `BltPatcher`, the decoder's
    # layers cross-attending to the patch states.
    "blt": (
        "a byte-level hierarchy (Byte Latent Transformer): a local encoder over bytes and hash n-gram embeddings, a "
        "global transformer over the patches an entropy model cuts, and a local decoder that cross-attends to the "
        "patch states: no single decoder stack"
    ),
    # `CpmAntModel.forward` marks every token as context (`context = torch.full((batch, seq_length), 1)`), so
    # `_prepare_attention_mask` (`context[:, None, :] | ...`) lets every unpadded token attend to every other; it
    # prepends `prompt_length` prompt tokens and adds segment embeddings and a segment-relative bucketed position bias.
    "cpmant": (
        "bidirectional attention over the whole input, after prompt embeddings it prepends: every token is `context` "
        "in its mask, so the logits at a position read the tokens after it: no causal decoder"
    ),
    # Multimodal models (the encoders in each `*Model.__init__`) whose text decoder is a family of the table.
    "gemma3": _multimodal("a SigLIP vision tower and a projector", "gemma3_text", "Gemma3ForCausalLM"),
    "llama4": _multimodal("a vision encoder and a projector", "llama4_text", "Llama4ForCausalLM"),
    "qwen3_5": _multimodal("a vision encoder", "qwen3_5_text", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": _multimodal("a vision encoder", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"),
    "emu3": _multimodal("a VQ-VAE image tokenizer", "emu3_text_model", "Emu3ForCausalLM"),
    "dots3_note": _multimodal("a vision and an audio encoder", "dots3_note_text", "Dots3NoteForCausalLM"),
    "got_ocr2": _multimodal("a SAM vision encoder and a projector", "qwen2", "Qwen2ForCausalLM"),
    "moss_transcribe_diarize": _multimodal("an audio encoder and a projector", "qwen3", "Qwen3ForCausalLM"),
    # `Phi4MultimodalModel.embed_tokens_extend` embeds images and audio; its decoder layers are Phi-3's, under
    # Phi-3's names.
    "phi4_multimodal": _multimodal(
        "image and audio embedders in its embedding layer", "phi3", "Phi3ForCausalLM"
    ),
    # `FuyuModel` projects image patches (`vision_embed_tokens`) into the embeddings of its `text_config` model.
    "fuyu": _multimodal("a projection of image patches into its embeddings", "persimmon", "PersimmonForCausalLM"),
}
# Config fields that are not part of a family's model: `AttnResConfig` sets its own.
_NOT_COPIED = ("model_type", "architectures", "auto_map", "transformers_version", "_name_or_path")


def _supported_list() -> str:
    return ", ".join(SUPPORTED_ARCHITECTURES)


def source_architecture(config: PreTrainedConfig) -> Family:
    """The family `config` declares, or a `ConversionError` that names what was found and why it does not convert."""
    architectures = list(getattr(config, "architectures", None) or [])
    if len(architectures) != 1:
        raise ConversionError(
            f"The source config declares architectures={architectures!r}; exactly one is needed to know how to "
            f"convert it. Supported: {_supported_list()}."
        )
    name = architectures[0]
    if getattr(config, "use_parallel_residual", False) or getattr(config, "parallel_attn", False):
        raise ConversionError(f"{name} uses {_PARALLEL}; AttnRes conversion is exact only for residual-sum decoders.")
    if getattr(config, "apply_residual_connection_post_layernorm", False):
        reason = _NORMED_RESIDUAL
        raise ConversionError(f"{name} uses {reason}; AttnRes conversion is exact only for residual-sum decoders.")
    if config.model_type in REFUSED_MODEL_TYPES or getattr(config, "do_layer_norm_before", True) is False:
        reason = REFUSED_MODEL_TYPES.get(config.model_type, _POST_NORM)
        raise ConversionError(f"{name} uses {reason}; AttnRes conversion is exact only for residual-sum decoders.")
    family = FAMILIES.get(config.model_type)
    if family is None or family.architecture != name:
        raise ConversionError(
            f"Unsupported architecture {name} (model_type {config.model_type!r}): attnres/families.py has no row "
            f"for it. Supported: {_supported_list()}."
        )
    if getattr(config, "use_bidirectional_attention", False):
        raise ConversionError(f"{name} has use_bidirectional_attention=True: an encoder, not a causal decoder.")
    return family


def block_size_rule(family: Family | None = None, sublayers: int | None = None) -> str:
    """What a conversion's block size may be: at most the source's number of sublayers, in terms of the config as the
    family counts them (`Family.num_sublayers_formula`; before the config is read, as a layer of a mixer and an MLP
    counts them), and `sublayers`, the number, once its config is read."""
    formula = family.num_sublayers_formula if family is not None else "2 * num_hidden_layers"
    bound = formula + (f" = {sublayers}" if sublayers is not None else "")
    return f"an integer from 1 to {bound}, the source's number of sublayers"


def attnres_config(
    source: PreTrainedConfig,
    *,
    mode: str,
    block_size: int | None,
    exact_retrofit: bool,
) -> AttnResConfig:
    """The `AttnResConfig` computing what `source` computes (every field of its family copied verbatim) with the
    chosen residual."""
    family = source_architecture(source)
    sublayers = family.layer_offsets(source)[-1]
    if block_size is not None and not 1 <= block_size <= sublayers:
        raise ConversionError(f"block_size={block_size!r}: must be {block_size_rule(family, sublayers)}")
    fields = {name: value for name, value in source.to_dict().items() if name not in _NOT_COPIED}
    return AttnResConfig(
        **fields,
        family=family.model_type,
        residual_mode=mode,
        block_size=block_size,
        exact_retrofit=exact_retrofit,
        architectures=["AttnResForCausalLM"],
    )


# Tensors some checkpoints carry that are recomputed from the config, not learned: rotary frequencies, and the causal
# masks that GPT-2's and GPT-Neo's older checkpoints hold under their attention (`attn.bias`, `attn.masked_bias`).
_DERIVED_BUFFER = re.compile(r"\.rotary_emb\.inv_freq$|\.attn(\.attention)?\.(bias|masked_bias)$")
# The per-expert layout MoE checkpoints are stored in (and Transformers saves most of them in), once the family's
# renamings have run: Mixtral's `w1` (gate), `w3` (up) and `w2` (down), Qwen's and DeepSeek's `gate_proj`, `up_proj`
# and `down_proj`, under the family's MoE module.
_PER_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.[\w.]+)\.experts\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$"
)
_EXPERT_PART = {"w1": "gate", "gate_proj": "gate", "w3": "up", "up_proj": "up", "w2": "down", "down_proj": "down"}


def checkpoint_renamings(model_type: str) -> list[WeightRenaming]:
    """The renamings Transformers applies to a checkpoint of the family as it loads one, from the family's conversion
    mapping (Mixtral's and MiniMax-M2's `block_sparse_moe` to `mlp`, Granite MoE's `input_linear` to
    `experts.gate_up_proj`, Ernie 4.5 MoE's `moe_statics` into the router). Transformers hands out a copy, since its
    objects record their use."""
    mapping = get_checkpoint_conversion_mapping(model_type) or []
    return [transform for transform in mapping if isinstance(transform, WeightRenaming)]


def checkpoint_concatenations(model_type: str) -> list[tuple[list[str], str, int]]:
    """The tensors Transformers concatenates into one as it loads a checkpoint of the family, from its conversion
    mapping: each as the patterns of the parts in order, the pattern of the whole and the dimension (Kimi Linear's
    `q_conv1d`, `k_conv1d` and `v_conv1d` into one `conv1d`). Per-expert tensors are fused by `TensorRenamer`."""
    return [
        (list(transform.source_patterns), transform.target_patterns[0], transform.operations[0].dim)
        for transform in get_checkpoint_conversion_mapping(model_type) or []
        if isinstance(transform, WeightConverter)
        and len(transform.operations) == 1
        and type(transform.operations[0]) is Concatenate
        and len(transform.target_patterns) == 1
    ]


def checkpoint_splits(model_type: str) -> list[tuple[str, list[str], int]]:
    """The tensors Transformers splits into several as it loads a checkpoint of the family, from its conversion
    mapping: each as the pattern of the whole, the patterns of the parts in order and the dimension (Sarvam-30B's and
    Param2's fused `query_key_value` into `q_proj`, `k_proj` and `v_proj`). Each part is as long as the model's
    parameter it becomes, as Transformers' `Split` cuts it."""
    return [
        (transform.source_patterns[0], list(transform.target_patterns), transform.operations[0].dim)
        for transform in get_checkpoint_conversion_mapping(model_type) or []
        if isinstance(transform, WeightConverter)
        and len(transform.operations) == 1
        and type(transform.operations[0]) is Split
        and len(transform.source_patterns) == 1
    ]


class TensorRenamer:
    """Streams source tensors into AttnRes names, shard by shard.

    Tensors keep the family's names, as Transformers renames them when it loads a checkpoint of the family. MoE
    checkpoints in the per-expert layout are fused into the stacked `experts.gate_up_proj` / `experts.down_proj`
    tensors that the family's experts module holds (as Transformers' conversion mapping stacks them); a layer's experts
    may span shards, so they wait in a buffer until the layer's last expert tensor arrives. Tensors that the family's
    mapping concatenates (`checkpoint_concatenations`) wait the same way for their last part; those it splits
    (`checkpoint_splits`) are cut at the sizes of the model's parameters.
    """

    def __init__(self, config: AttnResConfig):
        family = FAMILIES[config.family]
        moe = family.moe
        self.num_experts = family.config_value(config, moe.experts) if moe else 0
        self.expert_parts = ("gate", "up", "down") if moe is None or moe.gated_experts else ("up", "down")
        self.tied = getattr(config, "tie_word_embeddings", False)  # as Transformers reads it: Inkling's has no field
        self.renamings = checkpoint_renamings(config.family)
        self.family_renamings = [
            (re.compile(pattern), replacement) for pattern, replacement in FAMILIES[config.family].checkpoint_renamings
        ]
        self.concatenations = checkpoint_concatenations(config.family)
        self.splits = checkpoint_splits(config.family)
        self.shapes: dict[str, torch.Size] = {}
        if self.splits:
            with torch.device("meta"):
                self.shapes = {name: tensor.shape for name, tensor in AttnResForCausalLM(config).state_dict().items()}
        self._pending: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
        self._parts: dict[str, dict[int, torch.Tensor]] = {}

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        for renaming in self.renamings:
            name, _ = renaming.rename_source_key(name)
        for pattern, replacement in self.family_renamings:
            name = pattern.sub(replacement, name)
        if _DERIVED_BUFFER.search(name) or (self.tied and name == "lm_head.weight"):
            return
        for parts, whole, dim in self.concatenations:
            for index, pattern in enumerate(parts):
                if (match := re.search(pattern, name)) is None:
                    continue
                fused = name[: match.start()] + whole + name[match.end() :]
                pending = self._parts.setdefault(fused, {})
                pending[index] = tensor
                if len(pending) == len(parts):
                    del self._parts[fused]
                    yield fused, torch.cat([pending[i] for i in range(len(parts))], dim=dim)
                return
        for whole, parts, dim in self.splits:
            if (match := re.search(whole, name)) is None:
                continue
            names = [name[: match.start()] + part + name[match.end() :] for part in parts]
            if any(part not in self.shapes for part in names):
                break  # not the model's: the size check refuses it
            yield from zip(names, torch.split(tensor, [self.shapes[part][dim] for part in names], dim=dim))
            return
        expert = _PER_EXPERT.match(name)
        if expert is None:
            yield name, tensor
            return
        module, index, kind = expert.group(1), int(expert.group(2)), _EXPERT_PART[expert.group(3)]
        if not 0 <= index < self.num_experts:
            raise ConversionError(f"{name}: expert {index} does not exist (the config has {self.num_experts} experts).")
        pending = self._pending.setdefault(module, {})
        pending[kind, index] = tensor
        if len(pending) == len(self.expert_parts) * self.num_experts:
            del self._pending[module]
            experts = range(self.num_experts)
            stacked = {part: torch.stack([pending[part, e] for e in experts]) for part in self.expert_parts}
            if "gate" in stacked:
                yield f"{module}.experts.gate_up_proj", torch.cat([stacked["gate"], stacked["up"]], dim=1)
            else:  # experts without a gate (Nemotron-H's)
                yield f"{module}.experts.up_proj", stacked["up"]
            yield f"{module}.experts.down_proj", stacked["down"]

    def finish(self) -> None:
        """Fail if some layer's experts, or some concatenated tensor, never completed (a truncated or inconsistent
        checkpoint)."""
        if self._parts:
            name, parts = next(iter(self._parts.items()))
            raise ConversionError(f"{name}: only {len(parts)} of its parts were found in the checkpoint.")
        if self._pending:
            module, tensors = next(iter(self._pending.items()))
            parts = ", ".join(self.expert_parts[:-1]) + f" and {self.expert_parts[-1]}"
            raise ConversionError(
                f"{module}: only {len(tensors)} of {len(self.expert_parts) * self.num_experts} expert tensors ({parts} "
                "per expert) were found in the checkpoint."
            )


def is_depth_parameter(name: str) -> bool:
    """The parameters AttnRes adds: a pseudo-query and a key-norm gain per depth-mixing module."""
    return bool(re.search(r"_residual\.query\.(pseudo_query|key_norm_weight)$", name))


def initial_depth_parameter(name: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Zero pseudo-queries (uniform depth attention: the retrofit identity) and unit key-norm gains."""
    if name.endswith("pseudo_query"):
        return torch.zeros(shape, dtype=dtype)
    return torch.ones(shape, dtype=dtype)
