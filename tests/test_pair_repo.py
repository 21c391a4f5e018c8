"""Pair repos: offline Hub resolution, round trips, model cards, and clear errors for bad pairs."""

import json
import logging
import os
import subprocess
import sys
import textwrap
import tomllib
import types
from pathlib import Path

import pytest
import torch
import yaml
from tokenizers import Tokenizer, decoders, models
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from hf_swiftspec import SwiftSpecForCausalLM
from hf_swiftspec.pair import (
    DEMO_PAIR_NAME,
    PairCard,
    PairConfigError,
    bundled_pair,
    bundled_pairs_dir,
    check_pair_files,
    create_pair_repo,
    member_description,
    read_card_metadata,
    resolve_pair,
)
from hf_swiftspec.cli import main
from hf_swiftspec.pair.loading import accelerator_available, device_map_on_cpu, with_cpu_dtype
from hf_swiftspec.pair.locate import pair_members
from hf_swiftspec.tools.models import CHAR_SPECIALS, char_tokenizer, tiny_model, truncated_draft
from pair_helpers import local_pair, save_member, tiny_members, word_tokenizer, write_cached_repo

TARGET_SHA = "1" * 40
DRAFT_SHA = "2" * 40
PAIR_SHA = "3" * 40


def greedy(model, ids, n=16, **kwargs):
    return model.generate(ids, max_new_tokens=n, do_sample=False, **kwargs).tolist()


def edit_config(folder: Path, **changes) -> Path:
    path = folder / "config.json"
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is ...:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))
    return folder


# ---------------------------------------------------------------- offline Hub resolution


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """HF_HOME with org/tiny-target, org/tiny-draft and the pair org/tiny-pair in its cache, all pinned."""
    root = tmp_path_factory.mktemp("hub")
    target_dir, draft_dir = tiny_members(root / "src")
    pair_dir = root / "src" / "pair"
    model = SwiftSpecForCausalLM.from_models(  # a fixed tree: its acceptance (tau) follows no clock, the policy's would
        AutoModelForCausalLM.from_pretrained(target_dir), AutoModelForCausalLM.from_pretrained(draft_dir),
        tokenizer=char_tokenizer(), tree_budget=4, draft_depth=2,
    )
    model.config.update(dict(target="org/tiny-target", target_revision=TARGET_SHA, draft="org/tiny-draft", draft_revision=DRAFT_SHA))
    model.save_pretrained(pair_dir, pin_revisions=False, load_id="org/tiny-pair")
    cache = root / "home" / "hub"
    write_cached_repo(cache, "org/tiny-target", target_dir, TARGET_SHA)
    write_cached_repo(cache, "org/tiny-draft", draft_dir, DRAFT_SHA)
    write_cached_repo(cache, "org/tiny-pair", pair_dir, PAIR_SHA)
    bad = edit_config(pair_dir, draft_revision="f" * 40)
    write_cached_repo(cache, "org/pair-bad-revision", bad, PAIR_SHA)
    return root / "home"


OFFLINE_SCRIPT = textwrap.dedent(
    """
    import json, torch
    torch.set_num_threads(1)
    from transformers import AutoModelForCausalLM, pipeline
    from hf_swiftspec import SwiftSpecForCausalLM
    from hf_swiftspec.pair import PairConfigError

    ids = torch.tensor([[10, 20, 30, 40]])
    kw = dict(max_new_tokens=16, do_sample=False)
    target = AutoModelForCausalLM.from_pretrained("org/tiny-target", revision="%(target_sha)s")
    expected = target.generate(ids, **kw).tolist()
    result = {}
    ours = SwiftSpecForCausalLM.from_pretrained("org/tiny-pair")
    result["from_pretrained"] = ours.generate(ids, swiftspec=True, **kw).tolist() == expected
    result["tau"] = ours.swiftspec_stats.tau
    pinned = SwiftSpecForCausalLM.from_pretrained("org/tiny-pair", revision="%(pair_sha)s")
    result["pair_revision"] = pinned.generate(ids, **kw).tolist() == expected
    auto = AutoModelForCausalLM.from_pretrained("org/tiny-pair")
    result["auto_class"] = type(auto).__name__
    result["auto"] = auto.generate(ids, **kw).tolist() == expected
    pipe = pipeline("text-generation", model="org/tiny-pair")
    text = pipe("def f(x):", max_new_tokens=16, do_sample=False)[0]["generated_text"]
    ref = pipeline("text-generation", model=target, tokenizer=pipe.tokenizer)("def f(x):", max_new_tokens=16, do_sample=False)
    result["pipeline"] = text == ref[0]["generated_text"]
    result["pipeline_speculated"] = pipe.model.swiftspec_stats is not None
    for name in ("org/pair-bad-revision", "org/not-cached"):
        try:
            SwiftSpecForCausalLM.from_pretrained(name)
            result[name] = "loaded"
        except PairConfigError as err:
            result[name] = str(err)
    print("RESULT " + json.dumps(result))
    """
)


