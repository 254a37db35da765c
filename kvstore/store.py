"""The Store: a home directory with the index and the KV files, and the verbs on whole sessions.

`open_store(home=None, url=None)` finds the home (argument, $KVSTORE_HOME, click's app dir), opens
the index (SQLite `kvstore.db` in the home unless `url` or $KVSTORE_INDEX names a PostgreSQL
database), migrates it and checks that the two belong together (`identity`). Sessions are created
and opened here (`new`, `open`, both returning a writer `Session`), listed, described, forked
without loading a model, deleted and garbage-collected; `verify`, `export` and `import_` live in
their own modules and are exposed here.
"""

from __future__ import annotations

import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.exc import DatabaseError, OperationalError
from sqlalchemy.orm import Session as DB

from .errors import (CorruptData, IndexUnavailable, InvalidName, ModelMismatch, SessionExists, SessionNotFound,
                     StoreMissing)
from .fileio import io, make_dir
from .identity import bind_home
from .index import (BlobRow, CheckpointRow, ExtentBlobRow, MessageRow, ModelRow, SegmentRow,
                    SessionExtentRow, SessionRow, TokenBlockRow, make_engine, shown_url, upgrade, utcnow)
from .locking import SessionLock
from .paths import home_dir, index_url
from .progress import Progress
from .segments import LAYER_FILE

NAME = re.compile(r"[^\W_][\w.:@+-]{0,127}")
DEFAULT_CHECKPOINT_EVERY = 16


def check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME.fullmatch(name):
        shown = repr(name) if len(repr(name)) < 60 else repr(name)[:57] + "..."
        raise InvalidName(f"invalid session name {shown}: use 1-128 letters, digits and . _ : @ + -, "
                          "starting with a letter or digit")
    return name


