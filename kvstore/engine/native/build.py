"""Compile a C++ source against torch into a shared library in the user's cache, once per machine.

`library(source) -> Path`: the library built from this source (and the headers next to it) with
this torch and these flags (their hash names the file), compiled first when it is missing.
`load(source)` loads it into the process (`torch.ops.load_library`), building it again once if the
file is damaged. Several processes may ask at once: an `flock` lets one compile while the others
wait, and the kernel frees it if that one dies. The compiler writes a temp file that is fsynced and renamed into place, so a
killed or failed build never leaves a half-written library under the final name; the next build
removes such temp files (`fileio.atomic_write`). `BuildError` lives in `kvstore.errors`.

torch.utils.cpp_extension supplies the include and library paths (imported only to compile); the
compiler is run here because its `load` needs ninja and waits forever on the lock file of a build
that was killed.
Files live in $XDG_CACHE_HOME/kvstore/native (~/.cache by default), not in a store's home: the build
belongs to the machine and the torch install, and a store home may be anywhere.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path

import torch

from ...errors import BuildError
from ...fileio import PLAIN, atomic_write

FLAGS = ("-O3", "-std=c++20", "-ffp-contract=off", "-fPIC", "-shared", "-fopenmp")
BUILD_TIMEOUT_S = 600
LOCK_TIMEOUT_S = 900  # longer than a build: a waiter gives up only on a builder that hangs


def compiler() -> str:
    return os.environ.get("CXX") or "c++"


def has_compiler() -> bool:
    return shutil.which(compiler()) is not None


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "kvstore" / "native"


def library(source: Path) -> Path:
    """The built library for `source` (compiled now if missing; only then is a compiler needed)."""
    lib = _library_path(source)
    folder = lib.parent
    if lib.exists():
        return lib
    command = compile_command(source)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with _locked(folder / f"{source.stem}.lock"):
            if not lib.exists():
                _compile(command, folder, lib)
    except OSError as e:
        raise BuildError(f"cannot build {source.name} in {folder} ({e.strerror or e}); free some space there "
                         "or set XDG_CACHE_HOME to a writable folder") from e
    return lib


def is_built(source: Path) -> bool:
    """Whether `library(source)` would find its library without compiling."""
    try:
        return _library_path(source).exists()
    except BuildError:
        return False


def _library_path(source: Path) -> Path:
    """Named by a hash of what goes into the build: the source and the headers next to it (what its
    `#include "..."` reaches), the compiler's name, the flags and the torch install (its version and
    folder, which fix the include and library paths). Without importing torch.utils.cpp_extension,
    which costs a tenth of a second at every process start."""
    try:
        text = b"".join(f.name.encode() + b"\0" + f.read_bytes() for f in [source, *sorted(source.parent.glob("*.h"))])
    except OSError as e:
        raise BuildError(f"cannot read {source} ({e.strerror or e}); reinstall kvstore") from e
    inputs = [compiler(), *FLAGS, _abi_flag(), torch.__version__, os.path.dirname(torch.__file__)]
    key = hashlib.sha256(text + "\0".join(inputs).encode()).hexdigest()[:16]
    return cache_dir() / f"{source.stem}-{key}.so"


def _abi_flag() -> str:
    return f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"


def load(source: Path) -> Path:
    """Build (if needed) and load the library; one that does not load is built again, once."""
    lib = library(source)
    try:
        torch.ops.load_library(str(lib))
    except OSError:
        lib.unlink(missing_ok=True)  # damaged (say, a crash before its bytes reached the disk): anew
        lib = library(source)
        try:
            torch.ops.load_library(str(lib))
        except OSError as e:
            raise BuildError(f"{lib} does not load ({e})") from e
    return lib


def compile_command(source: Path) -> list[str]:
    """The compiler's arguments, output file left off (the temp file's name goes last)."""
    from torch.utils.cpp_extension import include_paths, library_paths

    if not has_compiler():
        raise BuildError(f"no C++ compiler ({compiler()}) on PATH; install one (Debian: apt install g++) "
                         "or set CXX")
    includes = [a for path in include_paths() for a in ("-isystem", path)]
    links = [f"-L{path}" for path in library_paths()] + ["-lc10", "-ltorch_cpu"]
    return [compiler(), *FLAGS, _abi_flag(), *includes, str(source), *links, "-o"]


def _compile(command: list[str], folder: Path, lib: Path) -> None:
    """The compiler writes a temp file (`atomic_write`: a killed build's are removed first, and a
    failed one leaves nothing), fsynced by name (the linker replaces the file) and renamed into place."""
    with atomic_write(lib, ops=PLAIN, clean=True, sync_by_path=True) as out:
        try:
            done = subprocess.run([*command, str(out.path)], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BuildError(f"the compiler ran over {BUILD_TIMEOUT_S} s building {lib.name}") from None
        if done.returncode != 0:
            raise BuildError(f"the compiler failed on {lib.name}:\n{done.stderr.strip()[-2000:]}")


class _locked:
    """An exclusive flock on `path`, waited for up to LOCK_TIMEOUT_S. Plain os calls, not the store's
    I/O seam (fileio.io): the build cache is not a store, and its faults are not the store's."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = -1

    def __enter__(self) -> "_locked":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(self.fd)
                    raise BuildError(f"another process has held {self.path} for {LOCK_TIMEOUT_S} s while "
                                     "building; stop it or remove the file") from None
                time.sleep(0.05)

    def __exit__(self, *exc) -> None:
        os.close(self.fd)
