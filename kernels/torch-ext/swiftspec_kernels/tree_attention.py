"""Tree attention: every query attends the committed prefix plus its own subset of the tree region.

Layout, for one batch row and one KV head::

    KV positions:  [0 ............ prefix_len) [prefix_len ........ L)
                    committed prefix (dense)     tree region, S = L - prefix_len columns
    query t sees:   [prefix_start[b, t], prefix_len) column s iff bit s of tree_bits[b, t] is set

`prefix_start` (default 0: the whole prefix) is how a layer's window reaches the kernel: with a
sliding window W a query at position p starts at max(0, p - W + 1), with chunked attention at
the start of p's chunk; the caller applies the same rule to the tree bits. `softcap` caps the
scores as Gemma 2 does (softcap * tanh(scores / softcap)) before the softmax.

The mask is packed 32 columns per int32 word (`pack_tree_mask`), so one (T, S) tree costs
T * ceil(S / 32) words and is built once per step and shared by every layer.

This file holds the Triton kernels (`_tree_attn_fwd_kernel`, `_tree_attn_combine_kernel`),
their host launcher (`tree_attention`) and the plain-torch reference they are tested against
(`tree_attention_reference`).
"""

from __future__ import annotations  # keeps `tl.constexpr` annotations unevaluated without Triton

import math

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only hosts keep the mask helpers and the reference
    triton = tl = None

__all__ = [
    "pack_tree_mask",
    "unpack_tree_mask",
    "tree_attention_reference",
    "tree_attention",
    "triton_available",
]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256
_BLOCK_N = 64  # KV positions per loop step; the tree loop relies on 64 = two mask words
# (group * T) rows per program; more rows go to more programs (grid axis 2). fp32 tiles use
# FMA rather than tensor cores ("ieee" dot) and spill registers past 16 rows on sm_90.
_MAX_BLOCK_M = {torch.float16: 64, torch.bfloat16: 64, torch.float32: 16}
_MIN_SPLIT_LEN = 256  # below this a split is mostly launch and combine overhead
_MAX_SPLITS = 64
_WAVES = 2  # aim for about two programs per SM so the tail wave is short
_DEFAULT_NUM_SMS = 132  # H100/H200; used when there is no CUDA device to ask (interpreter)


# ---------------------------------------------------------------------------------------------
# Mask packing (pure torch)
# ---------------------------------------------------------------------------------------------


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """Pack a boolean tree mask into int32 words, 32 columns per word.

    Args:
        mask: bool (B, T, S); True where query node t may attend tree column s.

    Returns:
        int32 (B, T, ceil(S / 32)); bit j of word w is column 32 * w + j. Unused high bits are 0.

    >>> m = torch.zeros(1, 1, 34, dtype=torch.bool); m[0, 0, 0] = m[0, 0, 33] = True
    >>> pack_tree_mask(m).tolist()
    [[[1, 2]]]
    """
    if mask.dtype != torch.bool or mask.dim() != 3:
        raise ValueError(
            f"pack_tree_mask expects a bool tensor of shape (B, T, S), got dtype={mask.dtype} "
            f"shape={tuple(mask.shape)}; build it with e.g. `ancestors.bool()`."
        )
    B, T, S = mask.shape
    W = (S + 31) // 32
    bits = torch.nn.functional.pad(mask.to(torch.int64), (0, 32 * W - S)).view(B, T, W, 32)
    shifts = torch.arange(32, device=mask.device, dtype=torch.int64)
    words = (bits << shifts).sum(-1)  # (B, T, W), in [0, 2**32)
    # int32 has no unsigned form: reinterpret bit 31 as the sign bit (two's complement).
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_tree_mask(tree_bits: torch.Tensor, num_cols: int) -> torch.Tensor:
    """Inverse of `pack_tree_mask`: int32 (B, T, W) -> bool (B, T, num_cols), num_cols <= 32 * W."""
    shifts = torch.arange(32, device=tree_bits.device, dtype=torch.int32)
    bits = (tree_bits.unsqueeze(-1) >> shifts) & 1  # (B, T, W, 32); & 1 drops the sign fill
    return bits.flatten(-2)[..., :num_cols].bool()


