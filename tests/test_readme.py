"""The README's Python blocks run as pasted (a block starting `# requires: two GPUs` only where there are)."""

import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


def test_readme_python_blocks_run(capsys):
    """Each block runs alone, as pasted into a fresh interpreter (none continues another's names)."""
    threads = torch.get_num_threads()
    models = []
    try:
        for block in BLOCKS:
            if block.startswith("# requires: two GPUs") and torch.cuda.device_count() < 2:
                continue
            namespace: dict = {}
            exec(compile(block, str(README), "exec"), namespace)
            models += [v for v in namespace.values() if type(v).__name__ == "SwiftSpecForCausalLM"]
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "def read_config(path):" in printed and "import os" in printed and "tau=" in printed
    assert models and all(m.swiftspec_stats is not None and m.swiftspec_stats.new_tokens > 0 for m in models)



COMMANDS = [line.split("#")[0].split() for line in README.read_text().splitlines() if line.startswith("swiftspec generate")]


def test_readme_generate_examples_fit_the_demo_pairs_context():
    """The README's `--max-new-tokens 256` example failed: the demo pair's context is 256 tokens, prompt included."""
    from hf_swiftspec.cli import build_parser, check_length, generate_options
    from hf_swiftspec.pair import context_length, resolve_pair

    demo = resolve_pair("swiftspec-demo-pystdlib")
    assert COMMANDS and any("--max-new-tokens" in words for words in COMMANDS)
    for words in COMMANDS:
        words = ["swiftspec-demo-pystdlib" if w == "ID" else w for w in words[1:] if w != "[PROMPT]"]
        options = generate_options(build_parser().parse_args(words))
        check_length(len(demo.tokenizer(options.prompt).input_ids), options.max_new_tokens,
                     context_length(demo.member_configs["target"]))


def test_ci_runs_exactly_the_readmes_test_command():
    """.ci/run builds its own virtual environment and runs the README's test command in it, verbatim."""
    ci = (README.parent / ".ci" / "run").read_text()
    readme = README.read_text()
    commands = [line for line in readme.splitlines() if line.startswith("pip install") and "pytest" in line]
    assert len(commands) == 1, commands  # the README's one test command
    assert commands[0] in ci.splitlines() and "--index-url" not in commands[0]  # CI finds the CPU wheel on disk
    assert "python3 -m venv" in ci and ci.index("python3 -m venv") < ci.index(commands[0])


def test_readme_says_how_to_get_the_cpu_build_and_what_generate_does_not_do():
    text = README.read_text()
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in text
    assert "applies no\nchat template" in text or "applies no chat template" in text
    assert "rejects it" in text and "['swiftspec']" in text


def test_triton_is_an_extra_and_the_package_runs_without_it():
    """Triton installs ~1 GB; only the kernel needs it and the kernel has a torch reference."""
    import subprocess
    import sys
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]
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


def test_the_readme_says_what_exact_means_in_16_bit_and_its_script_runs():
    """Issue 26 item 5: the README promised exact output with no dtype caveat; bfloat16 runs differed."""
    import subprocess
    import sys

    text = README.read_text()
    assert "### What \"exact\" means in float32 and in 16-bit" in text and "examples/dtype_divergence.py" in text
    script = README.parent / "examples" / "dtype_divergence.py"
    proc = subprocess.run([sys.executable, str(script), "--num-prompts", "1", "--max-new-tokens", "6", "--prompts",
                           "humaneval"], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "float32: 1/1 prompts identical to target.generate" in proc.stdout and "bfloat16: " in proc.stdout
