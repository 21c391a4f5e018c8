"""The README and the documentation pages (docs/source/en): their Python blocks run as pasted (a block
starting `# requires: two GPUs` only where there are), their links lead somewhere, their commands work,
and what they say of the code (settings, the architecture table) is what the code is."""

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs" / "source" / "en"
PAGES = [README, *sorted(DOCS.glob("*.md"))]


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def text(page: Path) -> str:
    return page.read_text()


def prose(page: Path) -> str:
    """The page without its fenced code blocks, whitespace collapsed (a phrase may wrap anywhere)."""
    return " ".join(re.sub(r"^```.*?^```", "", text(page), flags=re.S | re.M).split())


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", text(page), flags=re.S | re.M)


# What a page's blocks print, beyond the statistics line ("tau=") every page with a block prints.
PRINTED = {
    "README.md": ["def read_config(path):", "import os"],  # the completion, and the pipeline's
    "docs/source/en/batches.md": ["def add(a, b):", "per row:"],
    "docs/source/en/drafters.md": ["no draft model", "Eagle3Head"],
    "docs/source/en/replayed_steps.md": ["compiled layers"],
}


def sequences(output) -> list:
    return (output.sequences if hasattr(output, "sequences") else output).tolist()


def greedy(model, kwargs) -> bool:
    if "do_sample" in kwargs:
        return not kwargs["do_sample"]
    config = kwargs.get("generation_config") or model.target.generation_config
    return not config.do_sample


class GenerateCalls:
    """Every pair generate() call a page's blocks make, with what it returned, to check against the target's own."""

    def __init__(self, monkeypatch):
        from hf_swiftspec import SwiftSpecForCausalLM

        self.calls = []  # (pair, args, kwargs, output)
        self.summaries = []  # each call's statistics line
        generate = SwiftSpecForCausalLM.generate

        def recording(pair, *args, **kwargs):
            output = generate(pair, *args, **kwargs)
            self.calls.append((pair, args, dict(kwargs), output))
            self.summaries.append(pair.swiftspec_stats.summary())
            return output

        monkeypatch.setattr(SwiftSpecForCausalLM, "generate", recording)

    def mismatches(self) -> tuple[int, list[str]]:
        """(greedy calls checked, those whose tokens differ from target.generate's with the same arguments)."""
        checked, wrong = 0, []
        for pair, args, kwargs, output in self.calls:
            if not greedy(pair, kwargs):
                continue  # sampled: test_sampling's chi-square tests check the distribution
            plain = {k: v for k, v in kwargs.items() if not k.startswith("swiftspec") and k != "streamer"}
            expected = pair.target.generate(*args, **plain)
            checked += 1
            if sequences(output) != sequences(expected):
                wrong.append(f"generate({', '.join(sorted(plain))}): {sequences(output)} != {sequences(expected)}")
        return checked, wrong


def run_blocks(page: Path) -> list[dict]:
    """Runs each of the page's blocks alone, as pasted into a fresh interpreter (none continues another's names);
    their namespaces (blocks needing two GPUs skipped where there are fewer)."""
    threads = torch.get_num_threads()
    namespaces = []
    try:
        for block in python_blocks(page):
            if block.startswith("# requires: two GPUs") and torch.cuda.device_count() < 2:
                continue
            namespace: dict = {}
            exec(compile(block, str(page), "exec"), namespace)
            namespaces.append(namespace)
    finally:
        torch.set_num_threads(threads)
    return namespaces


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p) and p != README], ids=name)
def test_python_blocks_run(page, capsys, monkeypatch):
    """Each block runs, prints what the page says it prints, and every greedy generate() call it makes returns
    target.generate's own tokens for the same arguments (a block that calls no pair checks its own output)."""
    calls = GenerateCalls(monkeypatch)
    namespaces = run_blocks(page)
    if not namespaces:
        pytest.skip("every block needs two GPUs")
    printed = capsys.readouterr().out
    for expected in ["tau=", *PRINTED.get(name(page), [])]:
        assert expected in printed, f"{name(page)}'s blocks did not print {expected!r}:\n{printed[-3000:]}"
    checked, wrong = calls.mismatches()
    assert not wrong, f"{name(page)}: " + "\n".join(wrong)
    own_checks = all("assert " in block for block in python_blocks(page))
    assert checked or own_checks, f"{name(page)}: no block's output was checked"