def test_pair_loads_by_hub_id_offline(hub_home):
    env = {**os.environ, "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("HF_HUB_CACHE", None)
    script = OFFLINE_SCRIPT % dict(target_sha=TARGET_SHA, pair_sha=PAIR_SHA)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert result["from_pretrained"] and result["pair_revision"] and result["auto"] and result["pipeline"]
    assert result["auto_class"] == "SwiftSpecForCausalLM" and result["pipeline_speculated"]
    assert result["tau"] > 1.0
    assert "draft_revision" in result["org/pair-bad-revision"] and "f" * 40 in result["org/pair-bad-revision"]
    assert "org/not-cached" in result["org/not-cached"] and "Hugging Face cache" in result["org/not-cached"]


BUNDLED_NO_NETWORK_SCRIPT = textwrap.dedent(
    """
    import json, torch
    torch.set_num_threads(1)
    from huggingface_hub.utils import get_session
    requests = []
    client = type(get_session())
    send = client.send
    def counted(self, request, *args, **kwargs):
        requests.append(str(request.url))
        return send(self, request, *args, **kwargs)
    client.send = counted
    import hf_swiftspec
    from hf_swiftspec import SwiftSpecForCausalLM
    from hf_swiftspec.pair import bundled_pair
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline
    folder = bundled_pair("swiftspec-demo-pystdlib")  # transformers' loaders take the bundled folder
    pipe = pipeline("text-generation", model=folder)
    text = pipe("import os\\n", max_new_tokens=8, do_sample=False)[0]["generated_text"]
    AutoTokenizer.from_pretrained(folder)
    AutoModelForCausalLM.from_pretrained(folder)
    SwiftSpecForCausalLM.from_pretrained("swiftspec-demo-pystdlib")  # hf_swiftspec's own loader takes the name
    print("RESULT " + json.dumps(dict(requests=requests, text=text)))
    """
)


def test_a_bundled_pair_never_touches_the_network(tmp_path):
    """pipeline(model=<bundled pair>) with no network and no HF_HUB_OFFLINE took 46 s of Hub retries."""
    import socket

    with socket.socket() as sock:  # a port nothing listens on: any Hub request is refused at once
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE")}
    env.update(HF_ENDPOINT=f"http://127.0.0.1:{port}", HF_HOME=str(tmp_path / "hf"), TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, "-c", BUNDLED_NO_NETWORK_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=40, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    # no request at all (a refused one is counted too): what the 46 s of retries were, without timing them
    assert result["requests"] == [] and result["text"].startswith("import os\n")


def test_hub_arguments_reach_the_pair_and_both_members(hub_home):
    """cache_dir + local_files_only instead of environment variables, in this process."""
    model = SwiftSpecForCausalLM.from_pretrained("org/tiny-pair", cache_dir=hub_home / "hub", local_files_only=True)
    assert model.config.draft_revision == DRAFT_SHA and model.target.config.num_hidden_layers == 3
    with pytest.raises(PairConfigError, match="org/tiny-pair"):
        SwiftSpecForCausalLM.from_pretrained("org/tiny-pair", cache_dir=hub_home / "elsewhere", local_files_only=True)


def test_missing_member_names_the_field(tmp_path):
    pair = edit_config(local_pair(tmp_path), draft="org/absent-draft")
    with pytest.raises(PairConfigError, match="field 'draft'='org/absent-draft'"):
        SwiftSpecForCausalLM.from_pretrained(pair, local_files_only=True)


def pickled_only(member: Path) -> None:
    """The member's weights as pytorch_model.bin alone, as older checkpoints ship them."""
    torch.save(AutoModelForCausalLM.from_pretrained(member).state_dict(), member / "pytorch_model.bin")
    for weights in member.glob("*.safetensors"):
        weights.unlink()


def test_a_member_shipped_only_as_pickle_is_refused_naming_the_file_and_the_fix(tmp_path):
    """Refused before any weights load (resolve_pair reads configs and tokenizers only); the fix it names works."""
    pair = local_pair(tmp_path)
    pickled_only(tmp_path / "draft")
    fix = r"pair members load as safetensors only.*save_pretrained\(folder\) writes model\.safetensors; then name that folder"
    with pytest.raises(PairConfigError, match=r"The draft from field 'draft'='\.\./draft' ships its weights only as pytorch_model\.bin: " + fix):
        resolve_pair(pair)
    AutoModelForCausalLM.from_pretrained(tmp_path / "draft").save_pretrained(tmp_path / "draft")
    model = SwiftSpecForCausalLM.from_pretrained(pair)
    ids = torch.tensor([[11, 12, 13]])
    assert greedy(model, ids) == greedy(model.target, ids)


def test_a_hub_member_without_safetensors_is_refused_naming_the_fix(tmp_path):
    """A Hub member's files are not listed before loading: its load error is reworded (from the cache, offline)."""
    pair = local_pair(tmp_path)
    pickled_only(tmp_path / "draft")
    write_cached_repo(tmp_path / "hub", "org/pickled-draft", tmp_path / "draft", DRAFT_SHA)
    edit_config(pair, draft="org/pickled-draft", draft_revision=DRAFT_SHA)
    with pytest.raises(PairConfigError, match=r"The draft from field 'draft'='org/pickled-draft' has no safetensors weights.*"
                                              r"load as safetensors only.*save_pretrained\(folder\) writes model\.safetensors"):
        SwiftSpecForCausalLM.from_pretrained(pair, cache_dir=tmp_path / "hub", local_files_only=True)


def test_a_member_with_code_of_its_own_needs_trust_remote_code(tmp_path):
    """A member whose config.json maps AutoConfig to a class in its own folder: refused, naming the class and
    trust_remote_code=True, which then loads it (its model class is the folder's)."""
    pair = local_pair(tmp_path)
    target = tmp_path / "target"
    (target / "configuration_tiny.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass TinyConfig(LlamaConfig):\n    model_type = 'tiny_custom'\n"
    )
    (target / "modeling_tiny.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_tiny import TinyConfig\n\n\n"
        "class TinyForCausalLM(LlamaForCausalLM):\n    config_class = TinyConfig\n"
    )
    auto_map = {"AutoConfig": "configuration_tiny.TinyConfig", "AutoModelForCausalLM": "modeling_tiny.TinyForCausalLM"}
    edit_config(target, model_type="tiny_custom", auto_map=auto_map)
    with pytest.raises(PairConfigError, match=r"The target from field 'target'='\.\./target' is a model of its own code "
                                              r"\(configuration_tiny\.TinyConfig, in .*target\), which runs only with "
                                              r"trust_remote_code=True: pass it to from_pretrained"):
        SwiftSpecForCausalLM.from_pretrained(pair)
    model = SwiftSpecForCausalLM.from_pretrained(pair, trust_remote_code=True)
    assert type(model.target).__name__ == "TinyForCausalLM"
    ids = torch.tensor([[11, 12, 13]])
    assert greedy(model, ids) == greedy(model.target, ids)


# ---------------------------------------------------------------- round trip and model card


def test_save_then_load_reproduces_the_pair(tmp_path):
    pair = local_pair(tmp_path, tree_budget=6, draft_width=4, draft_depth=3)
    loaded = SwiftSpecForCausalLM.from_pretrained(pair)
    again = tmp_path / "elsewhere" / "pair"
    loaded.save_pretrained(again, card=PairCard(title="Tiny pair", license="apache-2.0", tags=("test",)))
    reloaded = SwiftSpecForCausalLM.from_pretrained(again)
    for name in ("tree_budget", "draft_width", "draft_depth", "tree_capacity", "swiftspec_default", "placement"):
        assert getattr(reloaded.config, name) == getattr(loaded.config, name)
    for role in ("target", "draft"):  # relative entries were rewritten, so both name the same folders
        assert (again / getattr(reloaded.config, role)).resolve() == (tmp_path / role).resolve()
    ids = torch.tensor([[7, 8, 9, 10]])
    assert greedy(reloaded, ids) == greedy(loaded.target, ids) == greedy(loaded, ids)
    meta = yaml.safe_load((again / "README.md").read_text().split("---\n")[1])
    assert meta["library_name"] == "hf_swiftspec" and meta["pipeline_tag"] == "text-generation"
    assert meta["license"] == "apache-2.0" and {"swiftspec", "test"} <= set(meta["tags"])
    assert "base_model" not in meta  # local members are no Hub models
    check_pair_files(again)
    assert reloaded.tokenizer is not None and reloaded.tokenizer.get_vocab() == char_tokenizer().get_vocab()
    written = json.loads((again / "tokenizer_config.json").read_text())
    assert not {"is_local", "local_files_only"} & set(written), "loader arguments leaked into the saved tokenizer"


def test_a_saved_copy_keeps_absolute_members_and_loads_after_a_move(tmp_path):
    """A pair naming its target by absolute path, its draft inside its own folder (distill's layout), saved
    elsewhere: the copy names both by absolute path (the draft no longer travels with it), so moved deeper it still
    loads and decodes as target.generate. Re-saved in place, the member inside stays relative."""
    target_dir, draft_dir = tiny_members(tmp_path / "models")
    pair = tmp_path / "pair"
    pair.mkdir()
    draft_dir.rename(pair / "draft")
    create_pair_repo(pair, str(target_dir), str(pair / "draft"))
    edit_config(pair, target=str(target_dir.resolve()))
    loaded = SwiftSpecForCausalLM.from_pretrained(pair)
    loaded.save_pretrained(pair)  # in place: the draft is inside the folder written, and stays named relative to it
    in_place = json.loads((pair / "config.json").read_text())
    assert (in_place["target"], in_place["draft"]) == (str(target_dir.resolve()), "draft")
    loaded.config.tree_budget = 5
    loaded.save_pretrained(tmp_path / "copy")
    written = json.loads((tmp_path / "copy" / "config.json").read_text())
    assert (written["target"], written["draft"]) == (str(target_dir.resolve()), str((pair / "draft").resolve()))
    moved = tmp_path / "elsewhere" / "deeper" / "copy"
    moved.parent.mkdir(parents=True)
    (tmp_path / "copy").rename(moved)
    again = SwiftSpecForCausalLM.from_pretrained(moved)
    ids = torch.tensor([[7, 8, 9, 10]])
    assert again.config.tree_budget == 5 and greedy(again, ids, 24) == greedy(loaded.target, ids, 24)


def test_card_lists_hub_members_as_base_model(tmp_path):
    target = tiny_model("llama")
    draft = truncated_draft(target, 1)
    model = SwiftSpecForCausalLM.from_models(target, draft)
    model.config.update(dict(target="org/big", target_revision="a" * 40, draft="org/small", draft_revision="b" * 40))
    model.save_pretrained(tmp_path, card=PairCard(title="t", license="other", license_name="custom", license_link="LICENSE"))
    meta = read_card_metadata(tmp_path)
    assert meta["base_model"] == ["org/big", "org/small"] and meta["license_name"] == "custom"
    assert json.loads((tmp_path / "config.json").read_text())["draft_revision"] == "b" * 40


def test_save_without_member_names_is_refused(tmp_path):
    target = tiny_model("llama")
    model = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1))
    with pytest.raises(PairConfigError, match="config.target is not set"):
        model.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path, save_members=True)  # the weights travel inside the pair instead
    loaded = SwiftSpecForCausalLM.from_pretrained(tmp_path)
    assert loaded.config.target == "target" and (tmp_path / "draft" / "model.safetensors").is_file()


