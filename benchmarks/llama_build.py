"""llama.cpp's own HTTP server, `llama-server`, for the batching benchmark (benchmarks/batching.py):
found, or built from the llama.cpp sources that the llama-cpp-python source package on PyPI ships.

    python -m benchmarks.llama_build [--force]    # build it into the cache folder; prints its path

Contract:
- `find(explicit)` -> (path or None, why not): the binary named by `explicit` (the benchmark's
  --llama-server), else by $KVSTORE_LLAMA_SERVER, else the one a build left in the cache folder
  ($XDG_CACHE_HOME or ~/.cache, then kvstore/llama-server/). A path that is named but not an
  executable file is an error (SystemExit naming it), not a silent fallback.
- `build()`: `pip download` of the sdist llama-cpp-python==SDIST_VERSION (no binary, no
  dependencies) into a temporary folder, its vendor/llama.cpp configured with CMake in Release
  with llama.cpp's defaults (GGML_NATIVE: this CPU's instruction sets; no curl, no tests) and only
  the target llama-server built, on every CPU, then copied into the cache folder. The build folder
  is deleted; a failed step raises RuntimeError with the step's last output lines.
- Nothing is written inside the repository.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST_VERSION = "0.3.36"  # the llama-cpp-python whose vendored llama.cpp the other benchmarks measure too
ENV = "KVSTORE_LLAMA_SERVER"
CMAKE_OPTIONS = ("-DCMAKE_BUILD_TYPE=Release", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                 "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DBUILD_SHARED_LIBS=OFF")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "kvstore" / "llama-server"


def cached_binary() -> Path:
    return cache_dir() / f"llama-server-{SDIST_VERSION}"


def find(explicit: str | Path | None = None) -> tuple[Path | None, str]:
    """(the llama-server to run, "") or (None, why there is none)."""
    for source, value in (("--llama-server", explicit), (f"${ENV}", os.environ.get(ENV))):
        if value:
            path = Path(value).expanduser()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise SystemExit(f"{source} {value}: not an executable file (build one: python -m benchmarks.llama_build)")
            return path, ""
    if cached_binary().is_file():
        return cached_binary(), ""
    return None, (f"no llama-server binary: none named (--llama-server PATH or ${ENV}) and none built yet "
                  "(python -m benchmarks.llama_build)")


def version(binary: Path) -> str:
    """What `llama-server --version` says (its build number and commit), or "unknown"."""
    try:
        done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    lines = [ln.strip() for ln in (done.stdout + done.stderr).splitlines() if ln.strip().startswith("version")]
    return lines[0] if lines else "unknown"


def step(cmd: list[str], cwd: Path | None = None) -> None:
    print("+ " + " ".join(cmd), flush=True)
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise RuntimeError(f"{cmd[0]} failed ({done.returncode}):\n{tail}")


def build(jobs: int | None = None) -> Path:
    """Download the sdist, build llama-server from its llama.cpp, put it in the cache: its path."""
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs CMake and a C++ compiler (cmake is not on PATH)")
    target = cached_binary()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvstore-llama-build-") as tmp:
        work = Path(tmp)
        step([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
              f"llama-cpp-python=={SDIST_VERSION}", "-d", str(work / "sdist")])
        archive = next((work / "sdist").glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            tar.extractall(work / "src", filter="data")
        source = next((work / "src").glob("llama_cpp_python-*")) / "vendor" / "llama.cpp"
        step(["cmake", "-S", str(source), "-B", str(work / "build"), *CMAKE_OPTIONS])
        step(["cmake", "--build", str(work / "build"), "--target", "llama-server", "-j", str(jobs or os.cpu_count() or 1)])
        built = work / "build" / "bin" / "llama-server"
        partial = target.with_suffix(".partial")
        shutil.copy2(built, partial)
        partial.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.llama_build", description=__doc__.split("\n\n")[0])
    p.add_argument("--force", action="store_true", help="build again even when the cache holds one")
    p.add_argument("--jobs", type=int, help="parallel compile jobs (default: every CPU)")
    args = p.parse_args(argv)
    if cached_binary().is_file() and not args.force:
        print(cached_binary())
        return 0
    print(build(args.jobs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