@dataclass
class SessionInfo:
    name: str
    id: str
    model: str
    model_source: str
    dtype: str
    n_tokens: int
    n_cached: int
    checkpoints: int
    disk_bytes: int
    parent: str | None
    fork_position: int | None
    forks: list[str]
    seed: int
    sampler: dict[str, Any]
    chunk_size: int  # prefill chunk, in tokens (a checkpoint after each)
    checkpoint_every: int  # generated tokens between automatic checkpoints
    active_call: dict[str, Any] | None
    created_at: str
    updated_at: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Store:
    def __init__(self, home: Path, url: str):
        self.home = home
        self.url = url
        self.engine = make_engine(url)
        self.sessions_dir = home / "sessions"
        self.blobs_dir = home / "blobs"

    # -- plumbing ------------------------------------------------------------------------------
    def db(self) -> DB:
        return DB(self.engine, expire_on_commit=False)

    def session_dir(self, session_id: str) -> Path:
        return self.sessions_dir / session_id

    def still_there(self, session_id: str) -> bool:
        """Does the session still exist (a reader without its lock may be overtaken by a delete)?"""
        with self.db() as db:
            return db.get(SessionRow, session_id) is not None

    def row(self, db: DB, name: str) -> SessionRow:
        check_name(name)
        row = db.scalar(select(SessionRow).where(SessionRow.name == name))
        if row is None:
            raise SessionNotFound(f"no session named {name!r}; `kvstore list` shows the sessions in {self.home}")
        return row

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- sessions ----------------------------------------------------------------------------------
    def new(self, name: str, model, *, seed: int = 0, system: str | None = None, chunk_size: int | None = None,
            checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, **sampling):
        """Create a session (writer lock held) for `model`; sampling settings as SamplerSettings fields;
        `chunk_size` defaults to the engine's (`generate.DEFAULT_CHUNK`)."""
        from .generate import DEFAULT_CHUNK
        from .sampling import SamplerSettings
        from .session import Session

        chunk_size = DEFAULT_CHUNK if chunk_size is None else chunk_size
        check_name(name)
        settings = SamplerSettings.from_dict(sampling)
        if chunk_size < 1 or checkpoint_every < 1:
            raise ValueError("chunk_size and checkpoint_every must be at least 1")
        session_id = uuid.uuid4().hex
        with self.db() as db, db.begin():
            if db.scalar(select(SessionRow.id).where(SessionRow.name == name)):
                raise SessionExists(f"a session named {name!r} exists; pick another name or `kvstore rm {name}`")
            self._register_model(db, model)
            db.add(SessionRow(id=session_id, name=name, model_fingerprint=model.fingerprint, dtype=model.dtype_name,
                              kv_layout=kv_layout(model), seed=int(seed), sampler=settings.to_dict(),
                              chunk_size=chunk_size, checkpoint_every=checkpoint_every, head=0, n_tokens=0,
                              n_cached=0, created_at=utcnow(), updated_at=utcnow()))
            db.flush()  # rows that reference the session go in after it
            db.add(SegmentRow(id=session_id, n_layers=model.config.n_layers, token_bytes=token_bytes(model),
                              committed_end=0))
            db.add(CheckpointRow(session_id=session_id, seq=0, n_tokens=0, n_cached=0, reason="new",
                                 created_at=utcnow()))
            if system is not None:
                db.add(MessageRow(session_id=session_id, ordinal=0, role="system", text=system, token_start=0,
                                  token_end=0))
        return Session.open(self, name, model, device=str(model.device))

    def open(self, name: str, model=None, device: str = "cpu"):
        """Open a session for writing; the model is loaded from the session's record when omitted."""
        from .session import Session

        return Session.open(self, name, model, device=device)

    def resolve_model(self, name: str, device: str = "cpu"):
        """Load the model a session was made with, from where it was loaded (fingerprint checked)."""
        from .model import load_model

        with self.db() as db:
            row = self.row(db, name)
            model_row = db.get(ModelRow, row.model_fingerprint)
        model = load_model(model_row.source, dtype=row.dtype, device=device, home=self.home)
        if model.fingerprint != row.model_fingerprint:
            raise ModelMismatch(f"session {name!r} was made with model {row.model_fingerprint[:12]} loaded from "
                                f"{model_row.source}, but that file now has fingerprint {model.fingerprint[:12]}; "
                                "pass the original model file")
        return model

    def _register_model(self, db: DB, model) -> None:
        if db.get(ModelRow, model.fingerprint) is None:
            db.add(ModelRow(fingerprint=model.fingerprint, arch=model.config.arch, config=model.config.to_dict(),
                            source=model.source, created_at=utcnow()))
            db.flush()

    def names(self) -> list[str]:
        with self.db() as db:
            return list(db.scalars(select(SessionRow.name).order_by(SessionRow.name)))

    def list(self) -> list[SessionInfo]:
        return [self.info(n) for n in self.names()]

    def info(self, name: str) -> SessionInfo:
        with self.db() as db:
            row = self.row(db, name)
            model_row = db.get(ModelRow, row.model_fingerprint)
            n_checkpoints = db.scalar(select(func.count()).select_from(CheckpointRow)
                                      .where(CheckpointRow.session_id == row.id))
            forks = list(db.scalars(select(SessionRow.name).where(SessionRow.parent_id == row.id)))
            parent = db.scalar(select(SessionRow.name).where(SessionRow.id == row.parent_id)) if row.parent_id else None
            return SessionInfo(
                name=row.name, id=row.id, model=row.model_fingerprint, model_source=model_row.source,
                dtype=row.dtype, n_tokens=row.n_tokens, n_cached=row.n_cached, checkpoints=n_checkpoints,
                disk_bytes=self._disk_bytes(db, row.id), parent=parent, fork_position=row.fork_position,
                forks=forks, seed=row.seed, sampler=dict(row.sampler), chunk_size=row.chunk_size,
                checkpoint_every=row.checkpoint_every, active_call=row.active_call,
                created_at=row.created_at.isoformat(timespec="seconds"),
                updated_at=row.updated_at.isoformat(timespec="seconds"))

    def _disk_bytes(self, db: DB, session_id: str) -> int:
        """Bytes this session's own segment and the blobs of its extents occupy."""
        seg = db.get(SegmentRow, session_id)
        raw = 0
        directory = self.session_dir(session_id)
        if seg is not None:
            raw = sum(io.file_size(p) for p in io.listdir(directory) if LAYER_FILE.fullmatch(p.name))
        packed = db.scalar(select(func.coalesce(func.sum(BlobRow.size), 0))
                           .where(BlobRow.hash.in_(select(ExtentBlobRow.blob_hash)
                                                   .join(SessionExtentRow,
                                                         SessionExtentRow.extent_id == ExtentBlobRow.extent_id)
                                                   .where(SessionExtentRow.session_id == session_id))))
        return raw + int(packed or 0)

    def messages(self, name: str) -> list[MessageRow]:
        with self.db() as db:
            row = self.row(db, name)
            return list(db.scalars(select(MessageRow).where(MessageRow.session_id == row.id)
                                   .order_by(MessageRow.ordinal)))

    def tokens(self, name: str) -> list[int]:
        with self.db() as db:
            return read_tokens(db, self.row(db, name).id)

    def fork(self, name: str, new_name: str, at: int | None = None) -> None:
        """Create `new_name` from the first `at` tokens of `name` (all when None), sharing its KV on disk."""
        check_name(new_name)
        with self.db() as db, db.begin():
            parent = self.row(db, name)
            fork_rows(db, parent, new_name, at)

    def delete(self, name: str) -> None:
        """Remove a session (its forks keep what they share with it); files go once unreferenced."""
        with self.db() as db:
            row = self.row(db, name)
        lock = SessionLock(self.session_dir(row.id), name).acquire()
        try:
            with self.db() as db, db.begin():
                db.execute(delete(SessionRow).where(SessionRow.id == row.id))
        finally:
            lock.release()
        self.gc()

    def gc(self) -> dict[str, int]:
        from .gc import collect

        return collect(self)

    def verify(self, name: str | None = None, *, progress: Progress | None = None) -> dict[str, list[str]]:
        """Problems per session (empty lists when sound); `progress(done, total)` gets KV bytes checked."""
        from .verify import verify_store

        return verify_store(self, name, progress)

    def export(self, name: str, path: str | os.PathLike, *, progress: Progress | None = None) -> dict[str, Any]:
        """Write one archive; `progress(done, total)` gets KV bytes after each extent."""
        from .archive import export_session

        return export_session(self, name, Path(path), progress)

    def import_(self, path: str | os.PathLike, name: str | None = None, model=None, *,
                progress: Progress | None = None) -> str:
        """Verify an archive fully, then commit it as a new session; `progress` gets KV bytes verified."""
        from .archive import import_session

        return import_session(self, Path(path), name, model, progress)

    def pack(self, name: str, *, progress: Progress | None = None) -> dict[str, int]:
        """Pack a paused session without loading its model; `progress` gets KV bytes packed."""
        from .pack import pack_session

        with self.db() as db:
            row = self.row(db, name)
        lock = SessionLock(self.session_dir(row.id), name).acquire()
        try:
            return pack_session(self, row.id, name, progress)
        finally:
            lock.release()


