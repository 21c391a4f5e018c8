"""Benchmark: fused Triton tree attention vs. torch sdpa with a dense boolean mask.

On CUDA, for every prefix length and tree size it reports the median time of

    tree      swiftspec_kernels.tree_attention (packed mask, GQA without repeating K/V)
    dense     F.scaled_dot_product_attention(attn_mask=(B, 1, T, L) bool, enable_gqa=True),
              whichever backend torch picks
    effic.    the memory-efficient sdpa backend with the same mask (K/V repeated to Hq heads
              beforehand, outside the timing, since it has no GQA)
    flash     the flash sdpa backend *without* a mask (it takes none): not the same
              computation, a floor for what reading the same K/V costs

plus the speed-up of `tree` over `dense` and its achieved bandwidth, (Q + K + V bytes) / time,
as a fraction of --peak-gbps. L2 is flushed before every timed call, so K/V come from HBM.
Without CUDA it only checks correctness on two small shapes under the Triton interpreter.
`--json PATH` also writes the rows (times in ms; null where a backend refused the case).

    python kernels/benchmarks/bench_tree_attention.py --dtype bf16 --peak-gbps 4800 --json tree_attention.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix", type=int, nargs="+", default=[2**i for i in range(9, 16)])
    p.add_argument("--tree", type=int, nargs="+", default=[1, 8, 16, 64], help="tree sizes T")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--q-heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="bf16")
    p.add_argument("--peak-gbps", type=float, default=4800.0, help="HBM peak; 4800 is an H200")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--json", type=Path, default=None, help="also write the rows (and these settings) to this file")
    return p.parse_args()


def import_kernels():
    """swiftspec_kernels, installed or straight from this checkout."""
    try:
        import swiftspec_kernels
    except ImportError:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "torch-ext"))
        import swiftspec_kernels
    return swiftspec_kernels


def random_tree_mask(B: int, T: int, gen: torch.Generator) -> torch.Tensor:
    """(B, T, T) bool ancestor-or-self masks of random trees (parent[i] uniform in [0, i))."""
    masks = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        masks[b, 0, 0] = True
        for i in range(1, T):
            parent = int(torch.randint(0, i, (1,), generator=gen))
            masks[b, i] = masks[b, parent]
            masks[b, i, i] = True
    return masks


def make_case(args, prefix_len: int, T: int, dtype: torch.dtype, device: str, sk):
    """q (B, Hq, T, D), k, v (B, Hkv, L, D), tree_bits (B, T, W), dense mask (B, 1, T, L).

    Drawn on `device` (a 32k prefix is gigabytes of CPU randn otherwise); the tree on the CPU."""
    gen = torch.Generator(device).manual_seed(prefix_len * 131 + T)
    B, Hq, Hkv, D, L = args.batch, args.q_heads, args.kv_heads, args.head_dim, prefix_len + T
    q = torch.randn(B, Hq, T, D, generator=gen, device=device).to(dtype)
    k = torch.randn(B, Hkv, L, D, generator=gen, device=device).to(dtype)
    v = torch.randn(B, Hkv, L, D, generator=gen, device=device).to(dtype)
    tree = random_tree_mask(B, T, torch.Generator().manual_seed(prefix_len * 131 + T))
    dense = torch.cat([torch.ones(B, T, prefix_len, dtype=torch.bool), tree], dim=-1)
    return q, k, v, sk.pack_tree_mask(tree).to(device), dense[:, None].to(device)


def time_ms(fn, warmup: int, iters: int, flush: torch.Tensor) -> float:
    """Median CUDA-event time of fn() in ms, with L2 flushed (outside the events) before each; on
    the CPU (smoke runs: numbers that mean nothing) the median wall time."""
    for _ in range(warmup):
        fn()
    if flush.device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(1000 * (time.perf_counter() - start))
        return statistics.median(times)
    new_event = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    events = [(new_event(), new_event()) for _ in range(iters)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def sdpa_with(backend, q, k, v, **kwargs):
    """A closure running sdpa on one backend (None: torch's choice), or None if it refuses."""
    from torch.nn.attention import sdpa_kernel

    def run():
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v, **kwargs)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    try:
        run()
    except RuntimeError:
        return None
    return run


# (row key, header, width, format): the printed table and the markdown of examples/gpu_session.py
COLUMNS = [
    ("prefix", "prefix", 7, "d"), ("T", "T", 3, "d"), ("tree_ms", "tree ms", 8, ".4f"),
    ("dense_ms", "dense ms", 9, ".4f"), ("effic_ms", "effic. ms", 9, ".4f"), ("flash_ms", "flash ms", 9, ".4f"),
    ("speedup_vs_dense", "vs dense", 8, ".2f"), ("gbps", "GB/s", 7, ".0f"), ("pct_peak", "% peak", 6, ".1f"),
]  # fmt: skip