def test_push_to_hub_uploads_the_pair_repo(tmp_path, monkeypatch):
    uploaded = {}

    def upload_folder(self, repo_id, folder_path, **kwargs):
        uploaded.update(repo=repo_id, files=sorted(p.name for p in Path(folder_path).rglob("*") if p.is_file()))
        uploaded["readme"] = (Path(folder_path) / "README.md").read_text()
        return "commit"

    monkeypatch.setattr("huggingface_hub.HfApi.create_repo", lambda self, repo_id, **kw: repo_id)
    monkeypatch.setattr("huggingface_hub.HfApi.upload_folder", upload_folder)
    loaded = SwiftSpecForCausalLM.from_pretrained(local_pair(tmp_path))
    with pytest.raises(PairConfigError, match="local folder"):
        loaded.push_to_hub("me/pair")
    assert loaded.push_to_hub("me/pair", save_members=True) == "commit"
    assert uploaded["repo"] == "me/pair" and "model.safetensors" in uploaded["files"]
    assert {"config.json", "README.md", "tokenizer.json", "generation_config.json"} <= set(uploaded["files"])
    assert 'from_pretrained("me/pair")' in uploaded["readme"]


# ---------------------------------------------------------------- compatibility


def swapped_char_tokenizer(a: str, b: str):
    """The test char tokenizer with the ids of two tokens exchanged."""
    tokens = CHAR_SPECIALS + [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(tokens)}
    vocab[a], vocab[b] = vocab[b], vocab[a]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>")


