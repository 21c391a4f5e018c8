"""Every measured figure on a documentation page (and the README) is a number in a committed result file.

How a page ties its figures (follow this when you write a page with measurements):

* Put the figures in one block (a paragraph, a table or a list: lines up to the next blank line) and write,
  on the line just above it, ``<!-- figures: PATH [PATH ...] -->``. Each PATH is a file or folder under
  ``examples/results/`` or ``examples/gpu_results/`` (a folder stands for its text files; its results.json
  only where it has no results.md), and the folder that holds it keeps a ``command.txt``: the command that
  wrote it.
* A measured figure is a decimal number (``2.31``, ``tau 3.26``, ``1.29-1.33``) or a whole number with a
  unit (``13%``, ``16 ms``, ``4x``, ``666 tokens/s``, ``528 bytes``) in the page's prose or tables; code
  blocks, inline code and GENERATED regions are not prose (a command's flags and a setting's default live
  in code; a generated table has its own test).
* Each figure of a block must appear in one of the block's files: as a number, rounded half-up to the
  figure's decimals (a JSON file's values too); a speed-up (``x``) or a percent as a number the file writes
  with that unit, where the file writes any so. A figure that differs from its file fails here, naming the
  page and the figure, and so does a figure in a block without the comment: tie it, or say what the
  command measures and how to run it instead of a number. (A changed figure can still match another
  number of the same files by chance: name the few files a block comes from, not a whole lease.)
* Numbers that are not measurements (a version, a goal, a setting's value in prose) go in ``NOT_MEASURED``
  below, as the phrase that holds them on that page; a phrase that left its page fails, so the list stays short.
"""

import json
import re
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "source" / "en"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
RESULT_ROOTS = ("examples/results/", "examples/gpu_results/")

# Phrases whose numbers are not measurements, per page (exact text of the page's prose, whitespace collapsed).
NOT_MEASURED: dict[str, list[str]] = {
    "docs/source/en/gpu_results.md": [  # the goals an issue set, and sizes the code fixes
        "(goal 2x", "(goal 1.5x", "(goal: 2x", "The goals (1.5x and 2x of the floor)", "(the goal was 1.3x)",
        "(verification within 1.5x of its floor, expansion within 2x)", "(the goal was 1.5x", "up to 4x what it needs",
        "outlives its printed summary by 15 s",  # gpu_session.py's grace
    ],
    "docs/source/en/bench.md": ["= 10^6 bytes"],
    "docs/source/en/drafters.md": ["arXiv 2411.04975"],
    "docs/source/en/replayed_steps.md": ["up to 4x what the call needs"],
    "docs/source/en/settings.md": ["(10% of a plain step per node", "at most 5% of its call decoded plainly"],
    "docs/source/en/generate.md": ["near 34 its step is 0.25", "before transformers 5.24"],  # bfloat16's spacing; a version
    "docs/source/en/installation.md": ["transformers 5.23 to 5.24", "below 5.25"],  # versions
    "docs/source/en/architectures.md": ["transformers 5.23-5.24"],
    "docs/source/en/index.md": ["arXiv 2506.11309"],
    "README.md": ["arXiv 2506.11309", "**5.23 to 5.24**"],
    "docs/source/en/placements.md": ["(short of the 1.3x goal)", "2 + 2 x 32 int32 each at the default budget: 528 bytes"],
}

# Regions a generator writes from a committed file, tied to it by their own test (skipped here).
GENERATED = {
    "architecture-table": "test_readme.py::test_the_architecture_table_is_the_sweeps (hf_swiftspec/data/architecture_verdicts.json)",
}