def format_cell(value, fmt: str) -> str:
    return "nan" if value is None else format(value, fmt)


def bench_case(args, sk, prefix_len: int, T: int, dtype: torch.dtype, device: str, flush: torch.Tensor) -> dict:
    """One (prefix, T) case: checked against sdpa, then each backend timed; times None where one refuses."""
    from torch.nn.attention import SDPBackend

    q, k, v, bits, dense = make_case(args, prefix_len, T, dtype, device, sk)
    out = sk.tree_attention(q, k, v, prefix_len, bits)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)

    tree = lambda: sk.tree_attention(q, k, v, prefix_len, bits)  # noqa: E731
    ms = {"tree": time_ms(tree, args.warmup, args.iters, flush)}
    group = args.q_heads // args.kv_heads
    k_rep, v_rep = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    runs = {
        "dense": sdpa_with(None, q, k, v, attn_mask=dense, enable_gqa=True),
        "effic": sdpa_with(SDPBackend.EFFICIENT_ATTENTION, q, k_rep, v_rep, attn_mask=dense),
        "flash": sdpa_with(SDPBackend.FLASH_ATTENTION, q, k, v, enable_gqa=True),
    }
    for name, run in runs.items():
        ms[name] = time_ms(run, args.warmup, args.iters, flush) if run else None

    read_bytes = (q.numel() + k.numel() + v.numel()) * q.element_size()
    gbps = read_bytes / (ms["tree"] * 1e-3) / 1e9
    return {
        "dtype": args.dtype, "batch": args.batch, "q_heads": args.q_heads, "kv_heads": args.kv_heads,
        "head_dim": args.head_dim, "prefix": prefix_len, "T": T,
        **{f"{name}_ms": value for name, value in ms.items()},
        "speedup_vs_dense": ms["dense"] / ms["tree"] if ms["dense"] else None,
        "gbps": gbps,
        "pct_peak": 100 * gbps / args.peak_gbps,
    }  # fmt: skip


def bench(args, sk, device: str = "cuda") -> list[dict]:
    """Every (prefix, T) case of one head configuration; prints each row as it is measured."""
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    flush_mib = 256 if device == "cuda" else 8  # > any GPU's L2
    flush = torch.empty(flush_mib * 2**20, dtype=torch.int8, device=device)
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"{name}: B={args.batch} Hq={args.q_heads} Hkv={args.kv_heads} "
          f"D={args.head_dim} {args.dtype}, peak {args.peak_gbps:.0f} GB/s")  # fmt: skip
    print(" ".join(f"{header:>{width}}" for _, header, width, _ in COLUMNS))
    rows = []
    for prefix_len in args.prefix:
        for T in args.tree:
            rows.append(bench_case(args, sk, prefix_len, T, dtype, device, flush))
            print(" ".join(f"{format_cell(rows[-1][key], fmt):>{width}}" for key, _, width, fmt in COLUMNS), flush=True)
    return rows


def write_json(path: Path, args, rows: list[dict]) -> None:
    """The rows and the settings they ran under."""
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    path.write_text(json.dumps({"device": device, "torch": torch.__version__, "settings": settings, "rows": rows}, indent=1))


def check_cpu(sk) -> None:
    """Interpreter correctness on two small shapes: timings on CPU would mean nothing."""
    print("No CUDA device: checking correctness under the Triton interpreter only, no timings.")
    args = argparse.Namespace(batch=1, q_heads=8, kv_heads=2, head_dim=64)
    for prefix_len, T in ((97, 8), (700, 5)):
        q, k, v, bits, dense = make_case(args, prefix_len, T, torch.float16, "cpu", sk)
        out = sk.tree_attention(q, k, v, prefix_len, bits)
        q32, k32, v32 = q.float(), k.float(), v.float()
        want = F.scaled_dot_product_attention(q32, k32, v32, attn_mask=dense, enable_gqa=True)
        torch.testing.assert_close(out.float(), want, atol=2e-3, rtol=2e-3)
        err = (out.float() - want).abs().max()
        print(f"  prefix {prefix_len:>4}, T {T}: matches sdpa (max abs err {err:.1e})")


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first `import triton`
    sk = import_kernels()
    if torch.cuda.is_available():
        rows = bench(args, sk)
        if args.json is not None:
            write_json(args.json, args, rows)
    else:
        check_cpu(sk)


if __name__ == "__main__":
    main()
