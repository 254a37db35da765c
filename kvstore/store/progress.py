"""Progress of long jobs: a `progress(done, total)` callback and the tally that feeds it.

Prefill reports tokens (absolute positions); export, import, pack and verify report raw KV bytes,
after each extent. `done` never decreases and ends at `total` when the job completes.
"""

from __future__ import annotations

from typing import Callable

Progress = Callable[[int, int], None]


class Tally:
    """Adds up the work done and reports it to the progress callback, if there is one."""

    def __init__(self, progress: Progress | None, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def add(self, n: int) -> None:
        self.done += n
        if self.progress is not None:
            self.progress(self.done, self.total)