def test_padded_draft_vocabulary_with_the_same_tokenizer(tmp_path):
    """Like Qwen2.5 0.5B (151936 rows) drafting for 72B (152064): same tokenizer, different padding."""
    target = tiny_model("llama", seed=0, vocab_size=128)
    draft = truncated_draft(target, 2)
    draft.resize_token_embeddings(98 + 14)  # the draft's own padding, still covering the tokenizer's 98 ids
    model = SwiftSpecForCausalLM.from_models(target, draft, tokenizer=char_tokenizer())
    ids = torch.tensor([[11, 12, 13]])
    assert greedy(model, ids) == greedy(target, ids)
    with pytest.raises(PairConfigError, match="target vocab_size=128, draft vocab_size=112"):
        SwiftSpecForCausalLM.from_models(target, draft)  # without a tokenizer only equal sizes can be trusted


def with_draft_tokenizer(root: Path, tokenizer) -> Path:
    pair = local_pair(root)
    tokenizer.save_pretrained(root / "draft")
    return pair


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda p: edit_config(p, draft=...), "field 'draft' is missing"),
        (lambda p: edit_config(p, target=""), "field 'target' is missing"),
        (lambda p: edit_config(p, model_type=...), "field 'model_type' is missing"),
        (lambda p: edit_config(p, model_type="llama"), "model_type='llama', so this is a model repo"),
        (lambda p: edit_config(p, tree_budget="8"), "field 'tree_budget' must be int or null, got str '8'"),
        (lambda p: edit_config(p, draft_revision=5), "field 'draft_revision' must be str or null, got int 5"),
        (lambda p: edit_config(p, swiftspec_default="yes"), "field 'swiftspec_default' must be bool"),
        (lambda p: edit_config(p, draft_width=0), "draft_width must be a positive int, got 0"),
        (lambda p: edit_config(p.parent / "target", model_type="rwkv", hidden_size=64, num_hidden_layers=1, vocab_size=98) and p,
         r"The target \(rwkv\) keeps a recurrent state outside its cache's layers"),
        (lambda p: edit_config(p.parent / "draft", model_type="not-an-architecture") and p,
         "Cannot load the draft from field 'draft'='../draft'"),
        (lambda p: p / "nothing-here", "has no config.json"),
    ],
    ids=["no-draft", "empty-target", "no-model-type", "model-repo", "str-budget", "int-revision", "str-bool",
         "zero-width", "rwkv-target", "unknown-arch", "no-config"],
)
def test_bad_pair_configs_name_the_field(tmp_path, make, match):
    pair = make(local_pair(tmp_path))
    if not pair.exists():
        pair.mkdir()
    with pytest.raises(PairConfigError, match=match):
        SwiftSpecForCausalLM.from_pretrained(pair)


