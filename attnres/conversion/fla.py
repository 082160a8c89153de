"""FLA's AttnRes models (flash-linear-attention's `TransformerForCausalLM` with `attnres_block_size`) in and out.

FLA's Transformer is Llama's layout under other names, and its attention residuals are this package's: the same
sources (the embedding, the completed blocks, the block's partial sum), keys RMS-normalised with a gain, one
pseudo-query per step (`*_res_proj`, `[1, D]`), a softmax over depth and the pre-norm applied to the result. Its block
size also counts sublayers. So a checkpoint maps onto `AttnResForCausalLM` by renaming alone, in both directions;
the table is `fla_names` and docs/conversion.md. What FLA's model can have and this one cannot (softmax attention in
only some layers, `qk_norm`, another activation) is refused, and so is what this model can have and FLA's cannot
(blocks that split a layer, MoE, the comparison residuals, an exact retrofit's output scales, biases outside q/k/v).
"""

import importlib.util
import math
from collections.abc import Iterator, Mapping

import torch

from ..configuration_attnres import AttnResConfig
from ..families import layer_types
from .architectures import ConversionError


FLA_MODEL_TYPE = "transformer"
FLA_ARCHITECTURE = "TransformerForCausalLM"
# The families whose decoder FLA's Transformer computes: Llama's, with a window (Mistral) or q/k/v biases (Qwen2).
FLA_FAMILIES = ("llama", "mistral", "qwen2")
# The config field only FLA's AttnRes families have: a config with it is read as FLA's.
FLA_BLOCK_FIELD = "attnres_block_size"
_FLA_ACTIVATIONS = ("swish", "silu")
# What a conversion's or an export's report says when FLA is not there to verify against.
FLA_NOT_IMPORTABLE = (
    "FLA (flash-linear-attention) is not importable here, so only the weights were mapped; install it to verify "
    "against FLA's own forward"
)


def is_fla_config(config: Mapping) -> bool:
    """Whether a raw `config.json` is one of FLA's AttnRes models."""
    return FLA_BLOCK_FIELD in config


def _refuse(field: str, value, allowed: str) -> ConversionError:
    return ConversionError(f"FLA config {field}={value!r}: {allowed}")


def fla_intermediate_size(config: Mapping) -> int:
    """FLA's MLP width: `intermediate_size`, or (when null) 2/3 of `hidden_ratio` (default 4) times the hidden size,
    rounded up to a multiple of 256, as FLA's `GatedMLP` computes it."""
    if config.get("intermediate_size") is not None:
        return config["intermediate_size"]
    width = int(config["hidden_size"] * (config.get("hidden_ratio") or 4) * 2 / 3)
    return 256 * math.ceil(width / 256)


def attnres_config_from_fla(config: Mapping) -> AttnResConfig:
    """The `AttnResConfig` computing what FLA's model of `config` (its `config.json`) computes."""
    model_type = config.get("model_type")
    if model_type != FLA_MODEL_TYPE:
        raise _refuse(
            "model_type",
            model_type,
            f"only FLA's {FLA_MODEL_TYPE!r} family (softmax attention and a gated MLP in every layer) maps onto "
            "AttnRes; the others mix in linear, sparse or latent attention",
        )
    block_size = config.get(FLA_BLOCK_FIELD)
    if block_size is None:
        raise _refuse(FLA_BLOCK_FIELD, None, "the model has no attention residuals; convert it as a Llama instead")
    if not isinstance(block_size, int) or block_size < 1 or (block_size > 1 and block_size % 2):
        raise _refuse(FLA_BLOCK_FIELD, block_size, "must be 1 (Full AttnRes) or an even number of sublayers")
    if config.get("qk_norm"):
        raise _refuse("qk_norm", True, "this model has no query/key norms (only qk_norm=false converts)")
    if config.get("hidden_act", "swish") not in _FLA_ACTIVATIONS:
        raise _refuse("hidden_act", config["hidden_act"], "only 'swish' (SiLU, Llama's SwiGLU) converts")
    if config.get("attn") is not None:
        raise _refuse("attn", config["attn"], "a hybrid's attention layers have no Llama counterpart")
    hidden_size, num_heads = config["hidden_size"], config["num_heads"]
    if hidden_size % num_heads:
        raise _refuse("num_heads", num_heads, f"must divide hidden_size={hidden_size}")
    rope_theta = config.get("rope_theta", 10000.0)
    # FLA's Transformer is Llama's decoder with a bias on q, k and v (Qwen2's attention) or a window in every layer
    # (Mistral's); its head_dim is hidden_size / num_heads, as each of these families derives it.
    window = config.get("window_size")
    if config.get("qkv_bias", False):
        family = dict(family="qwen2", use_sliding_window=window is not None, sliding_window=window, max_window_layers=0)
    elif window is not None:
        family = dict(family="mistral", sliding_window=window)
    else:
        family = dict(family="llama")
    return AttnResConfig(
        **family,
        vocab_size=config["vocab_size"],
        hidden_size=hidden_size,
        intermediate_size=fla_intermediate_size(config),
        num_hidden_layers=config["num_hidden_layers"],
        num_attention_heads=num_heads,
        num_key_value_heads=config.get("num_kv_heads") or num_heads,
        hidden_act="silu",
        max_position_embeddings=config.get("max_position_embeddings", 2048),
        initializer_range=config.get("initializer_range", 0.02),
        rms_norm_eps=config.get("norm_eps", 1e-6),
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        use_cache=config.get("use_cache", True),
        pad_token_id=config.get("pad_token_id"),
        bos_token_id=config.get("bos_token_id"),
        eos_token_id=config.get("eos_token_id"),
        residual_mode="full" if block_size == 1 else "block",
        block_size=None if block_size == 1 else block_size,
        exact_retrofit=False,
        architectures=["AttnResForCausalLM"],
    )


