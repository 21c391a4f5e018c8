"""What a seed draws, computed independently of swiftspec's rounds: transformers' own greedy loop over the target, with
the sampling warpers and then the Gumbel noise of each row's seed and position added to the scores (steps/
acceptance.gumbel_noise, the rule every round samples by: argmax(scores + noise) is a draw from softmax(scores)), so
the argmax it takes is the draw. The seed is drawn from the call's generator as swiftspec's Sampler draws it."""

import torch
from transformers import LogitsProcessor, LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_swiftspec.steps.acceptance import gumbel_noise


class GumbelNoise(LogitsProcessor):
    """scores (B, V) + each row's Gumbel noise for the position its next token takes (the sequence's length, left
    padding included), as float64."""

    def __init__(self, seed: int):
        self.seed = seed

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        B, L = input_ids.shape
        rows = torch.arange(B)
        noise = gumbel_noise(torch.full((B,), self.seed), rows, torch.full((B, 1), L), scores.shape[-1])[:, 0]
        return scores.double() + noise


def seed_of(generator: torch.Generator) -> int:
    """The seed swiftspec's Sampler draws from a call's generator (Sampler.draw_seed)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator, device=generator.device))


def seeded_draws(target, ids: torch.Tensor, generator: torch.Generator, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, **kwargs) -> torch.Tensor:
    """The tokens generate(ids, do_sample=True, generator=generator, temperature=..., top_k=..., top_p=..., **kwargs)
    draws through swiftspec=True: the target's own loop, greedy over the warped scores plus the seed's noise."""
    warpers = [TemperatureLogitsWarper(temperature)] if temperature != 1.0 else []
    warpers += [TopKLogitsWarper(top_k)] if top_k else []
    warpers += [TopPLogitsWarper(top_p)] if top_p is not None and top_p < 1.0 else []
    processors = LogitsProcessorList([*warpers, GumbelNoise(seed_of(generator))])
    return target.generate(ids, do_sample=False, logits_processor=processors, **kwargs)
