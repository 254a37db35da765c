"""One index serves one home: the index's `store_identity` row and the home's `store-id` file hold
the same random id, checked by `open_store` (`bind_home`).

Why: session files live in the home and the index only names them. An index shared by two homes
(two machines pointed at one PostgreSQL database, a kvstore.db copied elsewhere) would list
sessions whose files one home lacks, and a packed blob committed by one home would be taken as
present by the other (blobs are content-addressed and shared), which would then free raw files it
still needs.

    index id   home's store-id   on open
    none       none              a new id for both (a new store, or one from before identities)
    none       M                 the index takes M (the home was given a new, empty database)
    R          none              the home takes R if the index holds no session; else StoreMismatch
    R          R                 open
    R          M (not R)         StoreMismatch
"""

from __future__ import annotations

import uuid
from pathlib import Path

from sqlalchemy import select

from ..errors import StoreMismatch
from ..fileio import io, write_durable
from .index import SessionRow, StoreIdentityRow, shown_url

MARKER = "store-id"


def bind_home(store) -> str:
    """Check (binding them if new) that `store.home` and its index belong together; returns the id."""
    path = store.home / MARKER
    with store.db() as db, db.begin():  # the index's lock: two first opens of one store take turns
        row = db.scalar(select(StoreIdentityRow))
        home_id = read_marker(path)
        if row is None:
            store_id = home_id or uuid.uuid4().hex
            if home_id is None:
                write_marker(path, store_id)
            db.add(StoreIdentityRow(id=store_id))
            return store_id
        if home_id == row.id:
            return row.id
        if home_id is None and db.scalar(select(SessionRow.id).limit(1)) is None:
            write_marker(path, row.id)
            return row.id
        raise StoreMismatch(_mismatch(store, path, home_id, row.id))


def read_marker(path: Path) -> str | None:
    if not io.exists(path):
        return None
    return bytes(io.read_file(path)).decode("utf-8", "replace").strip()


def write_marker(path: Path, store_id: str) -> None:
    write_durable(path, f"{store_id}\n".encode())


def _mismatch(store, path: Path, home_id: str | None, index_id: str) -> str:
    index = shown_url(store.engine)
    if home_id is None:
        return (f"the index {index} belongs to another kvstore home (store id {index_id}), and {store.home} has "
                f"no {MARKER} file. Open the home this index was made with; if this is that home and its "
                f"{MARKER} was lost, write {index_id} into {path}")
    return (f"{store.home} (store id {home_id}) and the index {index} (store id {index_id}) belong to different "
            "stores: one index serves one home. Open this home with its own index, or give it a new database")