def fla_conversion_config(config: Mapping, mode: str | None, block_size: int | None) -> AttnResConfig:
    """`attnres_config_from_fla`, refusing a `mode` or `block_size` other than the checkpoint's own: an FLA model was
    trained with its residual, which converting keeps."""
    target = attnres_config_from_fla(config)
    if mode is not None and mode != target.residual_mode:
        raise ConversionError(
            f"mode={mode!r}: an FLA checkpoint keeps its own residual, {target.residual_mode!r} "
            f"({FLA_BLOCK_FIELD}={config[FLA_BLOCK_FIELD]}); leave --mode out"
        )
    if block_size is not None and block_size != target.depth_block_size:
        raise ConversionError(
            f"block_size={block_size!r}: an FLA checkpoint keeps its own, {FLA_BLOCK_FIELD}={config[FLA_BLOCK_FIELD]}; "
            "leave --block-size out"
        )
    return target


class FlaRenamer:
    """Streams FLA's tensors into this package's names (`TensorRenamer`'s interface); a name outside the table is
    passed on unchanged, for the writer to refuse as a tensor without a counterpart."""

    def __init__(self, config: AttnResConfig):
        self.names = fla_names(config)
        self.tied = config.tie_word_embeddings

    def __call__(self, name: str, tensor: torch.Tensor) -> Iterator[tuple[str, torch.Tensor]]:
        if self.tied and name == "lm_head.weight":
            return
        yield self.names.get(name, name), tensor.reshape(-1) if is_fla_query(name) else tensor

    def finish(self) -> None:
        pass


def check_fla_exportable(config: AttnResConfig, drop_exact_retrofit: bool) -> None:
    """Refuse, naming the field, what FLA's Transformer cannot represent; before any weight is read."""

    def refuse(field: str, allowed: str) -> ConversionError:
        return ConversionError(f"AttnResConfig.{field}={getattr(config, field)!r}: {allowed} for FLA (--to fla)")

    if config.residual_mode not in ("block", "full") or config.depth_ablation is not None:
        field = "residual_mode" if config.depth_ablation is None else "depth_ablation"
        raise refuse(field, "FLA has Block and Full AttnRes only (residual_mode 'block' or 'full', no ablation)")
    if config.depth_block_size > 1 and config.depth_block_size % 2:
        raise refuse("block_size", "FLA's blocks hold whole layers: the block size must be 1 or even")
    if config.family not in FLA_FAMILIES:
        raise refuse(
            "family", f"FLA's Transformer is a Llama decoder: one of {', '.join(map(repr, FLA_FAMILIES))}"
        )
    if len(set(layer_types(config))) > 1:
        raise refuse("layer_types", "FLA windows every layer or none")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim * config.num_attention_heads != config.hidden_size:
        raise refuse(
            "head_dim",
            f"FLA's is hidden_size / num_attention_heads = {config.hidden_size // config.num_attention_heads}",
        )
    for bias in ("attention_bias", "mlp_bias"):
        if getattr(config, bias, False):
            raise refuse(bias, "FLA has biases on q, k, v only")
    if config.hidden_act != "silu":
        raise refuse("hidden_act", "FLA's MLP is SwiGLU ('silu')")
    rope = config.rope_parameters or {}
    if rope.get("rope_type", "default") != "default":
        raise refuse("rope_parameters", "FLA's rotary embedding has no scaling (rope_type 'default')")
    if config.exact_retrofit and not drop_exact_retrofit:
        raise refuse(
            "exact_retrofit",
            "FLA has no scale on a step's output, so an exact retrofit cannot be kept; pass --drop-exact-retrofit "
            "(drop_exact_retrofit=True) to export without it, and the export measures and reports how much the "
            "logits move",
        )


