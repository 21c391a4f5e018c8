"""The bundled `editing` prompt set: requests whose answers repeat text the prompt already holds.

Where code is edited, files re-read or earlier answers quoted, most of the output is a copy, and a
suffix proposal can take whole lines at a time. Three kinds, taken round-robin so any first-N
slice holds all of them, built from small functions of Python's standard library:

    rename     "Rewrite this function with one name changed", the function, the start of the rewrite
    copy       a few functions of a module, then a marker and the first line of their copy
    multiturn  a chat that showed two functions, asking for the first one again

    python -m hf_swiftspec.bench.editing   # rewrites data/prompts/editing.jsonl

The file is shipped (built from CPython 3.11's sources, PSF licence: LICENSE-PSF), so every machine
benchmarks the same prompts whatever its Python; prompts stay under ~600 characters, so they fit
small models' contexts (the demo pair's is 256 tokens) beside the generated tokens.
"""

from __future__ import annotations

import ast
import json
import re
import sysconfig
from pathlib import Path

from .prompts import PROMPTS_DIR

MODULES = ("textwrap", "shlex", "fnmatch", "posixpath", "glob", "colorsys", "bisect", "heapq", "base64",
           "calendar", "keyword", "string", "genericpath", "linecache", "tokenize", "difflib", "gettext", "quopri",
           "copy", "operator", "random", "statistics", "ntpath", "os", "inspect", "functools")
PER_KIND = 8
MAX_CHARS = 300  # one function; a prompt holds one or two, plus a little text
MAX_PROMPT_CHARS = 470  # ~190 tokens of the demo pair's BPE: its 256-token context keeps 64 for the output


def stdlib_functions(max_chars: int = MAX_CHARS) -> list[tuple[str, ast.FunctionDef, str]]:
    """(module, node, source) of the top-level functions of MODULES with 120..max_chars characters of source."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for module in MODULES:
        text = (root / f"{module}.py").read_text(encoding="utf-8")
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                source = ast.get_source_segment(text, node)
                if source and 120 <= len(source) <= max_chars:
                    found.append((module, node, source))
    return found


def renamed(source: str, node: ast.FunctionDef) -> tuple[str, str, str] | None:
    """(old, new, rewritten source) with the function's first argument renamed, or None."""
    args = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
    if not args:
        return None
    old = args[0]
    new = f"new_{old}"
    return old, new, re.sub(rf"\b{re.escape(old)}\b", new, source)


def editing_records() -> list[dict]:
    functions = stdlib_functions()
    rename, copy, multiturn = [], [], []
    for i, (module, node, source) in enumerate(functions):
        change = renamed(source, node)
        if change is not None and len(rename) < PER_KIND and 2 * len(source) <= MAX_PROMPT_CHARS - 60:
            old, new, rewritten = change
            first = rewritten.splitlines()[0]
            rename.append(("rename", f"{module}.{node.name}", (
                f"Rewrite this function with `{old}` renamed to `{new}`; change nothing else.\n\n{source}\n\n"
                f"Rewritten:\n{first}\n"
            )))
        if i % 2 == 0 and len(copy) < PER_KIND and i + 1 < len(functions) and functions[i + 1][0] == module:
            pair = f"{source}\n\n\n{functions[i + 1][2]}"
            if len(pair) <= MAX_PROMPT_CHARS - 120:
                copy.append(("copy", f"{module}.{node.name}", (
                    f"# {module}.py (excerpt)\n{pair}\n\n\n# {module}.py (excerpt), copied unchanged\n"
                    f"{source.splitlines()[0]}\n"
                )))
        if i % 3 == 1 and len(multiturn) < PER_KIND and i + 1 < len(functions):
            other = functions[i + 1]
            if len(source) + len(other[2]) <= MAX_PROMPT_CHARS - 160:
                multiturn.append(("multiturn", f"{module}.{node.name}", (
                    f"User: Show me {module}.{node.name}.\nAssistant:\n{source}\n\n"
                    f"User: And {other[0]}.{other[1].name}?\nAssistant:\n{other[2]}\n\n"
                    f"User: Show me {module}.{node.name} again, exactly as before.\nAssistant:\n"
                )))
    records = []
    for group in zip(rename, copy, multiturn):
        for kind, source, text in group:
            records.append({"question_id": len(records), "category": kind, "source": source, "turns": [text]})
    return records


def main() -> None:
    path = PROMPTS_DIR / "editing.jsonl"
    records = editing_records()
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(f"wrote {len(records)} prompts to {path}")


if __name__ == "__main__":
    main()
