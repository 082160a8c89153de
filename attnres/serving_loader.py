"""The model loader `attnres serve` gives `transformers serve` from Transformers 5.25, where the server loads each
model in a spawned process with a copy of its `ModelLoader` (see `attnres/serving.py`). This module imports
`transformers.cli.serving.model_manager`, which only the server's packages make importable, so only `serve` imports
it."""

from collections.abc import Callable

from transformers.cli.serving.model_manager import ModelLoader

from attnres.serving import name_attnres_classes_for_the_server


class AttnResModelLoader(ModelLoader):
    """`ModelLoader` that names the AttnRes classes in the process that loads the model before loading it: unpickling
    it there imports attnres, and this method then makes `config.architectures[0]` resolvable."""

    def load_model_and_processor(self, model_id: str, on_progress: Callable | None = None):
        name_attnres_classes_for_the_server()
        return super().load_model_and_processor(model_id, on_progress)
