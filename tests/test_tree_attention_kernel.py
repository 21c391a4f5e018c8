"""Triton tree attention (swiftspec_kernels) against its plain-torch reference and against sdpa.

Without a GPU the kernel runs under the Triton interpreter, which is slow: default cases are
small, the wide sweep is marked `slow`.
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Triton reads TRITON_INTERPRET once, when `triton` is first imported (torch._dynamo and
    # transformers import it too, so conftest.py should set it first; see _kernel_skip_reason).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from swiftspec_kernels import (  # noqa: E402
    pack_tree_mask,
    tree_attention,
    tree_attention_reference,
    triton_available,
    unpack_tree_mask,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {  # dtype: (atol, rtol); 16-bit outputs are rounded once, P is rounded before P @ V
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def _kernel_skip_reason() -> str | None:
    if not triton_available(DEVICE):
        return (
            f"Triton kernels cannot run on {DEVICE}: without CUDA they need the interpreter, "
            f"and `triton` was imported before TRITON_INTERPRET=1 was set (set it at the top of "
            f"conftest.py, or run `TRITON_INTERPRET=1 pytest`)"
        )
    return None


_SKIP_REASON = _kernel_skip_reason()
needs_kernel = pytest.mark.skipif(_SKIP_REASON is not None, reason=_SKIP_REASON or "")


# ---------------------------------------------------------------------------------------------
# Trees and inputs
# ---------------------------------------------------------------------------------------------


def tree_parents(n: int, kind: str, gen: torch.Generator) -> list[int]:
    """Parent of each node (node 0 is the root, parent[i] < i)."""
    if kind == "chain":
        return [-1] + list(range(n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "deep":  # a few long branches: mostly extend the previous node, sometimes fork
        forks = torch.rand(n, generator=gen) < 0.15
        return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) if forks[i] else i - 1
                       for i in range(1, n)]  # fmt: skip
    if kind == "random":
        return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    raise ValueError(f"unknown tree kind {kind!r}")


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """(n, n) bool, row i = ancestors of node i and i itself."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def make_inputs(B, Hq, Hkv, T, D, prefix_len, S, dtype, gen):
    """q (B, Hq, T, D), k, v (B, Hkv, prefix_len + S, D) on DEVICE."""
    L = prefix_len + S
    q, k, v = (torch.randn(B, h, n, D, generator=gen) for h, n in ((Hq, T), (Hkv, L), (Hkv, L)))
    return q.to(DEVICE, dtype), k.to(DEVICE, dtype), v.to(DEVICE, dtype)


def tree_bits_for(B, T, kind, gen) -> torch.Tensor:
    """Packed masks (B, T, ceil(T/32)) of B random trees of T nodes (the tree region is T wide)."""
    masks = torch.stack([ancestor_mask(tree_parents(T, kind, gen)) for _ in range(B)])
    return pack_tree_mask(masks).to(DEVICE)


