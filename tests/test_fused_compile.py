"""The fused bookkeeping kernels (swiftspec_kernels) compiled for a GPU on this CPU: each kernel's launch is recorded
once under Triton's interpreter (the argument types of a real call: the kernel tests' inputs), then compiled ahead of
time for an H100/H200 (sm_90) with Triton's own compiler and ptxas, down to a cubin. What the interpreter forgives (a
store of the wrong type, an operation the GPU backend lacks, a shape that is not a power of two) fails here; whether
the cubin computes what the reference does is the GPU lease's test (tests/test_fused_*.py on CUDA)."""

import importlib
import inspect
import json
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")

import test_fused_kernels as kernels  # noqa: E402
import test_fused_merge as merges  # noqa: E402
import test_fused_select as selects  # noqa: E402
import test_tree_reroot as reroots  # noqa: E402

MODULES = ["tree_walk", "tree_mask", "advance_rows", "commit_slots", "record_walk", "tree_level", "tree_merge",
           "tree_select", "tree_reroot"]
POINTER = {torch.int64: "*i64", torch.int32: "*i32", torch.int8: "*i8", torch.bool: "*i1", torch.float32: "*fp32",
           torch.float64: "*fp64", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
pytestmark = pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
                                reason="records launches in Triton's interpreter (a GPU runs the kernels themselves)")


class Recorder:
    """Stands in for a kernel: kernel[grid](*args, **constexprs) records the call and runs the real one."""

    def __init__(self, kernel, calls: list):
        self.kernel, self.calls = kernel, calls

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, kwargs))
            return self.kernel[grid](*args, **kwargs)
        return launch


def signature_of(fn, args, kwargs) -> tuple[dict, dict]:
    names = list(inspect.signature(fn).parameters)
    signature, constexprs = {}, dict(kwargs)
    for name, value in zip(names, args):
        if isinstance(value, torch.Tensor):
            signature[name] = POINTER[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i64" if abs(value) >= 2**31 else "i32"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} is a {type(value).__name__}")
    for name in constexprs:
        signature[name] = "constexpr"
    return signature, constexprs


def recorded_launches(monkeypatch) -> dict[str, list]:
    """Every fused kernel's launches while the kernel-against-reference tests run (a few shapes each)."""
    calls = {}
    for name in MODULES:
        module = importlib.import_module(f"swiftspec_kernels.{name}")
        attribute = f"_{name}_kernel"
        calls[name] = []
        monkeypatch.setattr(module, attribute, Recorder(getattr(module, attribute), calls[name]))
    kernels.test_the_walk_kernel_equals_its_reference((5, 8, 1))
    for rows in (False, True):
        kernels.test_the_mask_kernel_equals_its_reference_and_tree_visible(rows, torch.bfloat16)
        kernels.test_the_windowed_mask_kernel_equals_its_reference_and_the_rule(kernels.LayerMask("sliding", 3), rows)
    kernels.test_the_advance_kernel_equals_its_reference()
    kernels.test_the_commit_kernel_equals_its_reference_and_commit_plan("kv")
    kernels.test_the_record_kernel_equals_its_reference(3)
    merges.test_the_merge_kernel_equals_its_reference("grown", (3, 2), 8, 3)
    selects.test_the_selection_kernel_equals_its_reference((4, 7, 3))
    selects.test_the_level_kernel_equals_its_reference(selects.LEVELS[3])
    reroots.test_the_reroot_kernel_equals_its_reference(*reroots.SHAPES[2])
    return calls


COMPILE = """
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
done = {}
for name, signature, constexprs in json.load(sys.stdin):
    fn = getattr(importlib.import_module("swiftspec_kernels." + name), "_" + name + "_kernel")
    fn = fn if isinstance(fn, JITFunction) else JITFunction(fn.fn)
    kernel = triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
    done[name] = done.get(name, 0) + bool(kernel.asm["cubin"])
print(json.dumps(done))
"""


def test_every_fused_kernel_compiles_for_an_h100(monkeypatch):
    calls = recorded_launches(monkeypatch)
    jobs, seen = [], set()
    for name in MODULES:
        assert calls[name], f"no launch of {name}'s kernel was recorded: its test did not run the Triton path"
        fn = getattr(importlib.import_module(f"swiftspec_kernels.{name}"), f"_{name}_kernel").kernel.fn
        for args, kwargs in calls[name]:
            signature, constexprs = signature_of(fn, args, kwargs)
            key = (name, tuple(signature.items()), tuple(sorted(constexprs.items())))
            if key not in seen:
                seen.add(key)
                jobs.append((name, signature, constexprs))
    # Triton's compiler in a process of its own: under the interpreter (this one) `tl` runs on the CPU instead
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", COMPILE], input=json.dumps(jobs), capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert compiled == {name: sum(1 for job in jobs if job[0] == name) for name in MODULES}
