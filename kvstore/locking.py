"""One writer per session (C7): an advisory `flock` on `sessions/<id>/.lock`.

`acquire` never waits: a second writer gets `SessionBusy` at once. The kernel drops the lock when
its holder dies, so a killed writer never leaves a session locked. The lock file goes through the
store's I/O seam like every other file (`fileio.io.lock`).
"""

from __future__ import annotations

from pathlib import Path

from .errors import SessionBusy
from .fileio import io, reraise_full


class SessionLock:
    def __init__(self, directory: Path, name: str):
        self.path = directory / ".lock"
        self.name = name
        self.fd: int | None = None

    def acquire(self) -> "SessionLock":
        try:
            io.mkdir(self.path.parent)
            self.fd = io.lock(self.path)
        except BlockingIOError:
            raise SessionBusy(f"session {self.name!r} is open for writing in another process; "
                              "close that one first (a killed writer releases it at once)") from None
        except OSError as e:
            reraise_full(e, f"locking session {self.name!r}")
        return self

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            io.unlock(fd)

    @property
    def held(self) -> bool:
        return self.fd is not None
