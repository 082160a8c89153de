"""`attnres serve`: Transformers' own OpenAI-compatible server (`transformers serve`) with AttnRes available to it.

`transformers serve` (Transformers 5.x, `transformers/cli/serving/model_manager.py`) resolves a checkpoint's model
class by looking its `config.architectures[0]` up by name in the `transformers` namespace, so it cannot load a model
class that lives outside Transformers, whether installed or shipped as remote code. This command names the AttnRes
classes in that namespace, in its own process only, and then runs `transformers serve` unchanged: every option,
endpoint, streaming and continuous batching are Transformers'.
"""

import sys
from collections.abc import Sequence


def serve(arguments: Sequence[str]) -> int:
    """Run `transformers serve *arguments` with the AttnRes model classes resolvable by name."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():  # checked here, before the server starts, to fail in one line
        raise ValueError("attnres serve needs the server's packages: pip install 'attnres[serve]'")
    from transformers.cli.serving import model_manager
    from transformers.cli.transformers import main as transformers_main

    import attnres

    for name in ("AttnResModel", "AttnResForCausalLM", "AttnResForSequenceClassification"):
        setattr(model_manager.transformers, name, getattr(attnres, name))
    sys.argv = ["transformers", "serve", *arguments]
    try:
        transformers_main()
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else 0
    return 0
