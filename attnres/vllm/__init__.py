"""AttnRes in vLLM: the plugin that registers the native model (docs/serving.md#vllm).

`pip install 'attnres[vllm]'` installs it under vLLM's `vllm.general_plugins` entry point, which vLLM calls in every
process it starts before it reads a model's config. `register` makes `AttnResForCausalLM` checkpoints load with
vLLM's default `model_impl`, without remote code: importing attnres registers the config and the Transformers
classes with the Auto classes (which the config and the Transformers backend's fallback read), and the model is
registered by name, imported only when a checkpoint asks for it.
"""


def register() -> None:
    from vllm import ModelRegistry

    import attnres  # noqa: F401  (registers AttnResConfig and the Transformers classes with the Auto classes)

    ModelRegistry.register_model("AttnResForCausalLM", "attnres.vllm.model:AttnResForCausalLM")