@pytest.mark.parametrize(
    "make, translates",
    [
        (lambda p: edit_config(p.parent / "draft", max_position_embeddings=256) and p, False),
        (lambda p: (swapped_char_tokenizer("a", "b").save_pretrained(p.parent / "draft"), p)[1], True),
        (lambda p: (swapped_char_tokenizer("<pad>", "</s>").save_pretrained(p.parent / "draft"), p)[1], True),
    ],
    ids=["short-context", "token-ids", "special-tokens"],
)
def test_pairs_once_refused_load_and_decode_as_the_target(tmp_path, make, translates):
    """Issue 64: a draft with a shorter context reads the text in windows, a draft whose ids mean other tokens
    proposes through text (tests/test_other_tokenizer.py); both decode exactly as the target does."""
    model = SwiftSpecForCausalLM.from_pretrained(make(local_pair(tmp_path)))
    assert (model.vocabularies is not None) == translates
    ids = torch.tensor([[11, 12, 13, 11, 12]])
    assert greedy(model, ids) == greedy(model.target, ids)


def test_renamed_added_tokens_only_warn(tmp_path, caplog):
    """Reserved tokens renamed between releases (Llama 3 -> 3.1) cannot break losslessness: warn, load."""
    target_tok, draft_tok = char_tokenizer(), char_tokenizer()
    target_tok.add_tokens(["<|reserved_0|>"], special_tokens=False)
    draft_tok.add_tokens(["<|python_tag|>"], special_tokens=False)
    target = tiny_model("llama", vocab_size=99)
    with caplog.at_level(logging.WARNING, logger="hf_swiftspec.pair"):
        SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1), tokenizer=target_tok, draft_tokenizer=draft_tok)
    assert "name 1 added tokens differently (id 98: draft '<|python_tag|>' / target '<|reserved_0|>')" in caplog.text


def test_resolve_pair_checks_without_loading_weights(tmp_path):
    pair = local_pair(tmp_path)
    for weights in tmp_path.rglob("*.safetensors"):
        weights.unlink()  # nothing below may need them
    resolved = resolve_pair(pair)
    assert resolved.member_configs["target"].num_hidden_layers == 3 and resolved.tokenizer is not None


# ---------------------------------------------------------------- the shipped pair repos


def test_every_bundled_pair_file_ships_in_the_package():
    """The shipped-pair tests below are parametrised over bundled_pairs_dir() (without it they would collect
    nothing); it holds the demo pair `swiftspec generate` loads by name, and pyproject's package data takes every
    file of every pair folder, so an installed package has the pairs this checkout tests."""
    root = bundled_pairs_dir()
    assert root is not None and bundled_pair(DEMO_PAIR_NAME) == root / DEMO_PAIR_NAME
    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["hf_swiftspec.model_cards"]
    shipped = {path for glob in globs for path in root.glob(glob)}
    files = {p for p in root.rglob("*") if p.is_file() and p.parent != root and "__pycache__" not in p.parts}
    assert (root / DEMO_PAIR_NAME / "target" / "model.safetensors") in files
    assert sorted(str(p.relative_to(root)) for p in files - shipped) == []


def test_the_python_floor_admits_only_pythons_the_code_imports_on():
    """requires-python's floor is what CI runs (.ci/run builds every environment with the machine's python3, 3.11),
    so no Python it admits fails at import: tomllib, imported at module level here and elsewhere, is 3.11's (on 3.10,
    which the floor once admitted, this module failed at collection)."""
    import re

    root = Path(__file__).resolve().parents[1]
    spec = tomllib.loads((root / "pyproject.toml").read_text())["project"]["requires-python"]
    floor = tuple(int(x) for x in re.fullmatch(r">=(\d+)\.(\d+)", spec).groups())
    sources = [*root.joinpath("tests").glob("*.py"), *root.joinpath("hf_swiftspec").rglob("*.py")]
    uses_tomllib = [p.name for p in sources if re.search(r"^import tomllib", p.read_text(), re.M)]
    assert not uses_tomllib or floor >= (3, 11), (spec, uses_tomllib)
    assert sys.version_info[:2] >= floor  # and this interpreter is one it admits


@pytest.mark.parametrize("folder", sorted(p for p in (bundled_pairs_dir() or Path()).iterdir() if (p / "config.json").is_file()), ids=lambda p: p.name)
def test_every_shipped_pair_validates_offline(folder):
    config = check_pair_files(folder)
    meta = read_card_metadata(folder)
    text = (folder / "README.md").read_text()
    assert config.target and config.draft and meta["license"]
    assert "## How to use" in text and "## Pair" in text
    members = pair_members(config, folder)
    for role in ("target", "draft"):
        revision = getattr(config, f"{role}_revision")
        assert revision is None or len(revision) == 40, f"{role}_revision must be a full commit sha or null"
        if revision is None and not members[role].is_local:  # a Hub member (a sibling folder is local)
            assert "not pinned" in text  # the card says so