MARKER = re.compile(r"^<!-- figures: (.+?) -->$")
NUMBER = r"\d+(?:\.\d+)?"
# a unit written against the number (4x, 13%) or after a space (16 ms, 666 tokens/s); "2 x 32" is no figure
UNIT = r"(?:(?:x|×|%)|\s?(?:ms|µs|us|s|tok/s|tokens/s|tokens a second|GB/s|GB|GiB|MB|MiB|KB|bytes))(?![\w/])"
# a whole number (or a range of them) with a unit, or a decimal that is not a version such as 2.13.0
# (a number after a letter and a hyphen is part of a name: Llama-3.2-1B, gemma-3-270m)
FIGURE = re.compile(rf"(?<![\w.])(?<![A-Za-z]-){NUMBER}(?:[-–]{NUMBER})?{UNIT}|(?<![\w.])(?<![A-Za-z]-)\d+\.\d+(?![\d.]*\d)")


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def without_code(lines: list[str]) -> list[str]:
    """The page's lines with fenced code blocks and GENERATED regions blanked (kept as blank lines, so
    blocks stay apart)."""
    out, skipping = [], None
    for line in lines:
        region = re.match(r"<!-- ([\w-]+):(start|end) -->$", line.strip())
        if skipping is None and line.startswith("```"):
            skipping = "```"
        elif skipping == "```" and line.startswith("```"):
            skipping = None
        elif skipping is None and region and region[1] in GENERATED and region[2] == "start":
            skipping = region[1]
        elif region and region[1] == skipping and region[2] == "end":
            skipping = None
        else:
            out.append("" if skipping else line)
            continue
        out.append("")
    return out


@dataclass(frozen=True)
class Block:
    """A paragraph, table or list of a page (lines up to a blank line) and the result files its marker names."""

    page: Path
    line: int  # 1-based, the block's first line after its marker
    text: str  # whitespace collapsed
    files: tuple[str, ...]  # repository-relative; empty where the block has no marker


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """The page's blocks (`text`: the page as it would be, for the tests that change a figure)."""
    lines = without_code((page.read_text() if text is None else text).splitlines())
    found, start = [], None
    for i, line in enumerate([*lines, ""]):
        if line.strip() and start is None:
            start = i
        elif not line.strip() and start is not None:
            group, first = lines[start:i], start
            marker = MARKER.match(group[0].strip())
            files = tuple(marker.group(1).split()) if marker else ()
            if marker:
                group, first = group[1:], first + 1
                assert group, f"{name(page)}:{start + 1}: a figures marker with no block under it"
            found.append(Block(page, first + 1, " ".join(" ".join(group).split()), files))
            start = None
    return found


def figures(block: Block) -> list[str]:
    """The block's measured figures as written (`1.29-1.33 ms`, `2.03x`, `tau 3.26` gives `3.26`)."""
    text = re.sub(r"<!--.*?-->", " ", block.text)
    text = re.sub(r"`[^`]*`", " ", text)  # inline code: commands, flags, settings
    text = re.sub(r"\]\([^)]*\)", "]", text)  # link targets
    for phrase in NOT_MEASURED.get(name(block.page), []):
        text = text.replace(phrase, " ")
    return [m.group(0) for m in FIGURE.finditer(text)]


# A figure with one of these units matches only numbers written with it in a file that writes any so
# (results.md's "2.31 ± 1.40×", output.txt's "13%"); a file whose ratios are bare columns matches any number.
TYPED = {"x": r"[x×]", "×": r"[x×]", "%": r"%"}


def rounded(number: str) -> set[str]:
    """The number as written and rounded half-up to fewer decimals (393.8 is also "394")."""
    decimals = len(number.partition(".")[2])
    return {str(Decimal(number).quantize(Decimal(10) ** -d, ROUND_HALF_UP)) for d in range(decimals + 1)}


@cache
def numbers_in(path: Path, unit: str = "") -> frozenset[str]:
    """Every number a result file states, rounded as above; a JSON file's numeric values also at 0-4 decimals.
    With a TYPED unit: the numbers written with that unit (after an optional "± sd"), where the file has any."""
    text = path.read_text(errors="replace")
    if unit in TYPED:
        typed = set().union(*(rounded(m[1]) for m in re.finditer(rf"({NUMBER})(?: ± {NUMBER})?\s?{TYPED[unit]}", text)))
        if typed:
            return frozenset(typed)
    found = set().union(*(rounded(n) for n in re.findall(NUMBER, text)))
    if path.suffix == ".json":
        def walk(value):
            if isinstance(value, dict):
                for v in value.values():
                    walk(v)
            elif isinstance(value, list):
                for v in value:
                    walk(v)
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                found.update(f"{value:.{d}f}" for d in range(5))
        walk(json.loads(text))
    return frozenset(found)


