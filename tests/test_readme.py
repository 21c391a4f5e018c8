"""The README's Python blocks run as pasted (a block starting `# requires: two GPUs` only where there are)."""

import re
from pathlib import Path

import torch

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


def test_readme_python_blocks_run(capsys):
    threads = torch.get_num_threads()
    namespace: dict = {}
    try:
        for block in BLOCKS:
            if block.startswith("# requires: two GPUs") and torch.cuda.device_count() < 2:
                continue
            exec(compile(block, str(README), "exec"), namespace)
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "def read_config(path):" in printed and "import os" in printed and "tau=" in printed
    assert namespace["model"].swiftspec_stats.new_tokens > 0

