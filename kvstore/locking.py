"""One writer per session (C7): an advisory `flock` on `sessions/<id>/.lock`.

`acquire` never waits: a second writer gets `SessionBusy` at once. The kernel drops the lock when
its holder dies, so a killed writer never leaves a session locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from .errors import SessionBusy


class SessionLock:
    def __init__(self, directory: Path, name: str):
        self.path = directory / ".lock"
        self.name = name
        self.fd: int | None = None

    def acquire(self) -> "SessionLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SessionBusy(f"session {self.name!r} is open for writing in another process; "
                              "close that one first (a killed writer releases it at once)") from None
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = None

    @property
    def held(self) -> bool:
        return self.fd is not None