def test_shipped_cards_match_their_generator(tmp_path):
    """model_cards/build_cards.py writes the real-pair folders; what is committed is what it writes."""
    script = bundled_pairs_dir() / "build_cards.py"
    subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], check=True, capture_output=True, timeout=120)
    written = sorted(p for p in tmp_path.iterdir() if p.is_dir())
    assert written, "build_cards.py wrote nothing"
    for folder in written:
        shipped = bundled_pairs_dir() / folder.name
        assert (shipped / "README.md").read_text() == (folder / "README.md").read_text(), f"{shipped} is stale: run {script}"
        committed, fresh = (json.loads((f / "config.json").read_text()) for f in (shipped, folder))
        committed.pop("transformers_version")  # follows the installed library
        # Fields added to SwiftSpecConfig later are absent from older files and load with their defaults.
        assert committed == {k: fresh[k] for k in committed}, f"{shipped}/config.json is stale: run {script}"


# ---------------------------------------------------------------- loading arguments


@pytest.mark.parametrize(
    "device_map, on_cpu",
    [(None, True), ("cpu", True), (torch.device("cpu"), True), ({"": "cpu"}, True), ({"model": "cpu", "lm_head": "disk"}, True),
     ("cuda:0", False), (0, False), ({"": 0}, False), ({"model": "cpu", "lm_head": "cuda:1"}, False),
     ("auto", not accelerator_available())],
)
def test_which_device_maps_load_float32(device_map, on_cpu):
    """Members that land on the CPU load in float32 unless a dtype is given; anywhere else, as stored."""
    kwargs = {} if device_map is None else {"device_map": device_map}
    assert device_map_on_cpu(device_map) is on_cpu
    assert with_cpu_dtype(kwargs, None).get("dtype") == (torch.float32 if on_cpu else None)
    assert with_cpu_dtype({**kwargs, "dtype": torch.float16}, None)["dtype"] == torch.float16


def test_draft_tokenizer_alone_still_compares_vocabulary_sizes():
    """Only draft_tokenizer= says nothing about the target's ids: a 4096-token target must not pass with a 98-token draft."""
    target = tiny_model("llama", vocab_size=4096)
    draft = tiny_model("llama", seed=1, layers=1)  # 98 ids, char_tokenizer's
    with pytest.raises(PairConfigError, match=r"target vocab_size=4096, draft vocab_size=98.*tokenizer="):
        SwiftSpecForCausalLM.from_models(target, draft, draft_tokenizer=char_tokenizer())
    same = SwiftSpecForCausalLM.from_models(tiny_model("llama"), draft, draft_tokenizer=char_tokenizer())  # equal sizes: fine
    assert same.draft is draft


# ---------------------------------------------------------------- swiftspec pair create


PROBES = ["w3 w7", "w93 w0  w12\tw5", "unknown words w4", "", "Hello, world!"]


def test_pair_create_writes_the_targets_tokenizer_as_saved(tmp_path):
    """A generic tokenizers-backend tokenizer must come back as itself, not as the model type's own class."""
    tok = word_tokenizer()
    target, draft = tiny_members(tmp_path, tokenizer=tok, model_type="qwen2")
    pair = create_pair_repo(tmp_path / "pair", str(target), str(draft)).folder
    assert f'from_pretrained("{pair}")' in (pair / "README.md").read_text()  # the card names the pair, not its draft
    written = json.loads((pair / "tokenizer_config.json").read_text())
    declared = json.loads((target / "tokenizer_config.json").read_text())
    assert written["tokenizer_class"] == declared["tokenizer_class"]
    assert not {"is_local", "local_files_only", "use_fast"} & set(written), "loader arguments leaked into the file"
    for loaded in (AutoTokenizer.from_pretrained(pair), SwiftSpecForCausalLM.from_pretrained(pair).tokenizer):
        assert type(loaded) is type(tok)
        assert [loaded(text).input_ids for text in PROBES] == [tok(text).input_ids for text in PROBES]
    assert tok("w3 w7").input_ids == [7, 11]


def test_pair_create_refuses_a_tokenizer_that_would_encode_differently(tmp_path, monkeypatch):
    target, draft = tiny_members(tmp_path)
    monkeypatch.setattr("hf_swiftspec.pair.tokenizer.PROBE_TEXTS", ("abc",))
    monkeypatch.setattr(PreTrainedTokenizerFast, "save_pretrained", swapping_save(PreTrainedTokenizerFast.save_pretrained))
    with pytest.raises(PairConfigError, match="'abc' encodes to .* with the written tokenizer but .* with the target's"):
        create_pair_repo(tmp_path / "pair", str(target), str(draft))
    assert not (tmp_path / "pair").exists()


def swapping_save(save):
    """save_pretrained, then the saved tokenizer.json with the ids of 'a' and 'b' exchanged."""

    def wrapped(self, folder, *args, **kwargs):
        files = save(self, folder, *args, **kwargs)
        swapped_char_tokenizer("a", "b").backend_tokenizer.save(str(Path(folder) / "tokenizer.json"))
        return files

    return wrapped


def test_failed_pair_create_leaves_nothing_behind(tmp_path):
    target, draft = tiny_members(tmp_path, tokenizer=False, vocab_size=97)  # no tokenizers, sizes differ: refused
    with pytest.raises(PairConfigError, match="Vocabulary mismatch"):
        create_pair_repo(tmp_path / "new" / "pair", str(target), str(draft))
    assert not (tmp_path / "new" / "pair").exists() and not list((tmp_path / "new").iterdir())
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("keep me")
    with pytest.raises(PairConfigError):
        create_pair_repo(existing, str(target), str(draft))
    assert [p.name for p in existing.iterdir()] == ["notes.txt"] and sorted(p.name for p in tmp_path.iterdir()) == [
        "draft", "mine", "new", "target"]


def folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("where", ["draft", "draft/pair", "target", "target/sub/pair"])
def test_pair_create_never_writes_into_a_members_folder(tmp_path, capsys, where):
    """`pair create --draft D D` once replaced D's config.json with the pair's: D no longer loaded."""
    target, draft = tiny_members(tmp_path)
    before = {role: folder_bytes(tmp_path / role) for role in ("target", "draft")}
    argv = ["pair", "create", "--target", str(target), "--draft", str(draft), str(tmp_path / where)]
    assert main(argv) == 1 and main(argv + ["--force"]) == 1
    err = capsys.readouterr().err
    assert f"the {where.split('/')[0]}'s own folder" in err and "Traceback" not in err
    assert {role: folder_bytes(tmp_path / role) for role in ("target", "draft")} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft", "target"]  # no staging folder left either
    AutoModelForCausalLM.from_pretrained(draft)


def test_save_pretrained_never_writes_into_a_members_folder(tmp_path):
    model = SwiftSpecForCausalLM.from_pretrained(local_pair(tmp_path))
    before = folder_bytes(tmp_path / "draft")
    for where in (tmp_path / "draft", tmp_path / "draft" / "sub"):
        with pytest.raises(PairConfigError, match="the draft's own folder"):
            model.save_pretrained(where)
    assert folder_bytes(tmp_path / "draft") == before
    model.save_pretrained(tmp_path / "copy", save_members=True)  # members written inside the pair: fine
    assert SwiftSpecForCausalLM.from_pretrained(tmp_path / "copy").config.draft == "draft"


def test_pair_create_refuses_a_non_empty_folder_even_with_force(tmp_path, capsys):
    target, draft = tiny_members(tmp_path)
    existing = tmp_path / "mine"
    existing.mkdir()
    (existing / "notes.txt").write_text("keep me")
    (existing / "config.json").write_text('{"mine": true}')
    before = folder_bytes(existing)
    for force in (False, True):
        with pytest.raises(PairConfigError, match="not empty .*config.json, notes.txt.* holds no pair repo"):
            create_pair_repo(existing, str(target), str(draft), force=force)
    assert folder_bytes(existing) == before
    assert main(["pair", "create", "--target", str(target), "--draft", str(draft), "--force", str(existing)]) == 1
    assert folder_bytes(existing) == before and "not empty" in capsys.readouterr().err


def test_pair_create_replaces_a_previous_pair_only_with_force(tmp_path, capsys):
    target, draft = tiny_members(tmp_path)
    pair = create_pair_repo(tmp_path / "pair", str(target), str(draft), tree_budget=6).folder
    argv = ["pair", "create", "--target", str(target), "--draft", str(draft), "--tree-budget", "5", str(pair)]
    assert main(argv) == 1 and "holds a pair repo already. Pass --force" in capsys.readouterr().err
    assert SwiftSpecForCausalLM.from_pretrained(pair).config.tree_budget == 6
    (pair / "vocab.txt").write_text("the previous pair's tokenizer")  # a tokenizer file the new pair does not write
    (pair / "notes.txt").write_text("keep me")
    assert main(argv + ["--force"]) == 0
    assert SwiftSpecForCausalLM.from_pretrained(pair).config.tree_budget == 5
    assert not (pair / "vocab.txt").exists() and (pair / "notes.txt").read_text() == "keep me"


def test_pair_create_without_a_generation_config(tmp_path):
    """Older repos have no generation_config.json; the pair gets the one transformers derives from config.json."""
    target, draft = tiny_members(tmp_path)
    (target / "generation_config.json").unlink()
    pair = create_pair_repo(tmp_path / "pair", str(target), str(draft)).folder
    written = json.loads((pair / "generation_config.json").read_text())
    assert (written["bos_token_id"], written["eos_token_id"], written["pad_token_id"]) == (1, 2, 0)
    ids = torch.tensor([[10, 20, 30]])
    expected = AutoModelForCausalLM.from_pretrained(target).generate(ids, max_new_tokens=8, do_sample=False).tolist()
    assert greedy(SwiftSpecForCausalLM.from_pretrained(pair), ids, n=8) == expected


def test_license_other_needs_a_name(tmp_path, capsys):
    target, draft = tiny_members(tmp_path)
    argv = ["pair", "create", "--target", str(target), "--draft", str(draft), "--license", "other", str(tmp_path / "pair")]
    assert main(argv) == 1 and "--license-name" in capsys.readouterr().err
    assert not (tmp_path / "pair").exists()
    assert main(argv + ["--license-name", "my-licence"]) == 0
    assert read_card_metadata(tmp_path / "pair")["license_name"] == "my-licence"


def bert_masked_lm(folder: Path) -> Path:
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=98, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        pad_token_id=0)
    return save_member(BertForMaskedLM(config), folder, char_tokenizer())


