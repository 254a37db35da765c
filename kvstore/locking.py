"""One writer per session (C7): an advisory `flock` on `sessions/<id>/.lock`.

`acquire` never waits: a second writer gets `SessionBusy` at once. The kernel drops the lock when
its holder dies, so a killed writer never leaves a session locked. The lock file goes through the
store's I/O seam like every other file (`fileio.io.lock`).
"""

from __future__ import annotations

import time
from pathlib import Path

from .errors import SessionBusy
from .fileio import io, reraise_full


class SessionLock:
    def __init__(self, directory: Path, name: str):
        self.path = directory / ".lock"
        self.name = name
        self.fd: int | None = None

    def acquire(self, *, fresh: bool = False) -> "SessionLock":
        """Take the lock, creating the folder if needed. `fresh`: the folder is new and has no index
        row yet, so only a gc passing by can hold or remove it: wait for that instead of failing."""
        for _ in range(100 if fresh else 3):
            try:
                io.mkdir(self.path.parent)
                self.fd = io.lock(self.path)
                return self
            except FileNotFoundError:  # a gc removed the folder between the two calls: make it again
                continue
            except BlockingIOError:
                if not fresh:
                    raise SessionBusy(f"session {self.name!r} is open for writing in another process; close "
                                      "that one first (a killed writer releases it at once)") from None
                time.sleep(0.01)
            except OSError as e:
                reraise_full(e, f"locking session {self.name!r}")
        raise SessionBusy(f"could not lock the folder of session {self.name!r}: a gc kept removing it; try again")

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            io.unlock(fd)

    @property
    def held(self) -> bool:
        return self.fd is not None
