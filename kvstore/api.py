"""The public `Store` and `open_store`: the store at rest (`kvstore.store`) plus the verbs that
make and open writers (`new`, `open`, returning a `Session`). The top of the library's layers:
the front ends (`kvstore_cli`, and the service to come) use what `kvstore/__init__.py` exports.

`kvstore.session` (and with it torch) is imported by `new` and `open` only, so that opening a
store to list or describe its sessions stays fast.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from .defaults import DEFAULT_CHECKPOINT_EVERY
from .store import store as at_rest

if TYPE_CHECKING:
    from .session import Session


class Store(at_rest.Store):
    def new(self, name: str, model, *, seed: int = 0, system: str | None = None, chunk_size: int | None = None,
            checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, **sampling) -> "Session":
        """Create a session for `model` and open it for writing (the writer lock held); sampling
        settings as SamplerSettings fields; `chunk_size` defaults to DEFAULT_CHUNK (512)."""
        from .session import Session

        self.create(name, model, seed=seed, system=system, chunk_size=chunk_size, checkpoint_every=checkpoint_every,
                    **sampling)
        return Session.open(self, name, model, device=str(model.device))

    def open(self, name: str, model=None, device: str = "cpu") -> "Session":
        """Open a session for writing; the model is loaded from the session's record when omitted."""
        from .session import Session

        return Session.open(self, name, model, device=device)


def open_store(home: str | os.PathLike | None = None, url: str | None = None) -> Store:
    """Open (creating if needed) the store in `home` (else $KVSTORE_HOME, else the per-user app
    folder); its index is `url` (else $KVSTORE_INDEX), or else the SQLite file `home/kvstore.db`."""
    return at_rest.open_store(home, url, factory=Store)
