"""llama-cpp-python's OpenAI-compatible server, as benchmarks/serve.py runs it:

    python -m benchmarks.llama_server ARGS...     # the arguments of `python -m llama_cpp.server`

On a CPU with AMX, llama.cpp's repacked ("extra buffer type") matmul path crashed at the first
decode (benchmarks/llama_peer.py), so there the model is loaded with `use_extra_bufts=False`;
elsewhere nothing is changed and this is `python -m llama_cpp.server` itself.
"""

from __future__ import annotations

import runpy
from pathlib import Path


def has_amx() -> bool:
    try:
        flags = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
    except OSError:
        return False
    return any(f.startswith("amx") for f in flags.split(":", 1)[-1].split())


def without_extra_bufts() -> None:
    from llama_cpp import llama_cpp as lib

    defaults = lib.llama_model_default_params

    def params():
        p = defaults()
        if hasattr(p, "use_extra_bufts"):
            p.use_extra_bufts = False
        return p

    lib.llama_model_default_params = params


if __name__ == "__main__":
    if has_amx():
        without_extra_bufts()
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)
