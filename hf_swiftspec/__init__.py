"""hf_swiftspec: lossless tree speculative decoding for Hugging Face transformers.

    model = SwiftSpecForCausalLM.from_models(target, draft)
    out = model.generate(input_ids, max_new_tokens=64, swiftspec=True)
"""

from .models import compat

compat.check_release()  # a transformers outside the tested releases fails here, naming both, not mid-generation

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from .config import SwiftSpecConfig  # noqa: E402
from .custom import custom_generate  # noqa: E402
from .drafters.eagle3 import Eagle3Head, load_eagle3_head  # noqa: E402
from .drafters.mtp import mtp_head  # noqa: E402
from .engine import SwiftSpecWorkerError  # noqa: E402
from .modeling import SwiftSpecForCausalLM  # noqa: E402
from .stats import SwiftSpecStats  # noqa: E402


def register_auto_classes() -> None:
    """Make AutoConfig / AutoModelForCausalLM (and so pipeline()) resolve model_type "swiftspec"."""
    AutoConfig.register("swiftspec", SwiftSpecConfig, exist_ok=True)
    AutoModelForCausalLM.register(SwiftSpecConfig, SwiftSpecForCausalLM, exist_ok=True)


# The one import-time effect, as with any transformers model library: Auto* must know the type before a
# user calls AutoModelForCausalLM.from_pretrained on a pair repo. Nothing of transformers' or
# huggingface_hub's is replaced: bundled pair names resolve in hf_swiftspec's own loaders only.
register_auto_classes()

__all__ = ["custom_generate", "Eagle3Head", "load_eagle3_head", "mtp_head", "SwiftSpecConfig", "SwiftSpecForCausalLM", "SwiftSpecStats", "SwiftSpecWorkerError", "register_auto_classes"]
__version__ = "0.1.0"
