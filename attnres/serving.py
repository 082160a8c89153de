"""`attnres serve`: Transformers' own OpenAI-compatible server (`transformers serve`) with AttnRes available to it.

`transformers serve` (Transformers 5.x, `transformers/cli/serving/model_manager.py`) resolves a checkpoint's model
class by looking its `config.architectures[0]` up by name in the `transformers` namespace, so it cannot load a model
class that lives outside Transformers, whether installed or shipped as remote code. This command names the AttnRes
classes in that namespace and then runs `transformers serve` unchanged: every option, endpoint, streaming and
continuous batching are Transformers'.

From Transformers 5.25 the server loads and runs each model in a process of its own, started with `spawn`, which
imports nothing of this process but what it unpickles: the server's `ModelLoader`. The server here gets
`AttnResModelLoader` (`attnres/serving_loader.py`) instead, so that the model's process imports attnres (which
registers its config with the Auto classes) and names the classes there too before it loads the model.
"""

import sys
from collections.abc import Sequence


def name_attnres_classes_for_the_server() -> None:
    """Make the server's `getattr(transformers, name)` find the AttnRes classes, in this process only. The names go
    on the module the server holds: importing parts of Transformers 5.25 can put another `transformers` module object
    in `sys.modules`."""
    from transformers.cli.serving import model_manager

    import attnres

    for name in ("AttnResModel", "AttnResForCausalLM", "AttnResForSequenceClassification"):
        setattr(model_manager.transformers, name, getattr(attnres, name))


def serve(arguments: Sequence[str]) -> int:
    """Run `transformers serve *arguments` with the AttnRes model classes resolvable by name."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():  # checked here, before the server starts, to fail in one line
        raise ValueError("attnres serve needs the server's packages: pip install 'attnres[serve]'")
    from transformers.cli.serving import model_manager
    from transformers.cli.transformers import main as transformers_main

    name_attnres_classes_for_the_server()
    if hasattr(model_manager, "ModelLoader"):  # the model loads in a spawned process (Transformers >= 5.25)
        from attnres.serving_loader import AttnResModelLoader

        model_manager.ModelLoader = AttnResModelLoader
    sys.argv = ["transformers", "serve", *arguments]
    try:
        transformers_main()
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 0
    return 0
