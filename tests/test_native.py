"""The native bfloat16 kernels (kvstore/native) and their build.

The kernels: W @ x (+ add), RMSNorm, SwiGLU and rotary each close to a float64 reference rounded to
bfloat16, for any shape (tails included); their bits independent of the thread count and of the
other rows; the products' and RMSNorm's bits those of the contract's sums (a float32 torch
reference in the same order) on every path, AVX512-BF16 or AVX2; a model's prefill and decode with
them close to torch's kernels and bit-identical run to run. Those tests skip, saying why, where this
process runs torch's kernels (no AVX2, no compiler).

The build: once per source and flags, in the cache folder; a failing compiler, a missing one, a
killed build's temp file and a damaged library each handled (a plain C++ source stands in for the
kernel, so these run anywhere a compiler does).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

import kvstore
from conftest import threads
from kvstore.engine import native
from kvstore.engine import ops
from kvstore.engine.native import build
from native_paths import on_path, require_both

needs_native = pytest.mark.skipif(native.kernels() is None, reason=f"this process uses {native.status()}")
TORCH_ONLY = (None, "torch's kernels (test)")
needs_compiler = pytest.mark.skipif(not build.has_compiler(),
                                    reason="no C++ compiler on PATH")


def bf16(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def reference(w, x, add=None):
    exact = w.double() @ x.double() + (0 if add is None else add.double())
    return exact.to(torch.bfloat16)


# -- the kernel ----------------------------------------------------------------------------------
@needs_native
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 64, 1001])
@pytest.mark.parametrize("n", [1, 31, 32, 33, 576, 1000])
def test_product_matches_float64_rounded(rows, n):
    w, x, add = bf16(rows, n, seed=1), bf16(n, seed=2), bf16(rows, seed=3)
    gemv = native.kernels().gemv
    # float32 accumulation: off by a few float32 ulps of the row's magnitude before the one rounding
    assert_close(gemv(w, x).float(), reference(w, x).float(), rtol=2 ** -7, atol=1e-3)
    assert_close(gemv(w, x, add).float(), reference(w, x, add).float(), rtol=2 ** -7, atol=1e-3)


def lanes_summed(acc):
    """`[..., 16]` float32 lanes summed in the kernels' fixed tree (_mm512_reduce_add_ps's)."""
    eight = acc[..., 8:] + acc[..., :8]
    four = eight[..., 4:] + eight[..., :4]
    return (four[..., 0] + four[..., 2]) + (four[..., 1] + four[..., 3])


def contract_dot(w, x):
    """The dot products of kernels_bf16.cpp's contract, in float32 torch ops, bit for bit: 16 lanes,
    lane j of step k adding the product of pair 16k + j's odd elements, then of its even ones (a product
    of two bfloat16 values is exact in float32, so each fused multiply-add is one rounded add), the tail
    zero-padded, the lanes summed in the fixed tree."""
    rows, n = w.shape
    pad = -n % 32
    wf = torch.nn.functional.pad(w.float(), (0, pad)).view(rows, -1, 16, 2)
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(-1, 16, 2)
    acc = torch.zeros(rows, 16)
    for k in range(xf.shape[0]):
        acc = acc + wf[:, k, :, 1] * xf[k, :, 1]
        acc = acc + wf[:, k, :, 0] * xf[k, :, 0]
    return lanes_summed(acc)


@contextmanager
def bf16_path(path: str):
    """The bfloat16 ops on `path` inside the block: "best" (this CPU's), or "avx2" (skips where the best
    is AVX2 already: "best" runs it)."""
    if path == "best":
        yield
        return
    require_both("bf16")
    with on_path("bf16", path):
        yield


PATHS = ["best", "avx2"]


@needs_native
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("rows,n", [(5, 31), (64, 576), (7, 1000)])
def test_product_bits_are_the_contracts_on_every_path(rows, n, path):
    """AVX512-BF16 and AVX2 compute the same sums in the same order (values here are never
    subnormal, where vdpbf16ps would flush)."""
    w, x, add = bf16(rows, n, seed=21), bf16(n, seed=22), bf16(rows, seed=23)
    k, xs = native.kernels(), bf16(3, n, seed=24)
    with bf16_path(path):
        assert torch.equal(k.gemv(w, x), contract_dot(w, x).to(torch.bfloat16))
        assert torch.equal(k.gemv(w, x, add), (add.float() + contract_dot(w, x)).to(torch.bfloat16))
        assert torch.equal(k.gemv_rows(w, xs), torch.stack([contract_dot(w, r) for r in xs]).to(torch.bfloat16))


@needs_native
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("H", [17, 576])
def test_rms_norm_bits_are_the_contracts_on_every_path(H, path):
    x, w = bf16(4, H, seed=25), bf16(H, seed=26)
    squares = torch.nn.functional.pad(x.float() * x.float(), (0, -H % 16)).view(4, -1, 16)
    acc = torch.zeros(4, 16)
    for k in range(squares.shape[1]):
        acc = acc + squares[:, k]
    scale = 1 / torch.sqrt(lanes_summed(acc) / torch.tensor(float(H)) + torch.tensor(1e-5, dtype=torch.float32))
    expected = (x.float() * scale[:, None] * w.float()).to(torch.bfloat16)
    with bf16_path(path):
        assert torch.equal(native.kernels().rms_norm(x, w, 1e-5), expected)


@needs_native
def test_swiglu_and_rotary_take_the_same_steps_on_avx2():
    """Beside the sums above, the elementwise ops of the AVX2 path give the AVX512-BF16 path's bits
    (tails included); a path that does not exist, or that the CPU lacks, is refused."""
    k = native.kernels()
    gate_up, (cos, sin) = bf16(5, 2 * 1000, seed=31), rope_tables(9, 48)
    qk = bf16(9, 5, 48, seed=32)

    def both():
        return k.swiglu(gate_up), k.rope_(qk.clone(), cos[:, None], sin[:, None])

    with pytest.raises(RuntimeError, match=re.escape("bf16_isa: no path named 'avx512' (avx512-bf16, avx2, or '' for")):
        torch.ops.kvstore.bf16_isa("avx512")
    require_both("bf16")
    best = both()
    with on_path("bf16", "avx2"):
        assert torch.ops.kvstore.bf16_isa() == "avx2"
        avx2 = both()
    assert torch.ops.kvstore.bf16_isa() == "avx512-bf16"
    assert all(torch.equal(a, b) for a, b in zip(best, avx2))


@needs_native
def test_bits_do_not_depend_on_thread_count_or_other_rows():
    w, x = bf16(3072, 576, seed=4), bf16(576, seed=5)
    gemv = native.kernels().gemv
    with threads(1):
        one = gemv(w, x)
    with threads(2):
        two = gemv(w, x)
    assert torch.equal(one, two)
    assert torch.equal(gemv(w[7:1030], x), one[7:1030])  # rows in other blocks and other threads


@needs_native
def test_strided_inputs_give_the_contiguous_result():
    w, x, add = bf16(100, 64, seed=6), bf16(128, seed=7), bf16(200, seed=8)
    gemv = native.kernels().gemv
    assert torch.equal(gemv(w, x[::2], add[::2]), gemv(w, x[::2].contiguous(), add[::2].contiguous()))
    wide = bf16(100, 128, seed=9)
    assert torch.equal(gemv(wide[:, :64], x[:64]), gemv(wide[:, :64].contiguous(), x[:64]))


@needs_native
def test_wrong_inputs_are_refused_with_what_is_wrong():
    gemv = native.kernels().gemv
    with pytest.raises(RuntimeError, match="bfloat16"):
        gemv(torch.randn(4, 8), torch.randn(8))
    with pytest.raises(RuntimeError, match="the vector has 7 elements, the matrix 8 columns"):
        gemv(bf16(4, 8), bf16(7))
    with pytest.raises(RuntimeError, match="the addend has 3 elements, the matrix 4 rows"):
        gemv(bf16(4, 8), bf16(8), bf16(3))


def rms_reference(x, w, eps):
    x64 = x.double()
    return (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(torch.bfloat16)


def swiglu_reference(gate_up):
    g, u = gate_up.double().chunk(2, -1)
    return (torch.nn.functional.silu(g) * u).to(torch.bfloat16)


def rope_reference(x, cos, sin):
    x64 = x.double()
    return (x64 * cos.double() + x64.roll(x.shape[-1] // 2, -1) * sin.double()).to(torch.bfloat16)


def rope_tables(T, hd, seed=0):
    angles = torch.rand(T, hd // 2, generator=torch.Generator().manual_seed(seed)) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).bfloat16()
    return cos, torch.cat([-angles.sin(), angles.sin()], -1).bfloat16()


CLOSE = dict(rtol=2 ** -7, atol=1e-3)  # float32 inside, then one bfloat16 rounding


@needs_native
@pytest.mark.parametrize("shape", [(1,), (17,), (576,), (3, 5), (512, 576), (2, 3, 40)])
def test_rms_norm_and_swiglu_match_float64_rounded(shape):
    k = native.kernels()
    x, w = bf16(*shape, seed=10), (bf16(shape[-1], seed=11).abs() + 0.5).bfloat16()
    w2 = torch.cat([w, bf16(shape[-1], seed=12)])  # only the first half counts
    assert_close(k.rms_norm(x, w2, 1e-5).float(), rms_reference(x, w, 1e-5).float(), **CLOSE)
    gate_up = bf16(*shape[:-1], 2 * shape[-1], seed=13) * 4  # saturates the sigmoid both ways
    assert_close(k.swiglu(gate_up).float(), swiglu_reference(gate_up).float(), **CLOSE)


@needs_native
@pytest.mark.parametrize("T,heads,hd", [(1, 12, 64), (7, 4, 16), (512, 12, 64), (3, 2, 34)])
def test_rope_in_place_through_strides_matches_float64_rounded(T, heads, hd):
    k = native.kernels()
    qkv = bf16(T, (heads + 3) * hd, seed=14)  # q|k rotated in place, the rest untouched
    cos, sin = rope_tables(T, hd)
    expect = rope_reference(qkv[:, :heads * hd].reshape(T, heads, hd), cos[:, None], sin[:, None])
    out = qkv.clone()
    assert k.rope_(out[:, :heads * hd].view(T, heads, hd), cos[:, None], sin[:, None]) is not None
    assert_close(out[:, :heads * hd].view(T, heads, hd).float(), expect.float(), **CLOSE)
    assert torch.equal(out[:, heads * hd:], qkv[:, heads * hd:])
    one = qkv[0, :heads * hd].view(heads, hd).clone()  # the decode step's shape
    k.rope_(one, cos[:1], sin[:1])
    assert torch.equal(one, out[0, :heads * hd].view(heads, hd))


@needs_native
def test_elementwise_bits_do_not_depend_on_thread_count_or_other_rows():
    k = native.kernels()
    x, w2 = bf16(512, 576, seed=15), bf16(1152, seed=16)
    gate_up, (cos, sin) = bf16(512, 3072, seed=17), rope_tables(512, 64)
    qk = bf16(512, 12, 64, seed=18)

    def all_three():
        return k.rms_norm(x, w2, 1e-5), k.swiglu(gate_up), k.rope_(qk.clone(), cos[:, None], sin[:, None])

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = all_three()
        torch.set_num_threads(2)
        two = all_three()
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert torch.equal(k.rms_norm(x[100:101], w2, 1e-5), one[0][100:101])
    assert torch.equal(k.swiglu(gate_up[7]), one[1][7])


def test_ops_take_torch_for_other_dtypes_and_without_native(monkeypatch):
    w, x, b = torch.randn(6, 5), torch.randn(5), torch.randn(6)
    assert torch.equal(ops.matvec(w, x), torch.mv(w, x))
    assert torch.equal(ops.add_matvec(b, w, x), torch.addmv(b, w, x))
    monkeypatch.setattr(native, "_choice", TORCH_ONLY)
    wb, xb, bb = w.bfloat16(), x.bfloat16(), b.bfloat16()
    assert torch.equal(ops.matvec(wb, xb, bb), torch.addmv(bb, wb, xb))
    assert torch.equal(ops.add_matvec(bb, wb, xb, bb), bb + torch.addmv(bb, wb, xb))
    rows, w2 = bf16(4, 6, seed=19), bf16(12, seed=20)
    assert_close(ops.rms_norm(rows, w2, 1e-5).float(), rms_reference(rows, w2[:6], 1e-5).float(), **CLOSE)
    assert torch.equal(ops.vector_norm(rows[1], 1e-5)(rows[1], w2), ops.rms_norm(rows, w2, 1e-5)[1])
    gate_up = bf16(4, 12, seed=21)
    assert torch.equal(ops.swiglu(gate_up), torch.nn.functional.silu(gate_up[:, :6]) * gate_up[:, 6:])


@needs_native
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias"])
def test_a_model_on_the_kernels_is_close_to_torch_and_repeats_exactly(tiny, monkeypatch, name):
    model = kvstore.load_model(tiny(name).folder, dtype="bfloat16")
    ids = tiny(name).ids(30)

    def run():
        """Prefill logits of 20 tokens in chunks of 8, then 10 decode steps."""
        cache = model.new_cache()
        rows = [model.forward(ids[s:min(s + 8, 20)], s, cache, last_only=False) for s in range(0, 20, 8)]
        return torch.cat(rows + [model.forward(ids[p:p + 1], p, cache) for p in range(20, 30)])

    k, calls = native.kernels(), {}

    def counted(name):
        return lambda *a: calls.update({name: calls.get(name, 0) + 1}) or getattr(k, name)(*a)

    counting = dataclasses.replace(k, **{f.name: counted(f.name) for f in dataclasses.fields(k)})
    monkeypatch.setattr(native, "_choice", (counting, "counted"))
    ours = run()
    L = model.config.n_layers
    assert calls == {"gemv": 10 * (4 * L + 1), "rms_norm": 13 * (2 * L + 1), "swiglu": 13 * L, "rope_": 13 * L}
    assert torch.equal(ours, run())
    monkeypatch.setattr(native, "_choice", TORCH_ONLY)
    assert_close(ours, run(), rtol=0.05, atol=0.15)  # as test_engine_reference allows bfloat16 vs HF


def as_built(source: Path) -> None:
    """A file where `build.library(source)` puts its library: what `will_build` looks for (compiling the
    real kernels here took 23 s of the suite; their build is what every other native test loads)."""
    lib = build._library_path(source)
    lib.parent.mkdir(parents=True, exist_ok=True)
    lib.write_bytes(b"")


@needs_compiler
def test_will_build_says_whether_a_load_compiles(cache, monkeypatch):
    for choice in ("_choice", "_quant_choice", "_attention", "_layers"):
        monkeypatch.setattr(native, choice, None)
    assert native.will_build()  # a new cache folder
    as_built(native.SOURCE)
    as_built(native.QUANT_SOURCE)
    as_built(native.ATTENTION_SOURCE)
    assert native.will_build()  # the layer stack's library is still missing
    as_built(native.LAYERS_SOURCE)
    assert not native.will_build()
    cache_lib = next(cache.glob("kernels_bf16-*.so"))
    cache_lib.unlink()
    monkeypatch.setenv(native.ENV, "0")
    assert not native.will_build()


def test_native_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(native, "_choice", None)
    monkeypatch.setenv(native.ENV, "0")
    assert native.kernels() is None
    assert native.status() == "torch's kernels (KVSTORE_NATIVE=0)"


# -- the build -----------------------------------------------------------------------------------
def toy_source(folder: Path, answer: int = 42, body: str | None = None) -> Path:
    """A plain C++ library (no torch headers: compiles in a moment) standing in for the kernel."""
    src = folder / "toy.cpp"
    src.write_text(body or f'extern "C" int kvstore_toy() {{ return {answer}; }}\n')
    return src


def answer(lib: Path) -> int:
    return ctypes.CDLL(str(lib)).kvstore_toy()


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "kvstore" / "native"


@needs_compiler
def test_a_library_is_built_once_per_source(tmp_path, cache):
    src = toy_source(tmp_path)
    lib = build.library(src)
    assert lib.parent == cache and answer(lib) == 42
    built_at = lib.stat().st_mtime_ns
    assert build.library(src) == lib and lib.stat().st_mtime_ns == built_at
    changed = build.library(toy_source(tmp_path, answer=7))
    assert changed != lib and answer(changed) == 7
    assert sorted(p.name for p in cache.iterdir() if p.name.startswith(".")) == []  # no temp files left


@needs_compiler
def test_a_header_next_to_the_source_is_part_of_the_build(tmp_path, cache):
    (tmp_path / "toy.h").write_text("#define ANSWER 42\n")
    src = toy_source(tmp_path, body='#include "toy.h"\nextern "C" int kvstore_toy() { return ANSWER; }\n')
    lib = build.library(src)
    assert answer(lib) == 42
    (tmp_path / "toy.h").write_text("#define ANSWER 7\n")
    changed = build.library(src)
    assert changed != lib and answer(changed) == 7


@needs_compiler
def test_a_compiler_error_is_reported_and_leaves_nothing(tmp_path, cache):
    src = toy_source(tmp_path, body="this is not C++\n")
    with pytest.raises(build.BuildError, match=r"(?s)the compiler failed on toy-.*this is not C"):
        build.library(src)
    assert [p.name for p in cache.iterdir()] == ["toy.lock"]


@needs_compiler
def test_a_built_library_needs_no_compiler(tmp_path, cache, monkeypatch):
    src = toy_source(tmp_path)
    lib = build.library(src)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)  # the compiler was removed since
    assert build.library(src) == lib and build.is_built(src)
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler"):
        build.library(toy_source(tmp_path, answer=5))


def test_a_missing_compiler_is_named(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("CXX", "no-such-compiler-here")
    with pytest.raises(build.BuildError, match=r"no C\+\+ compiler \(no-such-compiler-here\) on PATH; install"):
        build.library(toy_source(tmp_path))


@needs_compiler
def test_a_killed_build_leaves_no_library_and_the_next_one_builds(tmp_path, cache, monkeypatch):
    """The compiler writes half a library, then its build is killed: nothing under the final name;
    the next build removes the temp file and succeeds (the lock died with the killed process)."""
    compiler = tmp_path / "slow-c++"
    compiler.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        if [ -n "$TOY_HANG" ]; then for last; do :; done; echo half > "$last"; touch "$TOY_HANG"; sleep 60; fi
        exec {shutil.which(build.compiler())} "$@"
        """))
    compiler.chmod(0o755)
    monkeypatch.setenv("CXX", str(compiler))
    src = toy_source(tmp_path)
    started = tmp_path / "started"
    code = f"from pathlib import Path; from kvstore.engine.native import build; build.library(Path({str(src)!r}))"
    proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "TOY_HANG": str(started)},
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not started.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the build never reached the compiler"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert [p.name for p in cache.iterdir() if p.suffix == ".so"] == []
    assert any(p.name.endswith(".tmp") for p in cache.iterdir())
    lib = build.library(src)
    assert answer(lib) == 42
    assert not any(p.name.endswith(".tmp") for p in cache.iterdir())


@needs_compiler
def test_a_damaged_library_is_built_again_on_load(tmp_path, cache):
    src = toy_source(tmp_path)
    lib = build.library(src)
    lib.write_bytes(b"\0" * 100)  # a crash after the rename, before the bytes reached the disk
    assert build.load(src) == lib
    assert answer(lib) == 42


@needs_compiler
def test_a_waiting_build_takes_the_library_another_process_built(tmp_path, cache):
    src = toy_source(tmp_path)
    lib = build.library(src)
    lib.unlink()
    # another process holds the build lock and builds meanwhile: this one waits, then finds the file
    code = ("import fcntl, os, sys, time; from pathlib import Path; from kvstore.engine.native import build; "
            "fd = os.open(sys.argv[1], os.O_RDWR); fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); "
            "time.sleep(0.5); build._compile(build.compile_command(Path(sys.argv[2])), Path(sys.argv[3]), "
            "Path(sys.argv[4]))")
    proc = subprocess.Popen([sys.executable, "-c", code, str(cache / "toy.lock"), str(src), str(cache), str(lib)],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    assert build.library(src) == lib and answer(lib) == 42
    assert proc.wait() == 0