def unit_of(figure: str) -> str:
    return figure[-1] if figure[-1] in TYPED else ""


def backing_files(block: Block) -> list[Path]:
    """The files a block's marker names; a folder stands for its text files (its results.json only where it has
    no results.md: the page shows the rounded table, and the JSON's every value at 0-4 decimals would match
    almost any figure)."""
    paths = []
    for where in block.files:
        path = ROOT / where
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.name != "command.txt")
            texts = [p for p in files if p.suffix != ".json"]
            paths += texts or files
        else:
            paths.append(path)
    return paths


def problems(page: Path, text: str | None = None) -> list[str]:
    """Each figure of the page that its block's files do not hold, or that no file backs, as "page:line: why"."""
    found = []
    for block in blocks(page, text):
        shown = figures(block)
        if block.files and not shown:
            found.append(f"{name(page)}:{block.line}: a figures marker over a block with no figure")
        if not shown:
            continue
        if not block.files:
            found += [f"{name(page)}:{block.line}: {figure!r} has no result file (no figures marker above its block)"
                      for figure in shown]
            continue
        for figure in shown:
            known = frozenset().union(*(numbers_in(p, unit_of(figure)) for p in backing_files(block)))
            if any(n not in known for n in re.findall(NUMBER, figure)):
                found.append(f"{name(page)}:{block.line}: {figure!r} is not in {', '.join(block.files)}")
    return found


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_figure_is_in_its_result_file(page):
    assert not problems(page), "\n".join(problems(page))


def test_a_figure_changed_or_unbacked_fails():
    """The check itself: placements.md's table with one speed-up changed (2.03x -> 2.05x) fails naming the page
    and the figure, and so does a sentence with a figure and no marker; the page as it is passes."""
    page = DOCS / "placements.md"
    text = page.read_text()
    assert "| 2.03x (tau 3.26" in text and not problems(page, text)
    changed = problems(page, text.replace("| 2.03x (tau 3.26", "| 2.05x (tau 3.26"))
    assert len(changed) == 1 and changed[0].startswith("docs/source/en/placements.md:") and "'2.05x' is not in" in changed[0]
    unbacked = problems(page, text + "\nThe asynchronous engine ran 1.37x the serial round.\n")
    assert len(unbacked) == 1 and "'1.37x' has no result file" in unbacked[0]
    retimed = problems(page, text.replace("verify 16.8 ms, target idle 2.7 ms", "verify 16.9 ms, target idle 2.7 ms"))
    assert len(retimed) == 1 and "'16.9 ms'" in retimed[0]


def test_each_result_file_is_committed_beside_its_command():
    """A marker names files under examples/results or examples/gpu_results, each with the command that wrote it."""
    for page in PAGES:
        for block in blocks(page):
            for where in block.files:
                path = ROOT / where
                assert where.startswith(RESULT_ROOTS), f"{name(page)}:{block.line}: {where} is not a result file"
                assert path.exists(), f"{name(page)}:{block.line}: {where} does not exist"
                folder = path if path.is_dir() else path.parent
                command = folder / "command.txt"
                assert command.exists() and command.read_text().strip(), f"{where}: no command.txt beside it"


def test_the_not_measured_phrases_are_on_their_pages():
    for page, phrases in NOT_MEASURED.items():
        prose = " ".join(" ".join(without_code((ROOT / page).read_text().splitlines())).split())
        for phrase in phrases:
            assert phrase in prose, f"{page} no longer says {phrase!r}: drop it from NOT_MEASURED"
