"""The package's layers: no import cycle (module-level, inside functions, or for annotations only under
TYPE_CHECKING: a reader follows those too), and the decoder never imports the tools around it
(hf_swiftspec.tools, the bench, the command line, serving)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hf_swiftspec"
# What only tools, benches and the command line use; the decoder (everything else) must not import them.
OUTSIDE_THE_DECODER = ("hf_swiftspec.tools", "hf_swiftspec.bench", "hf_swiftspec.cli", "hf_swiftspec.serving")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str) -> set[str]:
    """The package's modules that `name` imports anywhere in its code (functions included)."""
    path = MODULES[name]
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            candidates = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Import):
            candidates = [alias.name for alias in node.names]
        else:
            continue
        found |= {c for c in candidates if c in MODULES and c != name}
    return found


GRAPH = {name: imports(name) for name in MODULES}


def cycle_through(start: str, graph: dict[str, set[str]] = GRAPH) -> list[str] | None:
    """A path of imports in `graph` from `start` back to itself, or None."""
    stack, seen = [(start, [start])], set()
    while stack:
        node, path = stack.pop()
        for nxt in sorted(graph.get(node, ())):
            if nxt == start:
                return path + [start]
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def test_no_import_cycle():
    cycles = [cycle for name in sorted(MODULES) if (cycle := cycle_through(name))]
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def part(name: str) -> str:
    """The package a module belongs to (hf_swiftspec.engine.rounds: hf_swiftspec.engine); a module at the top
    is a part of its own."""
    return ".".join(name.split(".")[:2])


PARTS = {}
for _name, _targets in GRAPH.items():
    PARTS.setdefault(part(_name), set()).update(part(t) for t in _targets if part(t) != part(_name))


def test_no_import_cycle_between_packages():
    """No two packages import each other, even through modules whose own imports hold no cycle (a module of
    the command line importing the bench while a module of the bench imports another of the command line)."""
    cycles = [cycle for name in sorted(PARTS) if (cycle := cycle_through(name, PARTS))]
    assert not cycles, "import cycles between packages:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_decoder_imports_no_tools():
    decoder = [name for name in MODULES if not name.startswith(OUTSIDE_THE_DECODER)]
    offenders = {name: sorted(t for t in GRAPH[name] if t.startswith(OUTSIDE_THE_DECODER)) for name in decoder}
    assert not {k: v for k, v in offenders.items() if v}, offenders


def test_architectures_runs_no_model():
    """What a model can do from its config and classes is apart from the probes that run it."""
    assert not GRAPH["hf_swiftspec.models.architectures"] & {
        "hf_swiftspec.steps.step", "hf_swiftspec.steps.attention", "hf_swiftspec.steps.recurrent", "hf_swiftspec.engine.workers",
        "hf_swiftspec.steps.probes", "hf_swiftspec.steps.cache", "hf_swiftspec.drafters.draft_model",
    }
