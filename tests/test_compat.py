"""hf_swiftspec.models.compat: the one place that knows transformers' changing internals.

These run on whatever transformers is installed (CI: the newest release for the whole suite, the
floor release for a smoke set), so each asserts what must hold on every tested release.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import transformers

from hf_swiftspec import SwiftSpecForCausalLM, compat
from hf_swiftspec.models.compat import (
    CACHE_ARGUMENTS,
    UnsupportedTransformersError,
    cache_argument,
    check_release,
    forward_cache_argument,
    output_cache,
    release_problem,
)
from hf_swiftspec.tools.models import tiny_model, truncated_draft

PACKAGE = Path(__file__).resolve().parents[1] / "hf_swiftspec"
pytestmark = pytest.mark.floor  # CI runs this module on the floor release too


def test_the_installed_release_is_in_the_tested_range():
    assert release_problem(transformers.__version__) is None, transformers.__version__


@pytest.mark.parametrize("version", [compat.FLOOR + ".0", compat.NEWEST + ".0", compat.NEWEST + ".3", compat.NEWEST + ".0.dev0"])
def test_patch_releases_of_tested_minors_are_in(version):
    assert release_problem(version) is None


def test_a_release_outside_the_range_fails_naming_both(monkeypatch):
    monkeypatch.delenv(compat.UNTESTED_ENV, raising=False)
    newer = f"{compat.next_minor()}.0"
    with pytest.raises(UnsupportedTransformersError) as error:
        check_release(newer)
    message = str(error.value)
    assert newer in message and compat.FLOOR in message and compat.NEWEST in message and compat.UNTESTED_ENV in message
    assert "unsupported" not in message.lower().replace("unsupportedtransformers", "")  # not "this model is unsupported"
    with pytest.raises(UnsupportedTransformersError, match="older than"):
        check_release("5.0.0")


def test_an_untested_release_can_be_tried_with_a_warning(monkeypatch):
    monkeypatch.setenv(compat.UNTESTED_ENV, "1")
    with pytest.warns(UserWarning, match="newer than the newest release"):
        check_release(f"{compat.next_minor()}.0")


def test_a_missing_internal_names_the_installed_and_tested_releases():
    with pytest.raises(UnsupportedTransformersError) as error:
        compat.internal("cache_utils", "NoSuchCacheClass")
    message = str(error.value)
    assert "transformers.cache_utils.NoSuchCacheClass" in message and transformers.__version__ in message
    assert compat.FLOOR in message and compat.NEWEST in message and "pip install" in message


def test_the_cache_argument_is_read_from_the_signature():
    """Newest name first: a forward that takes both gets `cache` (the old name warns in 5.24)."""

    def new(input_ids=None, cache=None, past_key_values=None): ...
    def old(input_ids=None, past_key_values=None): ...
    def mamba(input_ids=None, cache_params=None): ...
    def none(input_ids=None): ...

    assert [cache_argument(f) for f in (new, old, mamba, none)] == ["cache", "past_key_values", "cache_params", None]


def test_the_installed_models_take_the_name_compat_gives():
    """On 5.24+ every attention model's forward takes `cache`; on 5.23 `past_key_values`."""
    model = tiny_model(seed=0)
    name = forward_cache_argument(type(model))
    expected = "cache" if compat.Version(transformers.__version__) >= compat.Version("5.24.0.dev0") else "past_key_values"
    assert name == expected and name in CACHE_ARGUMENTS
    out = model(input_ids=torch.tensor([[1, 2, 3]]), use_cache=True)
    assert isinstance(output_cache(out), compat.Cache)


def test_our_calls_raise_no_future_warning():
    """5.24 renamed past_key_values to cache with a FutureWarning until 5.40: none may come from our calls."""
    target = tiny_model(seed=0)
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1), tree_budget=4, draft_depth=2)
    ids = torch.tensor([[3, 9, 4, 11, 5]])
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        warnings.simplefilter("error", DeprecationWarning)
        out = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    assert torch.equal(out, target.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False))


def test_only_compat_imports_transformers_internals():
    """The rest of the package imports transformers' public names only; internals come from compat."""
    public = {"transformers", "transformers.utils"}  # utils.logging is documented API
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("transformers"):
                if node.module not in public:
                    offenders.append(f"{path.relative_to(PACKAGE)}: from {node.module} import ...")
            elif isinstance(node, ast.Import):
                offenders += [f"{path.relative_to(PACKAGE)}: import {a.name}" for a in node.names
                              if a.name.startswith("transformers.")]  # fmt: skip
    assert not offenders, offenders


IMPORT_SCRIPT = textwrap.dedent(
    """
    import json
    import huggingface_hub, transformers
    from transformers.utils import hub
    watched = {
        "transformers.utils.hub.cached_files": lambda: hub.cached_files,
        "transformers.utils.hub.cached_file": lambda: hub.cached_file,
        "transformers.utils.hub._hf_api": lambda: getattr(hub, "_hf_api", None),
        "huggingface_hub.hf_hub_download": lambda: huggingface_hub.hf_hub_download,
        "huggingface_hub.snapshot_download": lambda: huggingface_hub.snapshot_download,
        "huggingface_hub.HfApi": lambda: huggingface_hub.HfApi,
    }
    before = {name: id(get()) for name, get in watched.items()}
    import hf_swiftspec
    from hf_swiftspec import SwiftSpecForCausalLM
    model = SwiftSpecForCausalLM.from_pretrained("swiftspec-demo-pystdlib")
    after = {name: id(get()) for name, get in watched.items()}
    print("RESULT " + json.dumps(sorted(name for name in watched if before[name] != after[name])))
    """
)


def test_import_and_bundled_loading_replace_nothing_of_transformers_or_the_hub(tmp_path):
    """Issue 25 item 5: `import hf_swiftspec` used to replace transformers' cached_files and its HfApi for the
    whole process; loading a bundled pair must leave every one of them as it was."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run([sys.executable, "-c", IMPORT_SCRIPT], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.split("RESULT ", 1)[1]) == []


def test_pyproject_allows_exactly_the_tested_releases():
    """The range pip installs is compat's: from FLOOR up to, not including, the minor after NEWEST."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())["project"]
    (spec,) = [d for d in project["dependencies"] if d.startswith("transformers")]
    assert spec.replace(" ", "") == f"transformers>={compat.FLOOR},<{compat.next_minor()}"