# -- helpers shared by the store, sessions and archives ----------------------------------------------
def kv_layout(model) -> dict[str, Any]:
    c = model.config
    return {"order": "token-major", "n_layers": c.n_layers, "per_token": [2, c.n_kv_heads, c.head_dim],
            "dtype": model.dtype_name}


def token_bytes(model) -> int:
    c = model.config
    return 2 * c.n_kv_heads * c.head_dim * model.dtype.itemsize


def read_tokens(db: DB, session_id: str) -> list[int]:
    import numpy as np

    blocks = db.scalars(select(TokenBlockRow).where(TokenBlockRow.session_id == session_id)
                        .order_by(TokenBlockRow.start)).all()
    out: list[int] = []
    for b in blocks:
        assert b.start == len(out), "token blocks are contiguous"
        out.extend(np.frombuffer(b.ids, dtype="<i4").tolist())
    return out


def last_state_problem(n_tokens: int, n_cached: int, state: bytes | None, size: int | None) -> str | None:
    """Contract C2 on a head: with every token's KV cached, it holds the last token's final hidden
    state, `size` bytes (one vector of the KV dtype; None: size not checked); with the last token
    pending, none. What is wrong, or None."""
    if n_cached > n_tokens:
        return f"{n_cached} cached positions for {n_tokens} tokens"
    if n_cached < n_tokens:
        return "a last-token state is stored, but the last token is pending" if state is not None else None
    if not n_tokens:
        return None
    if state is None:
        return "every token's KV is cached, but the last token's state is missing"
    if size is not None and len(state) != size:
        return f"the last token's state has {len(state)} bytes, the model's is {size}"
    return None


def encode_tokens(ids: list[int]) -> bytes:
    import numpy as np

    return np.asarray(ids, dtype="<i4").tobytes()