def test_every_cpu_block_runs_one_thread_per_model():
    """A block that loads models on the CPU sets torch.set_num_threads(1): without it the custom_generate and EAGLE-3
    examples ran at 3.3 tokens/s instead of 130 on a small machine (the two models' threads thrash the cores)."""
    missing = [
        f"{name(page)}: block {i + 1}" for page in PAGES for i, block in enumerate(python_blocks(page))
        if not block.startswith("# requires: two GPUs") and re.search(r"from_pretrained|from_models", block)
        and "torch.set_num_threads(1)" not in block
    ]
    assert not missing, missing


def test_the_own_model_recipe_states_its_result_file():
    """drafters.md's "your own model" table is examples/results/cpu-own-model-recipe/results.json, tau for tau."""
    import json

    folder = ROOT / "examples" / "results" / "cpu-own-model-recipe"
    results = json.loads((folder / "results.json").read_text())
    assert "own_model_recipe.py" in (folder / "command.txt").read_text() and results["settings"] == dict(
        tree_budget=8, draft_depth=4)
    section = text(DOCS / "drafters.md").split("## Your own model, no trained draft", 1)[1]
    table = {cells[0]: cells[1:] for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in section.splitlines() if line.startswith("| ")
    )}
    for row in results["rows"]:
        column = 0 if row["prompts"].startswith("free text") else 1
        assert table[row["drafter"]][column] == f"{row['tau']:.2f}", (row, table)
        assert row["identical"], row
    assert len(table) == 1 + len({row["drafter"] for row in results["rows"]})  # the header and one row each


def test_the_readme_runs_its_example(capsys, monkeypatch):
    """The README's example, as pasted: it prints the pair's completion and the pipeline's, each exactly what the
    target alone completes, and the statistics line; every greedy call equals target.generate's."""
    from transformers import pipeline

    (block,) = python_blocks(README)
    calls = GenerateCalls(monkeypatch)
    (namespace,) = run_blocks(README)
    printed = capsys.readouterr().out
    model, tok, input_ids = namespace["model"], namespace["tok"], namespace["input_ids"]
    target_text = tok.decode(model.target.generate(input_ids, max_new_tokens=64)[0])
    plain_pipe = pipeline("text-generation", model=model.target, tokenizer=tok)
    pipe_text = plain_pipe("import os\n", max_new_tokens=32, do_sample=False)[0]["generated_text"]
    assert printed.startswith(target_text + "\n"), (printed[:500], target_text)
    assert calls.summaries[0].splitlines()[0] in printed  # the example's own call's statistics
    assert printed.rstrip("\n").endswith(pipe_text), (printed[-500:], pipe_text)
    checked, wrong = calls.mismatches()
    assert checked == 2 and not wrong, wrong  # the example's call, and the pipeline's


# ---------------------------------------------------------------- links: one click from the README to each subject


def anchors(page: Path) -> set[str]:
    """The ids GitHub gives a page's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    ids = set()
    for heading in re.findall(r"^#{1,6} (.+)$", re.sub(r"^```.*?^```", "", text(page), flags=re.S | re.M), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        ids.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return ids


def links(page: Path) -> list[str]:
    """Relative link targets in the page's prose (not in code blocks)."""
    body = re.sub(r"^```.*?^```", "", text(page), flags=re.S | re.M)
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", body) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=name)
def test_every_relative_link_resolves(page):
    for target in links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        assert resolved.exists(), f"{name(page)} links to {target}, which does not exist"
        if anchor:
            assert resolved.suffix == ".md", f"{name(page)}: an anchor into {path}, which is not a page"
            assert anchor in anchors(resolved), f"{name(page)} links to #{anchor}; {name(resolved)} has {sorted(anchors(resolved))}"


def linked_pages(page: Path) -> set[Path]:
    return {(page.parent / t.partition("#")[0]).resolve() for t in links(page) if t.partition("#")[0].endswith(".md")}


