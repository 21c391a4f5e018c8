"""hf_swiftspec: lossless tree speculative decoding for Hugging Face transformers.

    model = SwiftSpecForCausalLM.from_models(target, draft)
    out = model.generate(input_ids, max_new_tokens=64, swiftspec=True)
"""

from transformers import AutoConfig, AutoModelForCausalLM

from .config import SwiftSpecConfig
from .engine import SwiftSpecWorkerError
from .modeling import SwiftSpecForCausalLM
from .pair import resolve_bundled_names_in_transformers
from .stats import SwiftSpecStats


def register_auto_classes() -> None:
    """Make AutoConfig / AutoModelForCausalLM (and so pipeline()) resolve model_type "swiftspec",
    and find the pairs bundled with hf_swiftspec by name (e.g. "swiftspec-demo-pystdlib")."""
    AutoConfig.register("swiftspec", SwiftSpecConfig, exist_ok=True)
    AutoModelForCausalLM.register(SwiftSpecConfig, SwiftSpecForCausalLM, exist_ok=True)
    resolve_bundled_names_in_transformers()


# The one import-time effect, as with any transformers model library: Auto* must know the type
# (and the bundled names) before a user calls AutoModelForCausalLM.from_pretrained on a pair repo.
register_auto_classes()

__all__ = ["SwiftSpecConfig", "SwiftSpecForCausalLM", "SwiftSpecStats", "SwiftSpecWorkerError", "register_auto_classes"]
__version__ = "0.1.0"