def fork_rows(db: DB, parent: SessionRow, new_name: str, at: int | None) -> SessionRow:
    """Insert the child's rows (inside the caller's transaction); KV extents shared, tokens copied.
    At the parent's head the child holds what the parent does; earlier, its last token is pending."""
    if db.scalar(select(SessionRow.id).where(SessionRow.name == new_name)):
        raise SessionExists(f"a session named {new_name!r} exists; pick another name")
    n = parent.n_tokens if at is None else int(at)
    if not 1 <= n <= parent.n_tokens:
        raise ValueError(f"fork position must be between 1 and {parent.n_tokens} (the tokens of {parent.name!r})")
    at_head = n == parent.n_tokens == parent.n_cached  # the child gets the last token's state too (C2)
    n_cached = n if at_head else min(parent.n_cached, n - 1)
    child_id = uuid.uuid4().hex
    now = utcnow()
    db.add(SessionRow(id=child_id, name=new_name, model_fingerprint=parent.model_fingerprint, dtype=parent.dtype,
                      kv_layout=parent.kv_layout, seed=parent.seed, sampler=parent.sampler,
                      chunk_size=parent.chunk_size, checkpoint_every=parent.checkpoint_every, head=0, n_tokens=n,
                      n_cached=n_cached, last_hidden=parent.last_hidden if at_head else None, parent_id=parent.id,
                      fork_position=n, created_at=now, updated_at=now))
    db.flush()
    seg = db.get(SegmentRow, parent.id)
    db.add(SegmentRow(id=child_id, n_layers=seg.n_layers, token_bytes=seg.token_bytes, committed_end=0))
    db.add(CheckpointRow(session_id=child_id, seq=0, n_tokens=n, n_cached=n_cached, reason="fork", created_at=now))
    db.add(TokenBlockRow(session_id=child_id, start=0, ids=encode_tokens(read_tokens(db, parent.id)[:n])))
    for ref in db.scalars(select(SessionExtentRow).where(SessionExtentRow.session_id == parent.id)
                          .where(SessionExtentRow.start < n_cached).order_by(SessionExtentRow.start)):
        db.add(SessionExtentRow(session_id=child_id, start=ref.start, extent_id=ref.extent_id,
                                n_tokens=min(ref.n_tokens, n_cached - ref.start)))
    for m in db.scalars(select(MessageRow).where(MessageRow.session_id == parent.id)
                        .where(MessageRow.token_end <= n).order_by(MessageRow.ordinal)):
        db.add(MessageRow(session_id=child_id, ordinal=m.ordinal, role=m.role, text=m.text,
                          token_start=m.token_start, token_end=m.token_end))
    db.flush()
    return db.get(SessionRow, child_id)


def open_store(home: str | os.PathLike | None = None, url: str | None = None) -> Store:
    """Open (creating if needed) the store in `home`; its index is `url` (else $KVSTORE_INDEX), or
    else the SQLite file `home/kvstore.db`. Session files always live in the home."""
    root = home_dir(home)
    make_dir(root)
    sessions = root / "sessions"
    has_sessions = bool(io.listdir(sessions))
    url = index_url(url)
    if url is None:
        db_file = root / "kvstore.db"
        if not io.exists(db_file) and has_sessions:
            raise StoreMissing(f"{db_file} is missing but {sessions} holds session files; the index was deleted "
                               "or moved. Restore kvstore.db, or move the sessions folder away to start afresh")
        url = f"sqlite:///{db_file}"
    store = Store(root, url)
    try:
        if has_sessions and _schema_revision(store.engine) is None:  # never let a gc see an empty index here
            raise StoreMissing(f"the index of {root} ({shown_url(store.engine)}) is empty but {sessions} holds "
                               "session files; it was truncated or replaced, or is another database. Restore it, "
                               "or move the sessions folder away to start afresh")
        make_dir(sessions)
        upgrade(store.engine)
        bind_home(store)
    except DatabaseError as e:
        store.close()
        if isinstance(e, OperationalError):  # locked, I/O error, disk full, server down: not damage
            if store.engine.dialect.name != "sqlite":
                raise IndexUnavailable(f"cannot use the index database {shown_url(store.engine)} "
                                       f"({' '.join(str(e.orig).split())}); check that the server runs and that "
                                       "the URL (--index, $KVSTORE_INDEX) is right") from e
            raise
        raise CorruptData(f"the index of {root} is damaged ({e.orig}); restore kvstore.db from a backup") from e
    except BaseException:
        store.close()
        raise
    return store


def _schema_revision(engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def remove_tree(path: Path) -> None:
    try:
        io.rmtree(path)
    except OSError:
        pass