def test_the_readme_links_every_docs_page_and_the_index_lists_them():
    pages = {p.resolve() for p in DOCS.glob("*.md")}
    assert len(pages) >= 10, "the documentation pages are missing"
    assert pages <= linked_pages(README), f"not linked from README.md: {sorted(p.name for p in pages - linked_pages(README))}"
    index = DOCS / "index.md"
    assert pages - {index.resolve()} <= linked_pages(index), "index.md does not list every page"


def test_the_toctree_names_every_page():
    yaml = pytest.importorskip("yaml")
    toc = yaml.safe_load((DOCS / "_toctree.yml").read_text())
    local = [entry["local"] for section in toc for entry in section["sections"]]
    assert sorted(local) == sorted(p.stem for p in DOCS.glob("*.md")) and len(set(local)) == len(local)


# ---------------------------------------------------------------- commands


def generate_commands() -> list[list[str]]:
    """Every `swiftspec generate` command line the pages show, alone or after `&&`."""
    commands = []
    for page in PAGES:
        for line in text(page).splitlines():
            command = line.split("&&")[-1].strip()
            if command.startswith("swiftspec generate"):
                commands.append(command.split("#")[0].split())
    return commands


def test_generate_examples_fit_the_demo_pairs_context():
    """The README's `--max-new-tokens 256` example failed: the demo pair's context is 256 tokens, prompt included."""
    from hf_swiftspec.cli import build_parser, check_length, generate_options
    from hf_swiftspec.pair import context_length, resolve_pair

    demo = resolve_pair("swiftspec-demo-pystdlib")
    commands = generate_commands()
    assert ["swiftspec", "generate", "--compare"] in commands  # the README's main job
    assert any("--max-new-tokens" in words for words in commands)
    for words in commands:
        words = ["swiftspec-demo-pystdlib" if w == "ID" else w for w in words[1:] if w != "[PROMPT]"]
        options = generate_options(build_parser().parse_args(words))
        check_length(len(demo.tokenizer(options.prompt).input_ids), options.max_new_tokens,
                     context_length(demo.member_configs["target"]))


def test_ci_runs_exactly_the_readmes_test_command():
    """.ci/run builds its own virtual environment and runs the README's test command in it, verbatim."""
    ci = (ROOT / ".ci" / "run").read_text()
    readme = README.read_text()
    commands = [line for line in readme.splitlines() if line.startswith("pip install") and "pytest" in line]
    assert len(commands) == 1, commands  # the README's one test command
    assert commands[0] in ci.splitlines() and "--index-url" not in commands[0]  # CI finds the CPU wheel on disk
    assert "python3 -m venv" in ci and ci.index("python3 -m venv") < ci.index(commands[0])
    copies = {line for page in PAGES for line in text(page).splitlines() if line.startswith("pip install") and "pytest" in line}
    assert copies == set(commands), f"a page shows another test command than the README's: {copies}"


def test_the_files_ci_reads_exist_and_hold_what_it_reads():
    """.ci/run reads the floor release from the package's compat module with sed: a path that moved makes CI fail
    before any test runs (set -e), and a FLOOR line it cannot find makes the floor step install no release."""
    ci = (ROOT / ".ci" / "run").read_text()
    paths = set(re.findall(r"\b(hf_swiftspec/[\w/]+\.py)\b", ci))
    assert paths, "the floor is read from a module of the package"
    for path in paths:
        assert (ROOT / path).is_file(), f".ci/run reads {path}, which does not exist"
    floor_line = next(line for line in ci.splitlines() if line.startswith("floor=$(sed"))
    module = re.search(r"(hf_swiftspec/[\w/]+\.py)", floor_line).group(1)
    assert re.search(r'^FLOOR = "[0-9.]+"', (ROOT / module).read_text(), flags=re.M), module


def test_the_cpu_build_command_installs_the_torch_every_command_pins():
    """The CPU-build line (PyPI's Linux torch is the CUDA build) names the torch version the install and test
    commands pin, on the README, the installation page and in CI: move the pin on one and this fails."""
    pages = [README, DOCS / "installation.md", ROOT / ".ci" / "run"]
    pins = {version for page in pages for version in re.findall(r"torch==([0-9.]+)", text(page))}
    assert len(pins) == 1, f"torch pinned at {sorted(pins)} across {[name(p) for p in pages]}"
    (pin,) = pins
    cpu = f"pip install torch=={pin} --index-url https://download.pytorch.org/whl/cpu"
    assert cpu in text(DOCS / "installation.md") and cpu in prose(README)


