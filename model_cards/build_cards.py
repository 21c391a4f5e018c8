"""Write the real-pair folders of model_cards/ (config.json + README.md) from one table.

    python model_cards/build_cards.py              # rewrites model_cards/<pair>/ for every pair below
    python model_cards/build_cards.py --out DIR    # writes them elsewhere (the tests compare the two)

Each folder is the pair repo as it would be published, except the tokenizer and generation
config: `swiftspec pair create` copies those from the target when it has network access; here
they cannot be downloaded, and a pair without them falls back to the target's own.

Facts are only those checked against public copies of each repo's config.json and model card;
None means "not checked" and the card says so (`swiftspec pair check` reads the real values).
Revisions are commits seen as Hugging Face cache snapshot folders of the repo (so they existed
and loaded); None where several commits were seen and none could be told to be current.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from hf_swiftspec import SwiftSpecConfig
from hf_swiftspec.pair import PairCard, write_pair_repo

HERE = Path(__file__).resolve().parent
PAPER = "SwiftSpec (arXiv 2506.11309, ASPLOS'26)"
PAPER_SETUP = "8x H800, int4 AWQ weights, greedy, 80 prompts from each of 6 datasets"
SPLIT_70B = (
    f"{PAPER} runs 70B-class targets on 8 GPUs split **4 for the target (tensor-parallel) + 4 for the draft**, "
    "chosen by offline profiling."
)
SPLIT_33B = f"{PAPER} runs 32-33B targets on 8 GPUs split **6 for the target (tensor-parallel) + 2 for the draft**."
NOT_MEASURED = "Not measured with hf_swiftspec yet."


@dataclass(frozen=True)
class Member:
    repo: str
    revision: str | None
    model_type: str | None = None  # None: not checked
    vocab_size: int | None = None
    context: int | None = None
    license: str | None = None


@dataclass(frozen=True)
class Pair:
    folder: str
    target: Member
    draft: Member
    license: str  # the pair repo redistributes the target's tokenizer, so it carries the target's licence
    placement: str
    acceptance: str
    license_name: str | None = None
    license_link: str | None = None
    from_paper: bool = False
    notes: str = ""


LLAMA_3_2_3B = Member("meta-llama/Llama-3.2-3B-Instruct", "0cb88a4f764b7a12671c53f0838cd831a0843b95", "llama", 128256, 131072, "llama3.2")
QWEN_LICENSE = "https://huggingface.co/Qwen/{}/blob/main/LICENSE"

PAIRS = (
    Pair(
        "llama-3-70b-instruct--llama-3.2-3b-instruct",
        Member("meta-llama/Meta-Llama-3-70B-Instruct", None, "llama", 128256, 8192, "llama3"),
        LLAMA_3_2_3B,
        license="llama3",
        placement=SPLIT_70B,
        acceptance=f"{PAPER} reports 347-348 tokens/s for Llama-3-70B with a Llama-3.2 draft ({PAPER_SETUP}). {NOT_MEASURED}",
        from_paper=True,
        notes=(
            "The target is a Llama 3 release and the draft a Llama 3.2 one: `swiftspec pair check` compares their "
            "tokenizers token by token. Added tokens named differently by the two releases, if any, only warn: "
            "verification is lossless, and drafts of those ids are simply rejected."
        ),
    ),
    Pair(
        "llama-3.3-70b-instruct--llama-3.2-3b-instruct",
        Member("meta-llama/Llama-3.3-70B-Instruct", "6f6073b423013f6a7d4d9f39144961bfbfbc386b", license="llama3.3"),
        LLAMA_3_2_3B,
        license="llama3.3",
        placement=SPLIT_70B,
        acceptance=f"{PAPER} reports 369 tokens/s for Llama-3.3-70B ({PAPER_SETUP}). {NOT_MEASURED}",
        from_paper=True,
    ),
    Pair(
        "qwen2-72b-instruct--qwen2-1.5b-instruct",
        Member("Qwen/Qwen2-72B-Instruct", "1af63c698f59c4235668ec9c1395468cb7cd7e79", "qwen2", 152064, 32768, "tongyi-qianwen"),
        Member("Qwen/Qwen2-1.5B-Instruct", "ba1cf1846d7df0a0591d6c00649f57e798519da8", "qwen2", 151936, 32768, "apache-2.0"),
        license="other",
        license_name="tongyi-qianwen",
        license_link=QWEN_LICENSE.format("Qwen2-72B-Instruct"),
        placement=SPLIT_70B,
        acceptance=(
            f"{PAPER} reports, for Qwen2-72B with Qwen2-1.5B: 274 tokens/s with the parallel (asynchronous) tree vs "
            f"200 serial, a mean acceptance length of 2.7-3.9 tokens per verification depending on the dataset, "
            f"target step 10.5 ms, draft step 3.3 ms ({PAPER_SETUP}). {NOT_MEASURED}"
        ),
        from_paper=True,
        notes="Padded vocabularies: 152064 embedding rows (target) vs 151936 (draft) over one shared tokenizer.",
    ),
    Pair(
        "deepseek-coder-33b-instruct--deepseek-coder-1.3b-instruct",
        Member("deepseek-ai/deepseek-coder-33b-instruct", "61dc97b922b13995e7f83b7c8397701dbf9cfd4c", "llama", 32256, 16384, "deepseek"),
        Member("deepseek-ai/deepseek-coder-1.3b-instruct", "e063262dac8366fc1f28a4da0ff3c50ea66259ca", "llama", 32256, 16384, "deepseek"),
        license="other",
        license_name="deepseek",
        license_link="https://github.com/deepseek-ai/DeepSeek-Coder/blob/main/LICENSE-MODEL",
        placement=SPLIT_33B,
        acceptance=NOT_MEASURED,
        from_paper=True,
    ),
    Pair(
        "deepseek-r1-distill-qwen-32b--deepseek-r1-distill-qwen-1.5b",
        Member("deepseek-ai/DeepSeek-R1-Distill-Qwen-32B", "711ad2ea6aa40cfca18895e8aca02ab92df1a746", "qwen2", 152064, 131072, "mit"),
        Member("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "ad9f0ae0864d7fbcd1cd905e3c6c5b069cc8b562", "qwen2", 151936, 131072, "mit"),
        license="mit",
        placement=SPLIT_33B,
        acceptance=NOT_MEASURED,
        from_paper=True,
        notes="Padded vocabularies: 152064 embedding rows (target) vs 151936 (draft) over one shared tokenizer.",
    ),
    Pair(
        "deepseek-r1-distill-llama-70b--deepseek-r1-distill-llama-8b",
        Member("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", "b1c0b44b4369b597ad119a196caf79a9c40e141e", "llama", 128256, 131072, "mit"),
        Member("deepseek-ai/DeepSeek-R1-Distill-Llama-8B", "6a6f4aa4197940add57724a7707d069478df56b1", "llama", 128256, 131072, "mit"),
        license="mit",
        placement=SPLIT_70B,
        acceptance=NOT_MEASURED,
        from_paper=True,
        notes="Both are fine-tunes of Llama models; the Llama licences of their base models apply as well.",
    ),
    Pair(
        "llama-3.1-8b-instruct--llama-3.2-1b-instruct",
        Member("meta-llama/Llama-3.1-8B-Instruct", "0e9e39f249a16976918f6564b8830bc894c89659", license="llama3.1"),
        Member("meta-llama/Llama-3.2-1B-Instruct", "9213176726f574b556790deb65791e0c5aa438b6", "llama", 128256, 131072, "llama3.2"),
        license="llama3.1",
        placement=f"{PAPER} gives no split for 8B targets. {NOT_MEASURED}",
        acceptance=NOT_MEASURED,
    ),
    Pair(
        "qwen2.5-72b-instruct--qwen2.5-0.5b-instruct",
        Member("Qwen/Qwen2.5-72B-Instruct", "495f39366efef23836d0cfae4fbe635880d2be31", license="qwen"),
        Member("Qwen/Qwen2.5-0.5B-Instruct", "7ae557604adf67be50417f59c2c2f167def9a775", "qwen2", 151936, 32768, "apache-2.0"),
        license="other",
        license_name="qwen",
        license_link=QWEN_LICENSE.format("Qwen2.5-72B-Instruct"),
        placement=f"{SPLIT_70B} Not measured for this pair.",
        acceptance=NOT_MEASURED,
        notes="The draft's 151936 embedding rows pad the shared tokenizer differently from the 72B's; the pair check compares tokenizers, not sizes.",
    ),
    Pair(
        "qwen3-32b--qwen3-0.6b",
        Member("Qwen/Qwen3-32B", "9216db5781bf21249d130ec9da846c4624c16137", "qwen3", 151936, 40960),
        Member("Qwen/Qwen3-0.6B", "c1899de289a04d12100db370d81485cdf75e47ca", "qwen3", 151936, 40960, "apache-2.0"),
        license="apache-2.0",
        placement=f"{SPLIT_33B} Not measured for this pair.",
        acceptance=NOT_MEASURED,
    ),
)


def checked(value) -> str:
    return "not checked" if value is None else f"`{value}`"


def members_section(pair: Pair) -> str:
    rows = [
        f"| {role} | `{m.repo}` | {checked(m.model_type)} | {checked(m.vocab_size)} | {checked(m.context)} | {checked(m.license)} |"
        for role, m in (("target", pair.target), ("draft", pair.draft))
    ]
    return (
        "| role | repo | model_type | vocab_size | max_position_embeddings | licence |\n|---|---|---|---|---|---|\n"
        + "\n".join(rows)
        + "\n\nFrom public copies of each repo's config.json and model card; `swiftspec pair check` reads the real "
        "values (and compares the two tokenizers) before any weights load. Revisions are commits seen as Hugging "
        "Face cache snapshots of each repo; the default branch may have moved since. This folder has no tokenizer "
        "or generation config yet: `swiftspec pair create` copies the target's when publishing, and until then "
        "the target's own are used."
    )


def pair_card(pair: Pair) -> PairCard:
    origin = f"A pairing evaluated in {PAPER}, here with the releases named above" if pair.from_paper else (
        "A current pairing, not one from the paper"
    )
    sections = (
        ("Models", members_section(pair)),
        ("Recommended placement", pair.placement),
        ("Measured acceptance", pair.acceptance),
    )
    if pair.notes:
        sections += (("Notes", pair.notes),)
    return PairCard(
        title=f"SwiftSpec pair: {pair.target.repo.split('/')[1]} + {pair.draft.repo.split('/')[1]}",
        summary=(
            f"Lossless tree speculative decoding for `{pair.target.repo}`, drafted by `{pair.draft.repo}`. {origin}. "
            "Outputs are exactly the target's own (greedy) or drawn from exactly its distribution (sampling); the "
            "draft only makes them come faster. This repo holds no weights: both models load from their own repos, "
            "at the pinned revisions, as safetensors."
        ),
        license=pair.license,
        license_name=pair.license_name,
        license_link=pair.license_link,
        tags=(pair.target.model_type,) if pair.target.model_type else (),
        sections=sections,
    )


def pair_config(pair: Pair) -> SwiftSpecConfig:
    return SwiftSpecConfig(
        target=pair.target.repo,
        target_revision=pair.target.revision,
        draft=pair.draft.repo,
        draft_revision=pair.draft.revision,
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="where to write the pair folders (default: %(default)s)")
    out = parser.parse_args(argv).out
    for pair in PAIRS:
        write_pair_repo(out / pair.folder, pair_config(pair), pair_card(pair), load_id=f"model_cards/{pair.folder}")
        print(out / pair.folder)


if __name__ == "__main__":
    main()
