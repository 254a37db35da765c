"""One writer per session (C7): an advisory `flock` on `sessions/<id>/.lock`.

A second writer gets `SessionBusy` at once: `acquire` waits only PATIENCE_S (0.1 s), so that a gc
passing by (it holds a session's lock for one index query) is not taken for a writer. The kernel
drops the lock when its holder dies, so a killed writer never leaves a session locked. The lock
file goes through the store's I/O seam like every other file (`fileio.io.lock`).
"""

from __future__ import annotations

import time
from pathlib import Path

from ..errors import SessionBusy
from ..fileio import io, reraise_full

PATIENCE_S = 0.1  # longer than a gc's look at a session's folder, far shorter than any writer's hold
FRESH_PATIENCE_S = 1.0


class SessionLock:
    def __init__(self, directory: Path, name: str):
        self.path = directory / ".lock"
        self.name = name
        self.fd: int | None = None

    def acquire(self, *, fresh: bool = False, patience_s: float = PATIENCE_S) -> "SessionLock":
        """Take the lock, creating the folder if needed. A lock that is freed within `patience_s` was a
        gc looking at the folder and is waited for; one held longer is another writer: SessionBusy.
        `fresh`: the folder is new and has no index row yet, so only a gc can hold or remove it:
        wait up to FRESH_PATIENCE_S for it instead."""
        deadline = time.monotonic() + (FRESH_PATIENCE_S if fresh else patience_s)
        removed = 0
        while True:
            try:
                io.mkdir(self.path.parent)
                self.fd = io.lock(self.path)
                return self
            except FileNotFoundError:  # a gc removed the folder between the two calls: make it again
                removed += 1
                if removed < 100:
                    continue
                raise SessionBusy(f"could not lock the folder of session {self.name!r}: a gc kept removing it; "
                                  "try again") from None
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(0.005)
                    continue
                if fresh:
                    raise SessionBusy(f"could not lock the new folder of session {self.name!r}: a gc held it; "
                                      "try again") from None
                raise SessionBusy(f"session {self.name!r} is open for writing in another process; close "
                                  "that one first (a killed writer releases it at once)") from None
            except OSError as e:
                reraise_full(e, f"locking session {self.name!r}")

    def release(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            io.unlock(fd)

    @property
    def held(self) -> bool:
        return self.fd is not None
