"""attnres: Attention Residuals (arXiv:2603.15031) for Hugging Face Transformers.

Importing the package registers the model with `AutoConfig`, `AutoModel`, `AutoModelForCausalLM` and
`AutoModelForSequenceClassification`, so `AutoModelForCausalLM.from_pretrained(folder)` works for AttnRes folders
without `trust_remote_code` once `attnres` is installed.
"""

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
)

from .configuration_attnres import AttnResConfig
from .modeling_attnres import (
    AttnResForCausalLM,
    AttnResForSequenceClassification,
    AttnResModel,
    AttnResPreTrainedModel,
)


__version__ = "0.1.0"

AutoConfig.register(AttnResConfig.model_type, AttnResConfig, exist_ok=True)
AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)
AutoModelForSequenceClassification.register(AttnResConfig, AttnResForSequenceClassification, exist_ok=True)

__all__ = [
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResForSequenceClassification",
    "AttnResModel",
    "AttnResPreTrainedModel",
]