def assert_matches_reference(q, k, v, prefix_len, bits, **kwargs):
    scale = q.shape[-1] ** -0.5
    out = tree_attention(q, k, v, prefix_len, bits, scale, **kwargs)
    expected = tree_attention_reference(q, k, v, prefix_len, bits, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert not out.isnan().any()
    atol, rtol = TOLERANCES[q.dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    return out


# ---------------------------------------------------------------------------------------------
# Kernel vs reference
# ---------------------------------------------------------------------------------------------

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


def _case_id(value) -> str:
    return str(value).removeprefix("torch.")

SMALL_CASES = [  # B, T, prefix_len, Hq, Hkv, D, dtype, tree kind
    (1, 1, 0, 4, 4, 64, F32, "chain"),
    (2, 5, 1, 8, 2, 32, F16, "random"),
    (1, 8, 97, 8, 1, 64, BF16, "star"),
    (2, 17, 97, 4, 1, 80, F32, "deep"),
    (1, 37, 0, 2, 2, 16, F16, "random"),
    (1, 17, 1000, 4, 4, 96, BF16, "deep"),
    (1, 37, 1030, 8, 1, 128, F16, "random"),  # GQA 8 x 37 rows: 5 row blocks
    (1, 5, 1024, 16, 2, 128, F32, "chain"),
    (1, 64, 130, 4, 1, 64, BF16, "deep"),  # the tree region is exactly two mask words wide
]


@needs_kernel
@pytest.mark.parametrize("B,T,prefix_len,Hq,Hkv,D,dtype,kind", SMALL_CASES, ids=_case_id)
def test_matches_reference(B, T, prefix_len, Hq, Hkv, D, dtype, kind):
    gen = torch.Generator().manual_seed(T * 1000 + prefix_len)
    q, k, v = make_inputs(B, Hq, Hkv, T, D, prefix_len, T, dtype, gen)
    assert_matches_reference(q, k, v, prefix_len, tree_bits_for(B, T, kind, gen))


def _sweep():
    combos = itertools.product((1, 5, 8, 17, 37, 64), (0, 1, 97, 1000, 2053), (1, 4, 8))
    dims, dtypes, kinds = (64, 80, 96, 128), (F32, F16, BF16), ("chain", "star", "deep", "random")
    for i, (T, prefix_len, ratio) in enumerate(combos):
        yield T, prefix_len, ratio, dims[i % 4], dtypes[i % 3], kinds[i % 4]


@pytest.mark.slow
@needs_kernel
@pytest.mark.parametrize("T,prefix_len,ratio,D,dtype,kind", list(_sweep()), ids=_case_id)
def test_matches_reference_sweep(T, prefix_len, ratio, D, dtype, kind):
    gen = torch.Generator().manual_seed(T * 7919 + prefix_len * 31 + ratio)
    q, k, v = make_inputs(2, 2 * ratio, 2, T, D, prefix_len, T, dtype, gen)
    assert_matches_reference(q, k, v, prefix_len, tree_bits_for(2, T, kind, gen))


@needs_kernel
@pytest.mark.parametrize("num_splits", [1, 2, 5])
def test_kv_splits_agree(num_splits):
    """Forced splits cut the prefix into 1, 2 and 4 parts; the last part also runs the tree."""
    gen = torch.Generator().manual_seed(num_splits)
    T, prefix_len = 37, 200
    q, k, v = make_inputs(1, 4, 2, T, 32, prefix_len, T, F32, gen)
    assert_matches_reference(q, k, v, prefix_len, tree_bits_for(1, T, "random", gen),
                             num_splits=num_splits)  # fmt: skip


@needs_kernel
def test_rows_with_nothing_to_attend_are_zero():
    gen = torch.Generator().manual_seed(0)
    T, S = 5, 150
    q, k, v = make_inputs(1, 2, 1, T, 16, 0, S, F16, gen)
    mask = torch.rand(1, T, S, generator=gen) < 0.3
    mask[0, 2] = False  # row 2 sees nothing: no prefix, no tree bits
    out = assert_matches_reference(q, k, v, 0, pack_tree_mask(mask).to(DEVICE))
    assert (out[:, :, 2] == 0).all()


@needs_kernel
@pytest.mark.parametrize("num_splits", [1, 3])
def test_wide_tree_region_uses_several_words(num_splits):
    """S = 300 columns -> 10 words per row; the bits need not come from a tree."""
    gen = torch.Generator().manual_seed(1)
    T, S, prefix_len = 8, 300, 150
    q, k, v = make_inputs(2, 4, 1, T, 64, prefix_len, S, BF16, gen)
    mask = torch.rand(2, T, S, generator=gen) < 0.5
    bits = pack_tree_mask(mask).to(DEVICE)
    assert_matches_reference(q, k, v, prefix_len, bits, num_splits=num_splits)


@needs_kernel
def test_extra_words_and_high_bits_are_ignored():
    """A fixed-size bits buffer (here 4 words for S = 40) may hold junk past column S."""
    gen = torch.Generator().manual_seed(2)
    T, S, prefix_len = 6, 40, 10
    q, k, v = make_inputs(1, 2, 2, T, 32, prefix_len, S, F32, gen)
    mask = torch.rand(1, T, S, generator=gen) < 0.5
    clean = torch.zeros(1, T, 4, dtype=torch.int32)
    clean[..., :2] = pack_tree_mask(mask)
    junk = clean.clone()
    junk[..., 1] |= -256  # columns 40..63 set
    junk[..., 2:] = -1
    expected = tree_attention(q, k, v, prefix_len, clean.to(DEVICE))
    torch.testing.assert_close(tree_attention(q, k, v, prefix_len, junk.to(DEVICE)), expected)
    torch.testing.assert_close(expected, tree_attention_reference(q, k, v, prefix_len,
                               clean.to(DEVICE), 32**-0.5), atol=2e-5, rtol=2e-5)  # fmt: skip


@needs_kernel
def test_kv_views_are_read_in_place():
    """k, v as a slice of a longer cache, and as a (B, L, H, D) cache transposed to (B, H, L, D)."""
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, T, D, prefix_len = 2, 4, 2, 5, 64, 70
    L = prefix_len + T
    q, _, _ = make_inputs(B, Hq, Hkv, T, D, prefix_len, T, F16, gen)
    bits = tree_bits_for(B, T, "random", gen)
    cache = torch.randn(2, B, Hkv, 128, D, generator=gen).to(DEVICE, F16)
    k, v = cache[0, :, :, :L], cache[1, :, :, :L]  # (B, Hkv, L, D), stride(2) = D, not contiguous
    assert not k.is_contiguous()
    assert_matches_reference(q, k, v, prefix_len, bits)
    bhld = torch.randn(2, B, 128, Hkv, D, generator=gen).to(DEVICE, F16)
    k, v = bhld[0, :, :L].transpose(1, 2), bhld[1, :, :L].transpose(1, 2)
    assert_matches_reference(q, k, v, prefix_len, bits)


# ---------------------------------------------------------------------------------------------
# Differential tests against torch sdpa (built without pack/unpack or the reference)
# ---------------------------------------------------------------------------------------------


WINDOW_CASES = [  # T, prefix_len, window, num_splits, dtype, softcap
    (5, 40, 8, 1, F32, None),
    (17, 300, 16, 3, F32, None),  # the first splits lie outside every window: they must weigh 0
    (17, 300, 128, 3, BF16, None),
    (9, 97, 40, None, F16, 30.0),
    (37, 200, 1024, 2, F32, 5.0),  # a window wider than everything: only the softcap acts
]


@needs_kernel
@pytest.mark.parametrize("T,prefix_len,window,num_splits,dtype,softcap", WINDOW_CASES, ids=_case_id)
def test_window_and_softcap_match_reference(T, prefix_len, window, num_splits, dtype, softcap):
    """Per-query prefix starts (a sliding window of each node's position) and a score cap."""
    gen = torch.Generator().manual_seed(T + prefix_len + window)
    q, k, v = make_inputs(1, 8, 2, T, 32, prefix_len, T, dtype, gen)
    depths = torch.randint(0, T, (1, T), generator=gen)
    start = (prefix_len + depths - window + 1).clamp(min=0).to(torch.int32).to(DEVICE)  # (1, T)
    bits = tree_bits_for(1, T, "deep", gen)
    scale = 32**-0.5
    out = tree_attention(q, k, v, prefix_len, bits, scale, prefix_start=start, softcap=softcap, num_splits=num_splits)
    expected = tree_attention_reference(q, k, v, prefix_len, bits, scale, prefix_start=start, softcap=softcap)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)


@needs_kernel
@pytest.mark.parametrize("window", [1, 6, 50])
def test_sliding_chain_equals_sliding_window_causal_attention(window):
    """A chain whose queries start their prefix at position - window + 1 is sliding-window attention."""
    gen = torch.Generator().manual_seed(window)
    B, Hq, Hkv, T, D, prefix_len = 1, 4, 2, 17, 32, 45
    q, k, v = make_inputs(B, Hq, Hkv, T, D, prefix_len, T, F32, gen)
    positions = torch.arange(prefix_len, prefix_len + T)
    chain = torch.ones(T, T, dtype=torch.bool).tril() & (positions[None, :] > positions[:, None] - window)
    start = (positions - window + 1).clamp(min=0).to(torch.int32)[None].to(DEVICE)
    out = tree_attention(q, k, v, prefix_len, pack_tree_mask(chain[None]).to(DEVICE), prefix_start=start)
    kv_positions = torch.arange(prefix_len + T)
    sliding = (kv_positions[None, :] <= positions[:, None]) & (kv_positions[None, :] > positions[:, None] - window)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=sliding.to(DEVICE), enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@needs_kernel
@pytest.mark.parametrize("prefix_len", [0, 45])
def test_chain_tree_equals_causal_attention(prefix_len):
    gen = torch.Generator().manual_seed(prefix_len)
    B, Hq, Hkv, T, D = 2, 8, 2, 17, 32
    q, k, v = make_inputs(B, Hq, Hkv, T, D, prefix_len, T, F32, gen)
    chain = torch.ones(T, T, dtype=torch.bool).tril()  # node t descends from nodes 0..t-1
    out = tree_attention(q, k, v, prefix_len, pack_tree_mask(chain.expand(B, T, T)).to(DEVICE))
    if prefix_len == 0:
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    else:  # causal aligned to the bottom right: query t sees KV positions 0 .. prefix_len + t
        causal = torch.ones(T, prefix_len + T, dtype=torch.bool, device=DEVICE).tril(prefix_len)
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=causal, enable_gqa=True)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@needs_kernel
@pytest.mark.parametrize("tree_cols", [0, 1])
def test_plain_decode_step(tree_cols):
    """T = 1 with the new token either in the prefix (S = 0) or as a 1-column tree (bit 0 set)."""
    gen = torch.Generator().manual_seed(tree_cols)
    q, k, v = make_inputs(2, 8, 2, 1, 64, 300 - tree_cols, tree_cols, F16, gen)
    bits = torch.full((2, 1, tree_cols), 1, dtype=torch.int32, device=DEVICE)
    out = tree_attention(q, k, v, 300 - tree_cols, bits)
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True)
    torch.testing.assert_close(out, expected.half(), atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------------------------------------
# Mask packing, defaults, errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("S", [0, 1, 31, 32, 33, 64, 300])
def test_pack_round_trip(S):
    mask = torch.rand(2, 3, S, generator=torch.Generator().manual_seed(S)) < 0.5
    bits = pack_tree_mask(mask)
    assert bits.dtype == torch.int32 and bits.shape == (2, 3, (S + 31) // 32)
    assert torch.equal(unpack_tree_mask(bits, S), mask)


def test_pack_bit_positions():
    mask = torch.zeros(1, 2, 64, dtype=torch.bool)
    mask[0, 0, [0, 33]] = True
    mask[0, 1, 31] = True  # bit 31 is the int32 sign bit
    assert pack_tree_mask(mask).tolist() == [[[1, 2], [-(2**31), 0]]]


@needs_kernel
def test_default_scale_is_inverse_sqrt_head_dim():
    gen = torch.Generator().manual_seed(4)
    q, k, v = make_inputs(1, 2, 1, 3, 80, 20, 3, F32, gen)
    bits = tree_bits_for(1, 3, "random", gen)
    torch.testing.assert_close(tree_attention(q, k, v, 20, bits),
                               tree_attention(q, k, v, 20, bits, 80**-0.5))  # fmt: skip


def _good_inputs():
    gen = torch.Generator().manual_seed(5)
    q, k, v = make_inputs(1, 4, 2, 3, 32, 40, 3, F16, gen)
    return dict(q=q, k=k, v=v, prefix_len=40, tree_bits=tree_bits_for(1, 3, "chain", gen))


BAD_INPUTS = [  # (name, change to the good inputs, expected message fragment)
    ("q not 4-d", lambda a: a.update(q=a["q"][0]), r"q \(B, Hq, T, D\)"),
    ("v shape", lambda a: a.update(v=a["v"][:, :, :-1]), r"equal shape"),
    ("head dims differ", lambda a: a.update(k=a["k"][..., :16], v=a["v"][..., :16]), r"head dim"),
    ("gqa ratio", lambda a: a.update(q=a["q"][:, :3]), r"Hq=3 must be a multiple of .* Hkv=2"),
    ("prefix too long", lambda a: a.update(prefix_len=44), r"prefix_len=44 must be a Python int"),
    ("prefix tensor", lambda a: a.update(prefix_len=torch.tensor(40)), r"not a tensor"),
    ("bits dtype", lambda a: a.update(tree_bits=a["tree_bits"].long()), r"tree_bits must be int32"),
    ("bits too few words", lambda a: a.update(prefix_len=0), r"W>=2.*S=43"),
    ("bits wrong T", lambda a: a.update(tree_bits=a["tree_bits"][:, :2]), r"T=3"),
    ("mixed dtypes", lambda a: a.update(k=a["k"].float()), r"share one dtype"),
    ("fp64", lambda a: a.update(**{n: a[n].double() for n in "qkv"}), r"fp32, fp16, bf16"),
    ("head dim 512", lambda a: a.update(**{n: a[n].repeat(1, 1, 1, 16) for n in "qkv"}), r"D=512"),
    ("strided head dim", lambda a: a.update(k=a["k"].transpose(2, 3).contiguous().transpose(2, 3)),
     r"k must be contiguous along the head dim"),
]  # fmt: skip


@needs_kernel
@pytest.mark.parametrize("name,change,match", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(name, change, match):
    args = _good_inputs()
    change(args)
    with pytest.raises(ValueError, match=match):
        tree_attention(**args)


def test_pack_rejects_non_bool():
    with pytest.raises(ValueError, match=r"bool tensor of shape \(B, T, S\)"):
        pack_tree_mask(torch.ones(1, 2, 3))


# Run in a fresh interpreter that looks like a GPU machine (CUDA available, Triton compiling rather than
# interpreting): what would initialise CUDA, compile or launch a kernel there is recorded here instead.
IMPORT_PROBE = """
import sys, torch, triton, triton.runtime.jit
calls = []
torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda._lazy_init = lambda: calls.append("CUDA initialised")
torch.cuda.init = lambda: calls.append("CUDA initialised")
triton.runtime.jit.JITFunction.run = lambda self, *a, **k: calls.append(f"{self.fn.__name__} launched")
triton.compile = lambda *a, **k: calls.append("a kernel compiled")
import swiftspec_kernels
assert not calls, calls
kernels = vars(sys.modules["swiftspec_kernels.tree_attention"]).values()  # (the package's tree_attention is the function)
assert any(isinstance(v, triton.runtime.jit.JITFunction) for v in kernels)  # what run() is patched on
"""


def test_import_compiles_nothing_and_leaves_cuda_alone():
    """Importing the package is side-effect free: no CUDA context, nothing compiled or launched, even where CUDA is
    there to be used (on a CPU-only torch CUDA could never initialise, so the check alone would be vacuous)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    result = subprocess.run([sys.executable, "-c", IMPORT_PROBE], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


# ---------------------------------------------------------------------------------------------
# Lengths on the device (a captured step: one launch serves every step)
# ---------------------------------------------------------------------------------------------


def per_row_expected(q, k, v, rows, bits, scale, prefix_start=None):
    """Each row b with (prefix p, region s) through the int-prefix reference on its own first p + s positions."""
    out = torch.zeros_like(q)
    for b, (p, s) in enumerate(rows):
        start = None if prefix_start is None else prefix_start[b : b + 1]
        out[b : b + 1] = tree_attention_reference(q[b : b + 1], k[b : b + 1, :, : p + s], v[b : b + 1, :, : p + s], p,
                                                  bits[b : b + 1], scale, prefix_start=start)
    return out


@needs_kernel
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("window", [False, True])
def test_device_lengths_match_each_row_alone(num_splits, window):
    """Rows of one fixed-size cache (L = 300 positions) with their own prefix and region lengths, read from a
    device tensor; junk after each row's region never counts. Equals each row's own int-prefix attention."""
    gen = torch.Generator().manual_seed(11)
    B, T, L, Hq, Hkv, D = 3, 8, 300, 4, 2, 32
    rows = [(0, 8), (97, 20), (250, 30)]  # (prefix, region); the first row has no prefix at all
    q, k, v = make_inputs(B, Hq, Hkv, T, D, L, 0, F32, gen)
    k[:, :, -1] = float("nan")  # a slot no row reaches (a cache's scratch slot): must never be read
    mask = torch.rand(B, T, 64, generator=gen) < 0.5
    mask[:, :, 0] = True  # every query sees the root
    bits = pack_tree_mask(mask).to(DEVICE)
    start = None
    if window:
        start = torch.tensor([[0] * T, [50 + t for t in range(T)], [240] * T], dtype=torch.int32, device=DEVICE)
    lengths = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
    scale = D**-0.5
    expected = per_row_expected(q, k, v, rows, bits, scale, start)
    reference = tree_attention_reference(q, k, v, None, bits, scale, prefix_start=start, lengths=lengths)
    torch.testing.assert_close(reference, expected, atol=1e-5, rtol=1e-5)
    out = tree_attention(q, k, v, None, bits, scale, prefix_start=start, lengths=lengths, num_splits=num_splits)
    assert not out.isnan().any()
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
