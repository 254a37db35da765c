"""The Store at rest: a home directory with the index and the KV files, and the verbs on whole sessions.

`open_store(home=None, url=None)` finds the home (argument, $KVSTORE_HOME, click's app dir), opens
the index (SQLite `kvstore.db` in the home unless `url` or $KVSTORE_INDEX names a PostgreSQL
database), migrates it and checks that the two belong together (`identity`). Here sessions are
created (`create`: rows at head 0), listed and described (`listing`: a page of them in two index
queries, whatever the store's size), forked without loading a model, deleted, garbage-collected,
verified, exported, imported and packed; none of it loads torch. Writing a
session (feeding it, generating) is a `kvstore.session.Session`, which the public `Store`
(`kvstore.api`) opens on top of this one.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, delete, select, update
from sqlalchemy.exc import DatabaseError, OperationalError
from sqlalchemy.orm import Session as DB

from .. import direct_io
from ..defaults import DEFAULT_CHECKPOINT_EVERY, DEFAULT_CHUNK
from ..engine.settings import SamplerSettings
from ..errors import CorruptData, IndexUnavailable, ModelMismatch, SessionNotFound, StoreMissing
from ..fileio import io, make_dir
from .export import export_session
from .gc import collect
from .identity import bind_home
from .import_archive import archive_name, import_session
from . import extents, prefix, restore, segments, workers
from .index import MessageRow, ModelRow, PrefixEntryRow, SessionRow, make_engine, shown_url, upgrade
from .listing import PAGE_SIZE, SessionInfo, SessionPage, check_page, count, read_infos, read_page
from .locking import SessionLock
from .pack import pack_session
from .prefix import PrefixHit
from .paths import home_dir, index_url
from .progress import Progress
from .records import (add_session, check_name, claim_name, fork_rows, kv_layout, read_messages,
                      read_tokens, register_model, token_bytes)
from .verify import verify_store

NEW_NAME_TAKEN = "pick another name, `kvstore continue {name}` or `kvstore rm {name}`"
SESSION_ID = select(SessionRow.id).where(SessionRow.name == bindparam("name"))  # the first step of an open


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
        """The session row of `name`; SessionNotFound, saying where to look, when there is none."""
        check_name(name)
        row = db.scalar(select(SessionRow).where(SessionRow.name == name))
        if row is None:
            raise self.not_found(name)
        return row

    def session_id(self, name: str) -> str:
        """The id of session `name` (the first step of an open: one column, no ORM object);
        SessionNotFound when there is none."""
        found = self._id_of(name)
        if found is None:
            raise self.not_found(name)
        return found

    def exists(self, name: str) -> bool:
        """Whether a session of that name is in the store (the same one-column read)."""
        return self._id_of(name) is not None

    def _id_of(self, name: str) -> str | None:
        check_name(name)
        with self.engine.connect() as db:
            return db.scalar(SESSION_ID, {"name": name})

    def not_found(self, name: str) -> SessionNotFound:
        return SessionNotFound(f"no session named {name!r}; `kvstore list` shows the sessions in {self.home}")

    def warm_up(self) -> None:
        """Do now what a process's first open and checkpoint of a session would pause for: the index
        statements an open runs compiled (SQLAlchemy compiles a statement the first time an engine
        runs it), the threads a restore reads with (each with its bounce buffer for direct reads:
        a huge page, whose first fault can take milliseconds where the host hands it over) and the
        one a checkpoint syncs on started. A process's first open of a 2,048-token session out of
        the page cache took 55-61 ms after it, 80-95 without (AMD EPYC, Zen 1 kind, KVM).
        Reads no session and writes nothing: a service calls it before it says it is ready."""
        with self.engine.connect() as db:
            db.scalar(SESSION_ID, {"name": ""})  # no session has the empty name
            restore.warm_statements(db)
        workers.start_threads(extents.READ_THREADS, [segments.SYNCER], prepare=direct_io.prepare_thread)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- sessions ----------------------------------------------------------------------------------
    def create(self, name: str, model, *, seed: int = 0, system: str | None = None, chunk_size: int | None = None,
               checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, **sampling) -> str:
        """A new, empty session for `model` (sampling settings as SamplerSettings fields; `chunk_size`
        defaults to DEFAULT_CHUNK); returns its id. Writing to it is `kvstore.Store.new`'s job."""
        check_name(name)
        chunk_size = DEFAULT_CHUNK if chunk_size is None else chunk_size
        settings = SamplerSettings.from_dict(sampling)
        settings.check_vocab(model.config.vocab_size)
        with self.db() as db, db.begin():
            claim_name(db, name, NEW_NAME_TAKEN.format(name=name))
            register_model(db, model)
            row = add_session(db, name=name, model_fingerprint=model.fingerprint, dtype=model.dtype_name,
                              weights=model.weights, kv_layout=kv_layout(model), seed=seed, sampler=settings.to_dict(), chunk_size=chunk_size,
                              checkpoint_every=checkpoint_every, token_bytes=token_bytes(model), reason="new")
            if system is not None:
                db.add(MessageRow(session_id=row.id, ordinal=0, role="system", text=system, token_start=0,
                                  token_end=0))
            return row.id

    def check_new_name(self, name: str) -> None:
        """InvalidName or SessionExists (saying what to do) unless `name` is free for a new session: a
        front end asks before it loads a model."""
        with self.db() as db:
            claim_name(db, name, NEW_NAME_TAKEN.format(name=name))

    def check_writable(self, name: str) -> None:
        """SessionBusy at once when another process is writing the session (before a model is loaded)."""
        with self.db() as db:
            row = self.row(db, name)
        SessionLock(self.session_dir(row.id), name).acquire().release()

    def resolve_model(self, name: str, device: str = "cpu"):
        """Load the model a session was made with, from where it was loaded (fingerprint checked)."""
        from ..engine.model import load_model  # torch: only a writer needs the model

        with self.db() as db:
            row = self.row(db, name)
            model_row = db.get(ModelRow, row.model_fingerprint)
        model = load_model(model_row.source, dtype=row.dtype, device=device, home=self.home, weights=row.weights)
        if model.fingerprint != row.model_fingerprint:
            raise ModelMismatch(f"session {name!r} was made with model {row.model_fingerprint[:12]} loaded from "
                                f"{model_row.source}, but that file now has fingerprint {model.fingerprint[:12]}; "
                                "pass the original model file")
        return model

    def names(self) -> list[str]:
        with self.db() as db:
            return list(db.scalars(select(SessionRow.name).order_by(SessionRow.name)))

    def list(self, limit: int | None = None, after: str | None = None) -> list[SessionInfo]:
        """Sessions in name order: those named after `after` (all when None), at most `limit` (no
        limit when None; read PAGE_SIZE at a time). `page` says whether more follow."""
        check_page(limit, after)
        if limit is not None:
            return self.page(limit, after).sessions
        out: list[SessionInfo] = []
        while True:
            page = self.page(PAGE_SIZE, after)
            out += page.sessions
            if page.next is None:
                return out
            after = page.next

    def page(self, limit: int = 100, after: str | None = None) -> SessionPage:
        """At most `limit` sessions in name order, named after `after` (the previous page's `next`;
        None: from the first), in two index queries whatever the store's size (`listing`)."""
        check_page(limit, after)
        with self.db() as db:
            return read_page(db, limit, after)

    def count(self) -> int:
        """How many sessions the store holds (one query)."""
        with self.db() as db:
            return count(db)

    def info(self, name: str) -> SessionInfo:
        """The session's record, read as `list` reads it (so the two agree)."""
        check_name(name)
        with self.db() as db:
            found = read_infos(db, name=name)
        if not found:
            raise self.not_found(name)
        return found[0]

    def messages(self, name: str) -> list[MessageRow]:
        with self.db() as db:
            row = self.row(db, name)
            return list(db.scalars(select(MessageRow).where(MessageRow.session_id == row.id)
                                   .order_by(MessageRow.ordinal)))

    def tokens(self, name: str) -> list[int]:
        with self.db() as db:
            return read_tokens(db, self.row(db, name).id)

    def history(self, name: str) -> list[dict[str, Any]]:
        """The text of a session in order: its chat messages, and the spans no message covers (raw
        text) decoded as role "text"; each a dict of role, text, token_start, token_end."""
        with self.db() as db:  # one snapshot of the session's rows
            row = self.row(db, name)
            messages = [{k: m[k] for k in ("role", "text", "token_start", "token_end")}
                        for m in read_messages(db, row.id)]
            tokens = read_tokens(db, row.id)
            source = db.get(ModelRow, row.model_fingerprint).source
        covered = sorted((m["token_start"], m["token_end"]) for m in messages if m["token_end"] > m["token_start"])
        gaps, at = [], 0
        for a, b in covered + [(len(tokens), len(tokens))]:
            if a > at:
                gaps.append((at, a))
            at = max(at, b)
        if not gaps:
            return messages
        from ..engine.model import load_tokenizer  # only raw text needs one (and with it torch)
        from ..errors import ModelError

        try:
            tokenizer = load_tokenizer(source)
        except ModelError as e:
            raise ModelError(f"{e}; the raw text of session {name!r} cannot be decoded without its model") from None
        raw = [{"role": "text", "text": tokenizer.decode(tokens[a:b], skip_special=True), "token_start": a,
                "token_end": b} for a, b in gaps]
        return sorted(messages + raw, key=lambda e: (e["token_start"], e["token_end"]))

    def fork(self, name: str, new_name: str, at: int | None = None, *, weights: str | None = None) -> None:
        """Create `new_name` from the first `at` tokens of `name` (all when None), sharing its KV on disk.
        `weights`: the fork continues with the model's weights held another way (WEIGHT_FORMATS) than
        its parent's: from the fork on it computes what that way computes on the parent's KV."""
        with self.db() as db, db.begin():
            parent = self.row(db, name)
            fork_rows(db, parent, new_name, at, weights)

    def supersede(self, name: str, by: str, keep_as: str) -> None:
        """In one transaction: session `name` becomes `keep_as`, and session `by` takes the name
        `name` (a conversation moved onto a new branch); SessionBusy while a writer has either open."""
        with self.db() as db:
            old, new = self.row(db, name), self.row(db, by)
        locks = [SessionLock(self.session_dir(old.id), name).acquire()]
        try:
            locks.append(SessionLock(self.session_dir(new.id), by).acquire())
            with self.db() as db, db.begin():
                claim_name(db, keep_as)
                db.execute(update(SessionRow).where(SessionRow.id == old.id).values(name=keep_as))
                db.execute(update(SessionRow).where(SessionRow.id == new.id).values(name=name))
        finally:
            for lock in locks:
                lock.release()

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

    # -- the prefix cache (C10: `prefix`) -------------------------------------------------------------
    def find_prefix(self, model, tokens: list[int], chunk_size: int | None = None, *,
                    scope: str = "") -> PrefixHit | None:
        """The longest stored prefix of `tokens` up to a chunk boundary (`prefix.key_block`'s; one token at least left to
        feed) whose KV is what a cold run of `model` in chunks of `chunk_size` computes, among the
        sessions whose name starts with `scope`; None when no session holds one."""
        identity = prefix.Identity.of(model, DEFAULT_CHUNK if chunk_size is None else chunk_size)
        with self.db() as db:
            return prefix.find(db, identity, list(tokens), scope)

    def fork_prefix(self, hit: PrefixHit, new_name: str, tokens: list[int], *, seed: int = 0,
                    checkpoint_every: int = DEFAULT_CHECKPOINT_EVERY, **sampling) -> bool:
        """Create `new_name` from a hit by reference (no byte copied): `tokens[:hit.length + 1]`, the
        KV of the first hit.length shared with its source, the next token pending; the seed and
        sampling settings are the new session's own. False when the source is gone since."""
        settings = SamplerSettings.from_dict(sampling).to_dict()
        with self.db() as db, db.begin():
            return prefix.fork(db, hit, new_name, list(tokens), seed=seed, sampler=settings,
                               checkpoint_every=checkpoint_every) is not None

    def retain_prefix(self, name: str) -> None:
        """Keep session `name` only as a prefix-cache entry: `evict_prefix` may delete it."""
        with self.db() as db, db.begin():
            prefix.retain(db, self.row(db, name).id)

    def drop_prefix_source(self, hit: PrefixHit) -> None:
        """A hit's source failed to load: an entry is deleted, a named session only stops being a source."""
        with self.db() as db, db.begin():
            entry = db.get(PrefixEntryRow, hit.session_id) is not None
            prefix.forget_keys(db, hit.session_id)
        if entry:
            self.delete(hit.name)

    def prefix_held(self) -> tuple[int, int]:
        """(prefix-cache entries, their KV bytes)."""
        with self.db() as db:
            return prefix.held(db)

    def evict_prefix(self, budget: int) -> list[str]:
        """Delete the least recently used prefix-cache entries until their bytes fit `budget`; the names
        deleted (never a named session)."""
        return prefix.evict(self, budget)

    def gc(self) -> dict[str, int]:
        """Delete the files and rows no session refers to any more; counts of what went."""
        return collect(self)

    def verify(self, name: str | None = None, *, progress: Progress | None = None) -> dict[str, list[str]]:
        """Problems per session (empty lists when sound); `progress(done, total)` gets KV bytes checked."""
        return verify_store(self, name, progress)

    def export(self, name: str, path: str | os.PathLike, *, progress: Progress | None = None) -> dict[str, Any]:
        """Write one archive; `progress(done, total)` gets KV bytes after each extent."""
        return export_session(self, name, Path(path), progress)

    def import_(self, path: str | os.PathLike, name: str | None = None, model=None, *,
                progress: Progress | None = None) -> str:
        """Verify an archive fully, then commit it as a new session; `progress` gets KV bytes verified."""
        return import_session(self, Path(path), name, model, progress)

    def archive_name(self, path: str | os.PathLike) -> str:
        """The session name an archive holds (its manifest checked): what `import_` names it by default."""
        return archive_name(Path(path))

    def pack(self, name: str, *, progress: Progress | None = None) -> dict[str, int]:
        """Pack a paused session without loading its model; `progress` gets KV bytes packed."""
        with self.db() as db:
            row = self.row(db, name)
        lock = SessionLock(self.session_dir(row.id), name).acquire()
        try:
            return pack_session(self, row.id, name, progress)
        finally:
            lock.release()


def open_store(home: str | os.PathLike | None = None, url: str | None = None, *, factory=None) -> "Store":
    """Open (creating if needed) the store in `home`; its index is `url` (else $KVSTORE_INDEX), or
    else the SQLite file `home/kvstore.db`. Session files always live in the home. `factory`: the
    class to make (a subclass of Store; `kvstore.api.Store` adds the writers)."""
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
    store = (factory or Store)(root, url)
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