def test_pair_create_and_check_refuse_a_masked_lm_target(tmp_path, capsys):
    """A BertForMaskedLM attends both ways; it used to pass both commands and fail only at load time."""
    _, draft = tiny_members(tmp_path)
    bert = bert_masked_lm(tmp_path / "bert")
    assert main(["pair", "create", "--target", str(bert), "--draft", str(draft), str(tmp_path / "pair")]) == 1
    out, err = capsys.readouterr()
    assert "The target (bert) attends bidirectionally" in err and "is_decoder=True" in err and "wrote" not in out
    assert not (tmp_path / "pair").exists()
    pair = edit_config(local_pair(tmp_path / "ok"), target=os.path.relpath(bert, tmp_path / "ok" / "pair"))
    assert main(["pair", "check", str(pair)]) == 1
    out, err = capsys.readouterr()
    assert "compatible" not in out and "The target (bert) attends bidirectionally" in err


def test_pair_check_names_local_members_as_folders(tmp_path, capsys):
    assert main(["pair", "check", str(local_pair(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "default branch" not in out and "(local folder)" in out


def test_pair_create_members_inside_the_pair_folder(tmp_path):
    """Like the demo pair: the members' folders sit inside the pair folder, named relative to it."""
    tiny_members(tmp_path / "pair")
    create_pair_repo(tmp_path / "pair", str(tmp_path / "pair" / "target"), str(tmp_path / "pair" / "draft"))
    config = json.loads((tmp_path / "pair" / "config.json").read_text())
    assert (config["target"], config["draft"]) == ("target", "draft")
    assert "base_model" not in read_card_metadata(tmp_path / "pair")  # folders in the repo, not Hub models
    assert SwiftSpecForCausalLM.from_pretrained(tmp_path / "pair").target.config.num_hidden_layers == 3


def test_pair_create_prints_revisions_only_when_there_are_some(tmp_path, capsys):
    target, draft = tiny_members(tmp_path)
    assert main(["pair", "create", "--target", str(target), "--draft", str(draft), str(tmp_path / "pair")]) == 0
    out = capsys.readouterr().out
    assert "(target ../target, draft ../draft)" in out and "@None" not in out
    assert member_description("org/big", "a" * 40) == "org/big@" + "a" * 40


@pytest.mark.parametrize("typo, field", [("tree_budgt", "tree_budget"), ("draft_widht", "draft_width"), ("placment", "placement")])
def test_a_misspelt_tree_setting_is_an_error(tmp_path, typo, field):
    """Members' from_pretrained would take it as a config attribute and ignore it; say so instead."""
    with pytest.raises(TypeError, match=f"'{typo}'.*did you mean '{field}'"):
        SwiftSpecForCausalLM.from_pretrained(local_pair(tmp_path), **{typo: 4})


def test_other_arguments_still_reach_both_members(tmp_path):
    model = SwiftSpecForCausalLM.from_pretrained(local_pair(tmp_path), attention_dropout=0.25, tree_budget=5)
    assert model.target.config.attention_dropout == model.draft.config.attention_dropout == 0.25
    assert model.config.tree_budget == 5


def test_a_pair_of_one_tokenizer_loads_it_once(monkeypatch):
    """The demo pair ships the same tokenizer files three times (pair folder, target, draft): one load, one
    object, no mapping comparison (a Gemma-3 pair loaded its 262k tokenizer three times and compared twice)."""
    from hf_swiftspec.pair import DEMO_PAIR_NAME, checks
    from hf_swiftspec.pair import tokenizer as tokenizers

    loads, compared = [], []
    for name in ("AutoTokenizer", "TokenizersBackend"):  # the two classes load_tokenizer loads with
        real = getattr(tokenizers, name)
        counting = lambda location, *args, real=real, **kwargs: loads.append(location) or real.from_pretrained(location, *args, **kwargs)  # noqa: E731
        monkeypatch.setattr(tokenizers, name, types.SimpleNamespace(from_pretrained=counting))
    monkeypatch.setattr(checks, "mapping_differences", lambda *args: compared.append(args) or [])
    model = SwiftSpecForCausalLM.from_pretrained(DEMO_PAIR_NAME)
    assert len(loads) == 1, loads
    assert compared == []
    assert model.tokenizer("def f():").input_ids == AutoTokenizer.from_pretrained(model.pair_folder / "target")("def f():").input_ids


def test_an_early_exit_of_a_loaded_target_pairs_without_a_puzzling_notice(tmp_path, caplog):
    """truncated_draft cut from a target loaded from its folder: the pair is made without a notice that the draft "was
    built in memory" (it printed one, naming the target's folder), and the draft names no folder, so saving the pair
    says how to store its weights instead of pointing at the target's."""
    tiny_model("llama", seed=0).save_pretrained(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target")
    with caplog.at_level(logging.WARNING, logger="hf_swiftspec"):
        pair = SwiftSpecForCausalLM.from_models(target, truncated_draft(target, 1))
    assert caplog.text == "" and pair.draft.name_or_path == ""
    with pytest.raises(ValueError, match="the draft was built in memory"):
        pair.save_pretrained(tmp_path / "pair")
    pair.save_pretrained(tmp_path / "pair", save_members=True)
    assert (tmp_path / "pair" / "draft" / "config.json").is_file()
