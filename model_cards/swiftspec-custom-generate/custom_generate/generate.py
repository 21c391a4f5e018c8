"""Tree speculative decoding (hf_swiftspec) as a transformers custom_generate repo.

    out = model.generate(ids, custom_generate="ORG/swiftspec-custom-generate", trust_remote_code=True,
                         swiftspec_draft=draft, max_new_tokens=64)

Lossless: greedy output is exactly model.generate's own, sampling follows the model's distribution.
Without swiftspec_draft it speculates from the text's own repetition (suffix proposals). The loop is
hf_swiftspec's; `generate` hands it generate()'s arguments (hf_swiftspec.custom.hub_generate).
"""

from hf_swiftspec.custom import hub_generate as generate  # noqa: F401