# ---------------------------------------------------------------------------------------------
# Reference (plain torch, fp32)
# ---------------------------------------------------------------------------------------------


def tree_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    tree_bits: torch.Tensor,
    scale: float,
    *,
    prefix_start: torch.Tensor | None = None,
    softcap: float | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Obviously-correct tree attention in fp32 (materialises the (B, Hq, T, L) scores).

    Args:
        q: (B, Hq, T, D) queries, one per tree node.
        k, v: (B, Hkv, L, D) keys / values; Hq % Hkv == 0 and query head h reads KV head
            h // (Hq // Hkv). Positions [0, prefix_len) are the prefix, the rest the tree region.
        prefix_len: number of committed prefix positions, attended by every query.
        tree_bits: int32 (B, T, W) from `pack_tree_mask`, W >= ceil((L - prefix_len) / 32).
        scale: softmax scale applied to q @ k^T.
        prefix_start: int32 (B, T), the first prefix position each query sees (a window's start);
            None: all of them.
        softcap: if set, scores become softcap * tanh(scores / softcap) before the softmax.
        lengths: int32 (B, 2) on the device, each row's (prefix length, tree region length): then prefix_len
            is ignored (None) and row b's tree region is [lengths[b, 0], lengths[b, 0] + lengths[b, 1]);
            positions after it are never attended (a fixed-size cache, read whole by a captured step).

    Returns:
        (B, Hq, T, D) in q.dtype. Rows that attend nothing are zeros.
    """
    _check_shapes(q, k, v, prefix_len, tree_bits, prefix_start, lengths)
    B, Hq, T, _ = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    kf = k.float().repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, L, D)
    vf = v.float().repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, L, D)
    if lengths is None:
        prefix = torch.ones(B, T, prefix_len, dtype=torch.bool, device=q.device)
        if prefix_start is not None:
            prefix = torch.arange(prefix_len, device=q.device) >= prefix_start[..., None]  # (B, T, prefix_len)
        allowed = torch.cat([prefix, unpack_tree_mask(tree_bits, L - prefix_len)], dim=-1)  # (B, T, L)
    else:  # per-row lengths on the device, read by no host (a replayed step, the device round's phases)
        c = torch.arange(L, device=q.device)
        p, s = lengths[:, 0, None, None].long(), lengths[:, 1, None, None].long()  # (B, 1, 1)
        first = prefix_start[..., None] if prefix_start is not None else 0
        column = (c - p).expand(B, T, L)  # each position's tree column (negative in the prefix)
        bits = unpack_tree_mask(tree_bits, 32 * tree_bits.shape[-1])  # (B, T, 32 W)
        tree = bits.gather(2, column.clamp(0, bits.shape[-1] - 1)) & (column >= 0) & (column < s)
        allowed = ((c < p) & (c >= first)) | tree  # (B, T, L)
    scores = (q.float() @ kf.transpose(-1, -2)) * scale  # (B, Hq, T, L)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # all -inf rows give NaN here ...
    probs = torch.where(allowed.any(-1)[:, None, :, None], probs, 0.0)  # ... and zeros here
    return (probs @ vf).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------


def _jit(fn=None, **kwargs):
    """`triton.jit`, or the plain function where Triton is missing (it is then never launched)."""
    if triton is None:
        return fn if fn is not None else (lambda f: f)
    return triton.jit(fn, **kwargs)


@_jit
def _attend_block(
    q, k_base, v_base, stride_kl, stride_vl, n, n_ok, d, d_ok, visible,
    m_i, l_i, acc, qk_scale, softcap,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, SOFTCAP: tl.constexpr,
):  # fmt: skip
    """Online-softmax update of (m_i, l_i, acc) with the KV positions n (BLOCK_N,).

    `visible` (BLOCK_M or 1, BLOCK_N) says which scores count; scores are in the log2 domain.
    With SOFTCAP, qk_scale is the plain softmax scale and the cap's output is moved to log2.
    """
    kv_mask = n_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + n[:, None] * stride_kl + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_base + n[:, None] * stride_vl + d[None, :], mask=kv_mask, other=0.0)
    p_dtype = v.dtype
    if UPCAST_DOT:  # the interpreter multiplies bf16 tiles as raw uint16 bits; fp32 is exact
        k, v = k.to(tl.float32), v.to(tl.float32)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # (BLOCK_M, BLOCK_N)
    if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 2 sigmoid(2x) - 1; then to the log2 domain
        s = softcap * (2.0 * tl.sigmoid(2.0 * s / softcap) - 1.0) * 1.4426950408889634
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row that has seen nothing yet has m_new = -inf; subtracting 0 instead keeps
    # exp2(-inf - -inf) = NaN out of alpha and p (both become exactly 0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(p_dtype).to(v.dtype)  # P @ V in the input dtype, as flash attention does
    acc = tl.dot(p, v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@_jit(do_not_specialize=["L", "prefix_len"])  # both change every step: do not recompile for them
def _tree_attn_fwd_kernel(
    q_ptr, k_ptr, v_ptr, bits_ptr, start_ptr, lengths_ptr, out_ptr, part_o_ptr, part_lse_ptr,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_kh, stride_kl,
    stride_vb, stride_vh, stride_vl,
    stride_mb, stride_mt, stride_mw,
    stride_sb, stride_st,
    Hkv, T, L, prefix_len, split_len, num_splits, qk_scale, softcap,
    GROUP: tl.constexpr, D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    WRITE_FINAL: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr,
    HAS_START: tl.constexpr, SOFTCAP: tl.constexpr, DEVICE_LENGTHS: tl.constexpr,
):  # fmt: skip
    """One program: all GROUP query heads x T queries of one KV head, over one split of the prefix.

    Rows of the tile are the flattened (group, t) pairs, so each K/V block is read once for the
    whole GQA group instead of once per query head. The last split also covers the tree region.
    With HAS_START each row sees the prefix from its own start on (a window), and blocks before
    the smallest start are skipped. With DEVICE_LENGTHS each batch row's prefix length and tree
    region length are read from `lengths_ptr` (B, 2) instead of the launch's prefix_len and L, so
    one launch (a captured CUDA graph) serves every step; splits past a row's prefix do nothing.
    """
    tl.static_assert(BLOCK_N == 64)  # a tree block spans exactly two mask words
    pid_bh, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kvh = (pid_bh // Hkv).to(tl.int64), pid_bh % Hkv  # int64: b * stride_kb can pass 2**31
    if DEVICE_LENGTHS:
        prefix_len = tl.load(lengths_ptr + 2 * b)
        S = tl.load(lengths_ptr + 2 * b + 1)
    else:
        S = L - prefix_len
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < GROUP * T
    g, t = rows // T, rows % T
    h = kvh * GROUP + g  # query head of each row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D  # head dims like 80 and 96 run in a padded power-of-two block
    cols = tl.arange(0, BLOCK_N)

    q_off = b * stride_qb + h[:, None] * stride_qh + t[:, None] * stride_qt + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    k_base = k_ptr + b * stride_kb + kvh * stride_kh
    v_base = v_ptr + b * stride_vb + kvh * stride_vh
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max, log2 domain
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Prefix: without a window every row sees every position, so only the ragged last block
    # needs a bound; with one, each row also has a first position.
    lo = split * split_len
    hi = tl.minimum(lo + split_len, prefix_len)
    if HAS_START:
        row_start = tl.load(start_ptr + b * stride_sb + t * stride_st, mask=row_ok, other=prefix_len)
        first = tl.min(row_start, 0)
        lo = tl.maximum(lo, lo + (first - lo) // BLOCK_N * BLOCK_N)  # skip whole blocks no row sees
        for start in range(lo, hi, BLOCK_N):
            n = start + cols
            n_ok = n < hi
            visible = n_ok[None, :] & (n[None, :] >= row_start[:, None])
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, stride_kl, stride_vl, n, n_ok, d, d_ok, visible,
                m_i, l_i, acc, qk_scale, softcap, DOT_PRECISION, UPCAST_DOT, SOFTCAP,
            )  # fmt: skip
    else:
        for start in range(lo, hi, BLOCK_N):
            n = start + cols
            n_ok = n < hi
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, stride_kl, stride_vl, n, n_ok, d, d_ok, n_ok[None, :],
                m_i, l_i, acc, qk_scale, softcap, DOT_PRECISION, UPCAST_DOT, SOFTCAP,
            )  # fmt: skip

    # Tree region (short): blocks start at tree column 0, 64, ..., so block j reads mask words
    # 2j and 2j + 1 of each row and picks one by column, with no per-element gather.
    if split == num_splits - 1:
        bits_row = bits_ptr + b * stride_mb + t * stride_mt  # (BLOCK_M,)
        last_word = (S - 1) // 32  # the bits buffer may end right after it
        for c0 in range(0, S, BLOCK_N):
            col = c0 + cols  # tree column
            word_lo = tl.load(bits_row + (c0 // 32) * stride_mw, mask=row_ok, other=0)
            # Past the last word the high half of the block is beyond S anyway (n_ok below).
            hi_word = tl.minimum(c0 // 32 + 1, last_word)
            word_hi = tl.load(bits_row + hi_word * stride_mw, mask=row_ok, other=0)
            word = tl.where((cols < 32)[None, :], word_lo[:, None], word_hi[:, None])
            n_ok = col < S
            visible = (((word >> (col & 31)[None, :]) & 1) != 0) & n_ok[None, :]
            m_i, l_i, acc = _attend_block(
                q, k_base, v_base, stride_kl, stride_vl, prefix_len + col, n_ok, d, d_ok,
                visible, m_i, l_i, acc, qk_scale, softcap, DOT_PRECISION, UPCAST_DOT, SOFTCAP,
            )  # fmt: skip

    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # rows that saw nothing stay 0
    r = (b * Hkv * GROUP + h) * T + t  # flattened (b, h, t) index of each row
    o_mask = row_ok[:, None] & d_ok[None, :]
    if WRITE_FINAL:
        tl.store(out_ptr + r[:, None] * D + d[None, :], o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # A split no row sees (outside every window) leaves lse = -inf, which weighs 0 when
        # combined; the last split always counts (each node sees itself).
        part = r * num_splits + split
        tl.store(part_o_ptr + part[:, None] * D + d[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + part, m_i + tl.log2(l_i), mask=row_ok)


@_jit
def _tree_attn_combine_kernel(
    part_o_ptr, part_lse_ptr, out_ptr, num_splits,
    D: tl.constexpr, SPLITS_P2: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """One program per (b, h, t) row: merge the per-split outputs by their log-sum-exp."""
    r = tl.program_id(0).to(tl.int64)
    sp = tl.arange(0, SPLITS_P2)
    d = tl.arange(0, BLOCK_D)
    sp_ok, d_ok = sp < num_splits, d < D
    lse = tl.load(part_lse_ptr + r * num_splits + sp, mask=sp_ok, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))  # padding splits (lse = -inf) weigh 0
    o_off = (r * num_splits + sp)[:, None] * D + d[None, :]
    o = tl.load(part_o_ptr + o_off, mask=sp_ok[:, None] & d_ok[None, :], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(total == 0.0, 1.0, total)  # a row that saw nothing: zeros
    tl.store(out_ptr + r * D + d, out.to(out_ptr.dtype.element_ty), mask=d_ok)


# ---------------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------------


def _kernels_interpreted() -> bool:
    """Whether the kernels, and Triton's own helpers they call, run in the interpreter.

    Both are fixed when they are wrapped: Triton's at `import triton`, ours at import of this
    module. TRITON_INTERPRET=1 set in between leaves a mix that can run nowhere.
    """
    interpreted = lambda fn: type(fn).__name__ == "InterpretedFunction"  # noqa: E731
    return interpreted(_tree_attn_fwd_kernel) and interpreted(tl.zeros)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def triton_available(device: torch.device | str | None = None) -> bool:
    """Whether `tree_attention` can run for tensors on `device` (default: on some device).

    True when Triton is installed and either its interpreter is on (kernels run on the CPU;
    TRITON_INTERPRET=1 must be set before `triton` is first imported) or CUDA/ROCm is present.
    Callers fall back to `tree_attention_reference` otherwise.
    """
    if triton is None:
        return False
    if _kernels_interpreted():
        return True
    if device is not None and torch.device(device).type != "cuda":
        return False
    return torch.cuda.is_available()


def _check_shapes(q, k, v, prefix_len, tree_bits, prefix_start=None, lengths=None) -> None:
    """Shape checks shared by the reference and the kernel."""
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"expected q (B, Hq, T, D) and k, v (B, Hkv, L, D) of equal shape, got q "
            f"{tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}; KV caches laid out as "
            f"(B, L, H, D) need .transpose(1, 2) first."
        )
    B, Hq, T, D = q.shape
    Bk, Hkv, L, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim; pass the "
            f"KV cache of this layer and batch."
        )
    if Hkv == 0 or Hq % Hkv != 0:
        raise ValueError(
            f"query heads Hq={Hq} must be a multiple of KV heads Hkv={Hkv} (grouped-query "
            f"attention); check the head counts passed for this layer."
        )
    if lengths is not None:
        if lengths.shape != (B, 2) or lengths.dtype != torch.int32:
            raise ValueError(
                f"lengths must be int32 (B={B}, 2): each row's (prefix length, tree region length), got dtype="
                f"{lengths.dtype} shape={tuple(lengths.shape)}."
            )
        prefix_len = 0  # per row, on the device: the bits must cover every column after the shortest prefix
    elif isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or not 0 <= prefix_len <= L:
        raise ValueError(
            f"prefix_len={prefix_len!r} must be a Python int in [0, L={L}]; pass the committed "
            f"length as an int (not a tensor, which would need a host sync), or per-row `lengths` on the device."
        )
    S = L - prefix_len if lengths is None else 0  # device lengths: the caller sizes the bits (W >= S_b / 32)
    need_words = (S + 31) // 32
    if tree_bits.dtype != torch.int32 or tree_bits.dim() != 3:
        raise ValueError(
            f"tree_bits must be int32 (B, T, W), got dtype={tree_bits.dtype} shape="
            f"{tuple(tree_bits.shape)}; build it with pack_tree_mask(mask)."
        )
    if tree_bits.shape[0] != B or tree_bits.shape[1] != T or tree_bits.shape[2] < need_words:
        raise ValueError(
            f"tree_bits shape {tuple(tree_bits.shape)} must be (B={B}, T={T}, W>={need_words}) to "
            f"cover S={S} tree columns (L={L} - prefix_len={prefix_len}); pack a (B, T, S) mask "
            f"with pack_tree_mask, or check prefix_len."
        )
    if prefix_start is not None and (prefix_start.shape != (B, T) or prefix_start.dtype != torch.int32):
        raise ValueError(
            f"prefix_start must be int32 (B={B}, T={T}), got dtype={prefix_start.dtype} shape="
            f"{tuple(prefix_start.shape)}; pass each query's first visible prefix position, or None."
        )


def _check_kernel_inputs(q, k, v, tree_bits) -> None:
    """Dtype, device and layout checks that only the Triton path needs."""
    if q.dtype not in _SUPPORTED_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(
            f"q, k, v must share one dtype out of fp32, fp16, bf16; got {q.dtype}, {k.dtype}, "
            f"{v.dtype}. Cast them (e.g. k.to(q.dtype)) before calling."
        )
    devices = {q.device, k.device, v.device, tree_bits.device}
    if len(devices) != 1:
        raise ValueError(
            f"q, k, v, tree_bits must be on one device, got {sorted(map(str, devices))}; move "
            f"them with .to(q.device)."
        )
    if not triton_available(q.device):
        raise ValueError(
            f"the Triton path cannot run on device {q.device} here (Triton installed: "
            f"{triton is not None}, interpreter on: {triton is not None and _kernels_interpreted()}"
            f"); use CUDA tensors, or for CPU set TRITON_INTERPRET=1 before anything imports "
            f"triton (torch._dynamo does), or call tree_attention_reference when "
            f"triton_available() is False."
        )
    D = q.shape[-1]
    if not 1 <= D <= _MAX_HEAD_DIM:
        raise ValueError(f"head dim D={D} is not supported; use 1 <= D <= {_MAX_HEAD_DIM}.")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.stride(-1) != 1:
            raise ValueError(
                f"{name} must be contiguous along the head dim (stride(-1) == 1), got strides "
                f"{x.stride()}; slicing along L or heads is fine, but call .contiguous() on a "
                f"tensor that was transposed in its last dim."
            )


def _launch_config(dtype: torch.dtype, rows: int, D: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_D, num_warps) for `rows` = group * T query rows of head dim D.

    Sized from sm_90 builds (ptxas, no spills for 16-bit inputs): 8 warps keep 32- and 64-row
    tiles of D = 128 near 130 registers, where 4 warps need ~200. D = 256 stays at 32 rows so
    shared memory (~86 KB with two stages) fits GPUs smaller than Hopper too.
    """
    block_d = max(16, _next_pow2(D))  # tl.dot needs every tile dim >= 16
    block_m = min(_MAX_BLOCK_M[dtype], max(16, _next_pow2(rows)), 32 if block_d > 128 else 64)
    return block_m, block_d, 4 if block_m <= 16 else 8


def _pick_splits(prefix_len: int, programs_per_split: int, device: torch.device) -> int:
    """Flash-decoding split count over the prefix: about _WAVES programs per SM, each split
    at least _MIN_SPLIT_LEN long.

    E.g. prefix 32k, B = 1, Hkv = 8, one row block, 132 SMs -> 33 splits (264 programs);
    prefix < 2 * _MIN_SPLIT_LEN -> 1 split (no combine launch).
    """
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        num_sms = _DEFAULT_NUM_SMS
    want = _cdiv(_WAVES * num_sms, programs_per_split)
    return max(1, min(want, prefix_len // _MIN_SPLIT_LEN, _MAX_SPLITS))


def tree_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix_len: int,
    tree_bits: torch.Tensor,
    scale: float | None = None,
    *,
    prefix_start: torch.Tensor | None = None,
    softcap: float | None = None,
    num_splits: int | None = None,
    lengths: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused tree attention (Triton); same contract as `tree_attention_reference`.

    Args:
        q: (B, Hq, T, D) queries, fp32 / fp16 / bf16, contiguous in D.
        k, v: (B, Hkv, L, D), same dtype as q, contiguous in D; any other strides (e.g. a
            slice [:, :, :L] of a preallocated cache) are read as they are, without a copy.
        prefix_len: committed prefix length (Python int), attended by every query.
        tree_bits: int32 (B, T, W) from `pack_tree_mask`, W >= ceil((L - prefix_len) / 32);
            extra words (a fixed-size buffer) are ignored.
        scale: softmax scale; defaults to D ** -0.5.
        prefix_start: int32 (B, T), the first prefix position each query sees (a sliding window's
            or chunk's start); None: the whole prefix.
        softcap: if set, scores become softcap * tanh(scores / softcap) before the softmax.
        num_splits: how many programs share the prefix of one (batch, KV head) (tests,
            benchmarks); None picks it from prefix_len and the SM count.
        lengths: int32 (B, 2) per-row (prefix length, tree region length) on the device, instead of
            prefix_len (None): nothing in the launch then depends on them, so a CUDA graph captured once
            serves every step; the prefix is split as if it filled all L positions.

    Returns:
        (B, Hq, T, D) contiguous, in q.dtype; rows that attend nothing are zeros.
    """
    _check_shapes(q, k, v, prefix_len, tree_bits, prefix_start, lengths)
    _check_kernel_inputs(q, k, v, tree_bits)
    if lengths is not None:
        prefix_len = L = k.shape[2]  # the splits cover every position; each row stops at its own
    B, Hq, T, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    group = Hq // Hkv
    scale = D**-0.5 if scale is None else float(scale)
    out = torch.empty(B, Hq, T, D, dtype=q.dtype, device=q.device)
    if L == 0 or T == 0:
        return out.zero_()

    block_m, block_d, num_warps = _launch_config(q.dtype, group * T, D)
    m_blocks = _cdiv(group * T, block_m)
    if num_splits is None:
        num_splits = _pick_splits(prefix_len, B * Hkv * m_blocks, q.device)
    if num_splits < 1:
        raise ValueError(f"num_splits={num_splits} must be >= 1 (or None to choose one).")
    # Whole KV blocks per split, so only the last block of the prefix is ragged.
    split_len = max(_BLOCK_N, _cdiv(_cdiv(prefix_len, num_splits), _BLOCK_N) * _BLOCK_N)
    num_splits = max(1, _cdiv(prefix_len, split_len))
    if tree_bits.numel() == 0:  # S == 0: never read, but avoid handing Triton a null pointer
        tree_bits = torch.zeros(B, T, 1, dtype=torch.int32, device=q.device)
    if num_splits > 1:
        part_o = torch.empty(B * Hq * T, num_splits, D, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B * Hq * T, num_splits, dtype=torch.float32, device=q.device)
    else:  # the forward kernel writes `out` directly; these are never touched
        part_o = part_lse = out
    has_start = prefix_start is not None
    starts = prefix_start.to(q.device) if has_start else tree_bits  # never read without HAS_START
    # With a softcap the kernel caps natural-log scores, then moves them to the log2 domain itself.
    qk_scale = scale if softcap is not None else scale * math.log2(math.e)
    device_lengths = lengths is not None
    lengths = lengths if device_lengths else tree_bits  # never read without DEVICE_LENGTHS

    _tree_attn_fwd_kernel[(B * Hkv, num_splits, m_blocks)](
        q, k, v, tree_bits, starts, lengths, out, part_o, part_lse,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        tree_bits.stride(0), tree_bits.stride(1), tree_bits.stride(2),
        starts.stride(0), starts.stride(1),
        Hkv, T, L, prefix_len, split_len, num_splits, qk_scale, float(softcap or 1.0),
        GROUP=group, D=D, BLOCK_M=block_m, BLOCK_N=_BLOCK_N, BLOCK_D=block_d,
        WRITE_FINAL=num_splits == 1, HAS_START=has_start, SOFTCAP=softcap is not None,
        DEVICE_LENGTHS=device_lengths,
        # fp32 inputs would otherwise go through tf32 on tensor cores (~1e-3 relative error).
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOT=_kernels_interpreted() and q.dtype == torch.bfloat16,
        num_warps=num_warps, num_stages=2,
    )  # fmt: skip
    if num_splits > 1:
        _tree_attn_combine_kernel[(B * Hq * T,)](
            part_o, part_lse, out, num_splits,
            D=D, SPLITS_P2=_next_pow2(num_splits), BLOCK_D=block_d, num_warps=4,
        )  # fmt: skip
    return out