def test_a_plain_model_rejects_swiftspec_with_the_error_generate_md_quotes():
    """generate.md says a plain model rejects swiftspec=True, quoting transformers' error: that is the error."""
    from hf_swiftspec.tools.models import tiny_model

    quoted = re.search(r'rejects it \("([^"]+)"\)', prose(DOCS / "generate.md"))
    assert quoted, "generate.md no longer quotes the error"
    with pytest.raises(ValueError) as error:
        tiny_model("llama").generate(torch.tensor([[5, 6, 7]]), max_new_tokens=2, swiftspec=True)
    assert quoted.group(1) in str(error.value), (quoted.group(1), str(error.value))


def test_cli_md_says_generate_applies_no_chat_template():
    assert "applies no chat template" in prose(DOCS / "cli.md")  # (run_generate tokenizes the prompt as given)


def test_triton_is_an_extra_and_the_package_runs_without_it():
    """Triton installs ~1 GB; only the kernel needs it and the kernel has a torch reference."""
    import subprocess
    import sys
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert not any(dep.startswith("triton") for dep in project["dependencies"])
    assert any(dep.startswith("triton") for dep in project["optional-dependencies"]["gpu"])
    assert any(dep.startswith("triton") for dep in project["optional-dependencies"]["dev"])
    script = (
        "import sys; sys.modules['triton'] = None\n"  # import triton now raises ImportError, as where it is absent
        "import torch; torch.set_num_threads(1)\n"
        "from hf_swiftspec import SwiftSpecForCausalLM\n"
        "from hf_swiftspec.tools.models import tiny_model, truncated_draft\n"
        "target = tiny_model(); ids = torch.tensor([[5, 6, 7]])\n"
        "model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 2), attention='kernel')\n"
        "out = model.generate(ids, max_new_tokens=12, do_sample=False)\n"
        "assert out.tolist() == target.generate(ids, max_new_tokens=12, do_sample=False).tolist()\n"
        "print(model.swiftspec_stats.attention)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "torch-reference" in proc.stdout


def test_the_docs_say_what_exact_means_in_16_bit_and_its_script_runs():
    """Issue 26 item 5: the README promised exact output with no dtype caveat; bfloat16 runs differed."""
    import subprocess
    import sys

    page = DOCS / "generate.md"
    assert "## What \"exact\" means in float32 and in 16-bit" in text(page) and "examples/dtype_divergence.py" in text(page)
    assert "docs/source/en/generate.md#what-exact-means-in-float32-and-in-16-bit" in links(README)
    script = ROOT / "examples" / "dtype_divergence.py"
    proc = subprocess.run([sys.executable, str(script), "--num-prompts", "1", "--max-new-tokens", "6", "--prompts",
                           "humaneval"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "float32: 1/1 prompts identical to target.generate" in proc.stdout and "bfloat16: " in proc.stdout


# ---------------------------------------------------------------- what the pages say of the code


def test_the_settings_table_has_every_setting():
    import inspect

    from hf_swiftspec import SwiftSpecConfig

    members = {"target", "draft", "target_revision", "draft_revision"}  # a pair repo's members, not settings
    fields = set(inspect.signature(SwiftSpecConfig.__init__).parameters) - {"self", "kwargs"} - members
    rows = re.findall(r"^\| `(\w+)` \|", text(DOCS / "settings.md"), flags=re.M)
    assert sorted(rows) == sorted(fields), f"settings.md's table: {sorted(rows)}; SwiftSpecConfig: {sorted(fields)}"


def test_the_architecture_table_is_the_sweeps():
    """The table is written by `python -m hf_swiftspec.tools.sweep --page` (the whole sweep is slow); here its
    rows agree with its own count line, and with transformers' causal-LM types when the release is the one swept."""
    import transformers

    from hf_swiftspec.tools import sweep

    page = DOCS / "architectures.md"
    body = text(page)
    assert body.count(sweep.TABLE_START) == 1 and body.count(sweep.TABLE_END) == 1
    block = body[body.index(sweep.TABLE_START) : body.index(sweep.TABLE_END)]
    count = re.search(r"(\d+) causal-LM types in transformers ([\w.]+): (\d+) tree, (\d+) chain, (\d+) plain, "
                      r"(\d+) refused, (\d+) skipped\.", block)  # fmt: skip
    assert count, "the table lost its coverage line"
    rows = re.findall(r"^\| `([^`]+)` \| (\w+) \|", block, flags=re.M)
    types = [t for t, _ in rows]
    assert types == sorted(types) and len(types) == int(count[1])
    assert [sum(s == status for _, s in rows) for status in ("tree", "chain", "plain", "refused", "skipped")] == [
        int(n) for n in count.groups()[2:]
    ]
    if count[2] == transformers.__version__:
        assert set(types) == set(sweep.causal_lm_types()), "the table is stale: rerun the sweep (architectures.md says how)"
    # generated from the committed sweep, row for row (architectures.md says how to regenerate both)
    assert block[len(sweep.TABLE_START) :].strip() == sweep.markdown_table(sweep.load(sweep.VERDICTS)).strip()


def test_the_sweep_rewrites_the_architecture_page(tmp_path):
    from hf_swiftspec.tools import sweep

    copy = tmp_path / "architectures.md"
    copy.write_text(text(DOCS / "architectures.md"))
    outcome = sweep.Outcome(model_type="llama", status="tree", reason="", tau=3.0, notes="")
    sweep.rewrite_page(copy, [outcome])
    rewritten = copy.read_text()
    assert "| `llama` | tree | tau 3.00 on the tiny sweep |" in rewritten and "| `gpt2` |" not in rewritten
    assert rewritten.startswith(text(DOCS / "architectures.md")[: text(DOCS / "architectures.md").index(sweep.TABLE_START)])


# The README's table of gains, row by row: the results.json behind it and the sets its cells cover.
FIGURE_FILES = {
    "2-core CPU, demo pair, HumanEval": ("examples/results/cpu-demo-pair", ["humaneval"]),
    "2-core CPU, demo pair, Spec-Bench": ("examples/results/cpu-demo-pair", ["spec_bench"]),
    "2-core CPU, demo pair, editing": ("examples/results/cpu-demo-pair", ["editing"]),
    "2-core CPU, `shape:smollm2-135m`, 32 tokens, HumanEval / Spec-Bench": (
        "examples/results/cpu-smollm2-135m-32", ["humaneval", "spec_bench"]),
    "one NVIDIA H200, demo pair, HumanEval": ("examples/gpu_results/h200-2026-11-27/bench_demo_run4.json", ["humaneval"]),
    "one NVIDIA H200, demo pair, Spec-Bench": ("examples/gpu_results/h200-2026-11-27/bench_demo_run4.json", ["spec_bench"]),
}
FIGURE_COLUMNS = ["target_static", "assisted", "prompt_lookup", "swiftspec_serial"]


def test_readme_figures_are_the_result_files():
    """Every speed-up in the README's table is the mean of the committed results.json it names (rounded
    as shown), a "–" where that run had no such method; each CPU result directory keeps the command
    that made it, and that command wrote to the same directory."""
    import json

    root = README.parent
    rows = {cells[0]: cells[1:] for cells in (
        [c.strip() for c in line.strip("|").split("|")] for line in README.read_text().splitlines()
        if line.startswith("| 2-core CPU") or line.startswith("| one NVIDIA H200")
    )}
    assert set(rows) == set(FIGURE_FILES), set(rows) ^ set(FIGURE_FILES)
    for label, (where, sets) in FIGURE_FILES.items():
        path = root / where
        if path.is_dir():
            assert f"--out {where} " in (path / "command.txt").read_text() + " ", label
            path = path / "results.json"
        report = json.loads(path.read_text())
        by_set = {s["name"]: {m["name"]: m for m in s["batches"][0]["methods"]} for s in report["sets"]}
        for method, cell in zip(FIGURE_COLUMNS, rows[label]):
            shown = [v.strip().strip("*").rstrip("x") for v in cell.split("/")]
            if shown == ["–"]:
                assert all(method not in by_set[s] or by_set[s][method]["status"] != "ok" for s in sets), (label, method)
                continue
            assert len(shown) == len(sets), (label, method, cell)
            for name, value in zip(sets, shown):
                result = by_set[name][method]
                assert result["status"] == "ok" and f"{result['speedup']['mean']:.2f}" == value, (label, name, method, value)


SERVING_FILES = {  # column: (results directory, the pair its output names)
    "demo pair": ("examples/results/cpu-serve-load-demo", "swiftspec-demo-pystdlib"),
    "`shape:smollm2-135m`": ("examples/results/cpu-serve-load-smollm2-135m", "shape:smollm2-135m"),
}


PREFIX_FILES = ("examples/results/cpu-serve-prefix-smollm2-135m", "examples/results/cpu-serve-prefix-demo")  # reuse on/off


def serve_ratios(output: str) -> dict[int, tuple[str, str]]:
    """examples/serve_latency.py's table: per client count, swiftspec's (p50 lower by, tokens/s) ratios."""
    rows, columns = {}, []
    for line in output.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[:2] == ["clients", "server"]:  # its header (later tables have TTFT and ITL columns too)
            columns = cells
        elif len(cells) == len(columns) and cells[1] == "swiftspec serve":
            row = dict(zip(columns, cells))
            rows[int(cells[0])] = (row["p50 ratio"].removesuffix(" lower"), row["speed-up (tokens/s)"])
    return rows


def test_the_serving_tables_are_the_output_files():
    """The README's serving table is serve_latency.py's ratios in the committed outputs (made by the command
    beside each); serving.md shows each output's table as it came."""
    root = README.parent
    header, _, *lines = [line for line in README.read_text().split("## Serving")[1].splitlines() if line.startswith("|")]
    columns = [c.strip() for c in header.strip("|").split("|")][1:]
    outputs = {label: (root / where / "output.txt").read_text() for label, (where, _) in SERVING_FILES.items()}
    assert [c.rsplit(":", 1)[0] for c in columns] == list(SERVING_FILES)
    shown = {int(cells[0]): cells[1:] for cells in ([c.strip() for c in line.strip("|").split("|")] for line in lines)}
    for i, label in enumerate(SERVING_FILES):
        ratios = serve_ratios(outputs[label])
        assert sorted(ratios) == sorted(shown) == [1, 2, 4, 8, 16, 32]
        assert {n: cells[i] for n, cells in shown.items()} == {n: ", ".join(r) for n, r in ratios.items()}, label
        where, pair = SERVING_FILES[label]
        command = (root / where / "command.txt").read_text()
        assert command.removeprefix("OMP_NUM_THREADS=1 ").startswith("python examples/serve_latency.py --target-cb --swiftspec-cb")
        assert outputs[label].startswith(f"{pair}: ") and (pair in command or "--pair" not in command)
    page = text(DOCS / "serving.md")
    prefixes = [(root / where / "output.txt").read_text() for where in PREFIX_FILES]
    for output in [*outputs.values(), *prefixes]:
        assert output.strip().split("\n", 1)[1] in page



def test_how_it_works_names_every_module_of_the_decoder_and_nothing_else():
    """The map stays true by itself: every module of the decoder (the top, engine/, drafters/, policy/, steps/,
    models/) is named on how_it_works.md, and every module the page names exists (the page quotes no figures about
    them that the code would have to keep up with)."""
    page = text(DOCS / "how_it_works.md")
    package = README.parent / "hf_swiftspec"
    named = set(re.findall(r"`((?:[\w]+/)*[\w]+\.py)", page))
    for name in named:
        exists = (package / name).exists() or (README.parent / name).exists() or (
            "/" not in name and any(package.rglob(name)))  # a bare name beside its folder's
        assert exists, f"how_it_works.md names {name}, which does not exist"
    decoder = [p for folder in ("", "engine", "drafters", "policy", "steps", "models")
               for p in sorted((package / folder).glob("*.py")) if p.name not in ("__init__.py", "__main__.py")]
    missing = [str(p.relative_to(package)) for p in decoder
               if str(p.relative_to(package)) not in named and p.name not in named]
    assert not missing, f"how_it_works.md does not name {missing}"
    assert not re.search(r"`[\w/]+\.py` \(\d+\)", page), "the page quotes line counts again (they drift)"