def fla_config(config: AttnResConfig) -> dict:
    """FLA's `config.json` for `config` (which `check_fla_exportable` accepted)."""
    return {
        "architectures": [FLA_ARCHITECTURE],
        "model_type": FLA_MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_heads": config.num_attention_heads,
        "num_kv_heads": config.num_key_value_heads,
        "hidden_act": "swish",
        "qkv_bias": config.family == "qwen2",
        "qk_norm": False,
        "window_size": config.sliding_window if "sliding_attention" in layer_types(config) else None,
        "rope_theta": (config.rope_parameters or {}).get("rope_theta", 10000.0),
        "max_position_embeddings": config.max_position_embeddings,
        "norm_eps": config.rms_norm_eps,
        "initializer_range": config.initializer_range,
        "tie_word_embeddings": config.tie_word_embeddings,
        "use_cache": config.use_cache,
        "pad_token_id": config.pad_token_id,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        FLA_BLOCK_FIELD: config.depth_block_size,
    }


def fla_names(config: AttnResConfig) -> dict[str, str]:
    """Every weight of the model, FLA's name to this package's. FLA keeps a pseudo-query as a `[1, D]` projection
    (`*_res_proj.weight`) where this package keeps `[D]`; nothing else changes but the name. Layer 0's attention
    step attends over the embedding alone in both, so its parameters are carried though neither reads them."""
    names = {"model.embeddings.weight": "model.embed_tokens.weight", "model.norm.weight": "model.norm.weight"}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    names["model.res_proj.weight"] = "model.output_residual.query.pseudo_query"
    names["model.res_norm.weight"] = "model.output_residual.query.key_norm_weight"
    biases = ("q", "k", "v") if config.family == "qwen2" else ()
    for i in range(config.num_hidden_layers):
        layer = f"model.layers.{i}."  # the same prefix in both
        names[layer + "attn_norm.weight"] = layer + "input_layernorm.weight"
        names[layer + "mlp_norm.weight"] = layer + "post_attention_layernorm.weight"
        for projection in ("q", "k", "v", "o"):
            names[layer + f"attn.{projection}_proj.weight"] = layer + f"self_attn.{projection}_proj.weight"
        for projection in biases:
            names[layer + f"attn.{projection}_proj.bias"] = layer + f"self_attn.{projection}_proj.bias"
        for projection in ("gate", "up", "down"):
            names[layer + f"mlp.{projection}_proj.weight"] = layer + f"mlp.{projection}_proj.weight"
        for sublayer in ("attn", "mlp"):
            names[layer + f"{sublayer}_res_proj.weight"] = layer + f"{sublayer}_residual.query.pseudo_query"
            names[layer + f"{sublayer}_res_norm.weight"] = layer + f"{sublayer}_residual.query.key_norm_weight"
    return names


def is_fla_query(fla_name: str) -> bool:
    """Whether FLA keeps this weight as a `[1, D]` projection (a pseudo-query) where this package keeps `[D]`."""
    return fla_name.endswith("res_proj.weight")


def fla_verification_problem() -> str | None:
    """Why FLA's own model cannot check a conversion or an export here, for the report (None when it can: FLA is
    importable and runs on the torch references of `fla_reference`, flash-attn or not)."""
    if not fla_is_importable():
        return FLA_NOT_IMPORTABLE
    from .fla_reference import fla_torch_problem

    problem = fla_torch_problem()
    return None if problem is None else f"{problem}, so only the weights were mapped"


def fla_is_importable() -> bool:
    """Whether FLA's models can be imported here (`fla.models` needs Triton importable, not runnable)."""
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("triton") is None:
        return False
    try:
        import fla.models  # noqa: F401  (registers FLA's configs and models with the Auto classes)
    except ImportError:
        return False
    return True
