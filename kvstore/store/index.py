"""The index: SQLAlchemy 2.0 models of what the store holds, and the engine that reaches it.

Tables: models, sessions, checkpoints, segments (a session's per-layer KV files), extents (a
token range inside a segment, or inside a packed blob), session_extents (which extents make up a
session's cache, in order; forks share rows of `extents`), token_blocks (token ids, appended per
checkpoint), messages (chat turns), blobs (packed extents) and store_identity (which home the
index serves: `identity`). The schema is portable (SQLite and PostgreSQL); what is one
database's own lives only in `_sqlite_setup` or `_postgresql_setup`, and both run transactions
one at a time (`make_engine`). Alembic migrations in the top-level `migrations/` folder (shipped
as `kvstore.migrations`) are applied by `upgrade`.
"""

from __future__ import annotations

import datetime as dt
import importlib.util
import re
from contextlib import contextmanager
from importlib import resources
from pathlib import Path
from typing import Any

from sqlalchemy import (JSON, BigInteger, DateTime, ForeignKey, Integer, LargeBinary, String, Text, TypeDecorator,
                        UniqueConstraint, create_engine, event)
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.exc import ArgumentError, NoSuchModuleError, OperationalError
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from ..errors import IndexBusy, IndexUnavailable, StoreFull, UnsupportedFormat


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc).replace(tzinfo=None)


class Base(DeclarativeBase):
    pass


class AnyText(TypeDecorator):
    """Text that holds any str, NUL included (a pasted binary, a byte token the model produced).

    PostgreSQL's text type cannot store U+0000, so there NUL is written as ESCAPE + "0" and ESCAPE
    itself as ESCAPE twice (ESCAPE is U+FFFF, a noncharacter); SQLite stores text as it is."""
    impl = Text
    cache_ok = True
    ESCAPE = "\uffff"

    def process_bind_param(self, value: str | None, dialect) -> str | None:
        if value is None or dialect.name != "postgresql":
            return value
        return value.replace(self.ESCAPE, self.ESCAPE * 2).replace("\0", self.ESCAPE + "0")

    def process_result_value(self, value: str | None, dialect) -> str | None:
        if value is None or dialect.name != "postgresql" or self.ESCAPE not in value:
            return value
        return re.sub(self.ESCAPE + "(.)", lambda m: "\0" if m.group(1) == "0" else m.group(1), value, flags=re.S)


class StoreIdentityRow(Base):
    """One row: the id of the home this index serves (its `store-id` file holds the same id)."""
    __tablename__ = "store_identity"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class ModelRow(Base):
    __tablename__ = "models"
    fingerprint: Mapped[str] = mapped_column(String(64), primary_key=True)
    arch: Mapped[str] = mapped_column(String(32))
    config: Mapped[dict[str, Any]] = mapped_column(JSON)
    source: Mapped[str] = mapped_column(AnyText)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class SessionRow(Base):
    __tablename__ = "sessions"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(Text, unique=True)
    model_fingerprint: Mapped[str] = mapped_column(ForeignKey("models.fingerprint"))
    dtype: Mapped[str] = mapped_column(String(16))
    # how the model held its weight matrices: defaults.WEIGHT_FORMATS (0006)
    weights: Mapped[str] = mapped_column(String(16), server_default="dense")
    kv_layout: Mapped[dict[str, Any]] = mapped_column(JSON)
    seed: Mapped[int] = mapped_column(BigInteger)
    sampler: Mapped[dict[str, Any]] = mapped_column(JSON)
    chunk_size: Mapped[int] = mapped_column(Integer)
    checkpoint_every: Mapped[int] = mapped_column(Integer)
    head: Mapped[int] = mapped_column(Integer, default=0)  # seq of the head checkpoint (compare-and-set)
    n_tokens: Mapped[int] = mapped_column(Integer, default=0)
    n_cached: Mapped[int] = mapped_column(Integer, default=0)
    # positions [0, n_reusable) hold the KV a cold chunked prefill of the tokens computes (C10; 0007)
    n_reusable: Mapped[int] = mapped_column(Integer, default=0, server_default="0")
    active_call: Mapped[dict[str, Any] | None] = mapped_column(JSON, nullable=True)
    # the last token's final hidden state (raw bytes of the KV dtype) when n_cached == n_tokens (C2)
    last_hidden: Mapped[bytes | None] = mapped_column(LargeBinary, nullable=True)
    parent_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id", ondelete="SET NULL"), nullable=True,
                                                  index=True)  # a page's forks, a parent's delete (0005)
    fork_position: Mapped[int | None] = mapped_column(Integer, nullable=True)
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)
    updated_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("session_id", "seq"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    n_tokens: Mapped[int] = mapped_column(Integer)
    n_cached: Mapped[int] = mapped_column(Integer)
    reason: Mapped[str] = mapped_column(String(32))
    created_at: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow)


class SegmentRow(Base):
    """A set of per-layer append-only files `sessions/<id>/layer-NNN.kv`, written by one session."""
    __tablename__ = "segments"
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    n_layers: Mapped[int] = mapped_column(Integer)
    token_bytes: Mapped[int] = mapped_column(Integer)  # bytes of one token in one layer
    committed_end: Mapped[int] = mapped_column(BigInteger, default=0)  # bytes of each file in use


class ExtentRow(Base):
    """Tokens [start, start + n_tokens) of a session as first written: same offset in every layer file."""
    __tablename__ = "extents"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    segment_id: Mapped[str] = mapped_column(ForeignKey("segments.id"), index=True)
    offset: Mapped[int] = mapped_column(BigInteger)
    n_tokens: Mapped[int] = mapped_column(Integer)
    checksums: Mapped[list[str]] = mapped_column(JSON)  # xxh3-64 per layer of the raw bytes


class SessionExtentRow(Base):
    """The first n_tokens of an extent sit at positions [start, start + n_tokens) of a session."""
    __tablename__ = "session_extents"
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True)
    start: Mapped[int] = mapped_column(Integer, primary_key=True)
    extent_id: Mapped[int] = mapped_column(ForeignKey("extents.id"), index=True)
    n_tokens: Mapped[int] = mapped_column(Integer)


class TokenBlockRow(Base):
    __tablename__ = "token_blocks"
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True)
    start: Mapped[int] = mapped_column(Integer, primary_key=True)
    ids: Mapped[bytes] = mapped_column(LargeBinary)  # int32 little-endian


class PrefixKeyRow(Base):
    """The prefix cache's index (C10): `key` names tokens [0, position) of a session, on its model,
    weights, dtype, kernels and chunk size (`prefix.chain`); `position` is a chunk boundary (a
    KEY_BLOCK's, where every row is computed alone: `prefix.key_block`) within the session's n_reusable. Equal keys: equal tokens whose stored KV is a cold run's."""
    __tablename__ = "prefix_keys"
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True)
    position: Mapped[int] = mapped_column(Integer, primary_key=True)
    key: Mapped[str] = mapped_column(String(32), index=True)


class PrefixEntryRow(Base):
    """A session kept only as a prefix-cache entry (a stateless request's, after its reply): evicted,
    least recently used first, when the entries' bytes exceed the budget. Named sessions have none."""
    __tablename__ = "prefix_entries"
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), primary_key=True)
    bytes: Mapped[int] = mapped_column(BigInteger)  # KV bytes the session wrote itself (its own segment)
    last_used: Mapped[dt.datetime] = mapped_column(DateTime, default=utcnow, index=True)


class MessageRow(Base):
    __tablename__ = "messages"
    __table_args__ = (UniqueConstraint("session_id", "ordinal"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    ordinal: Mapped[int] = mapped_column(Integer)
    role: Mapped[str] = mapped_column(String(32))
    text: Mapped[str] = mapped_column(AnyText)
    token_start: Mapped[int] = mapped_column(Integer)
    token_end: Mapped[int] = mapped_column(Integer)


class BlobRow(Base):
    """A packed extent: per layer one compressed payload (`codec`), in one content-addressed file."""
    __tablename__ = "blobs"
    hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    frames: Mapped[list[list[int]]] = mapped_column(JSON)  # per layer its payload's [offset, size]
    size: Mapped[int] = mapped_column(BigInteger)
    file_checksum: Mapped[str] = mapped_column(String(32))


class ExtentBlobRow(Base):
    """Where a packed extent's bytes live now (its raw file range may be gone)."""
    __tablename__ = "extent_blobs"
    extent_id: Mapped[int] = mapped_column(ForeignKey("extents.id"), primary_key=True)
    blob_hash: Mapped[str] = mapped_column(ForeignKey("blobs.hash"), index=True)


# -- engine ------------------------------------------------------------------------------------
POSTGRES_DRIVERS = ("psycopg2", "psycopg")  # what a plain postgresql:// URL may use, in SQLAlchemy's order
WRITER_LOCK_KEY = 0x6B7673746F7265  # "kvstore": the PostgreSQL advisory lock that serializes transactions
LOCK_WAIT_S = 30  # how long a transaction waits for another one, on either database


def make_engine(url: str) -> Engine:
    """An engine for a SQLite or PostgreSQL index, set up so that transactions run one at a time.

    Both databases get the same semantics: SQLite through BEGIN IMMEDIATE, PostgreSQL through a
    transaction-level advisory lock. Every read-check-write in the store (head compare-and-set,
    gc's "nothing references this file", fork's copy of the parent's extent list) relies on it."""
    parsed = database_url(url)
    try:
        engine = create_engine(parsed, future=True, pool_pre_ping=parsed.get_backend_name() == "postgresql")
    except (ImportError, NoSuchModuleError) as e:  # the driver named in the URL is not installed or not known
        raise IndexUnavailable(f"the database driver for {_shown(parsed)} is not installed ({e}); "
                               "for PostgreSQL: pip install 'kvstore[postgres]'") from e
    if engine.dialect.name == "sqlite":
        _sqlite_setup(engine)
    else:
        _postgresql_setup(engine)
    _report_index_errors(engine)
    return engine


def database_url(url: str) -> URL:
    """Parse an index URL; a driverless `postgresql://` takes whichever PostgreSQL driver is installed."""
    try:
        parsed = make_url(url)
    except ArgumentError as e:
        raise IndexUnavailable(f"{url!r} is not a database URL; use postgresql://USER@HOST/DB, or no URL "
                               "for the home's kvstore.db") from e
    backend = parsed.get_backend_name()
    if backend not in ("sqlite", "postgresql"):
        raise IndexUnavailable(f"the index runs on SQLite or PostgreSQL, not {backend} ({_shown(parsed)})")
    if parsed.drivername == "postgresql":
        driver = next((d for d in POSTGRES_DRIVERS if importlib.util.find_spec(d) is not None), None)
        if driver is None:
            raise IndexUnavailable(f"no PostgreSQL driver is installed for {_shown(parsed)}; "
                                   "pip install 'kvstore[postgres]'")
        parsed = parsed.set(drivername=f"postgresql+{driver}")
    return parsed


def _shown(url: URL) -> str:
    return url.render_as_string(hide_password=True)


def shown_url(engine: Engine) -> str:
    """The engine's URL as it may be printed (password hidden)."""
    return _shown(engine.url)


def _sqlite_setup(engine: Engine) -> None:
    """WAL, synchronous=FULL, foreign keys, a busy timeout, and BEGIN IMMEDIATE for writes."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        dbapi_conn.isolation_level = None  # we emit BEGIN ourselves
        cur = dbapi_conn.cursor()
        cur.execute(f"PRAGMA busy_timeout = {LOCK_WAIT_S * 1000}")
        cur.execute("PRAGMA journal_mode = WAL")
        cur.execute("PRAGMA synchronous = FULL")
        cur.execute("PRAGMA foreign_keys = ON")
        cur.close()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql("BEGIN IMMEDIATE")


def _postgresql_setup(engine: Engine) -> None:
    """Every transaction first takes one advisory lock (released at its end, commit or rollback, and by
    the server when a killed client's connection drops): the counterpart of SQLite's BEGIN IMMEDIATE.
    Waiting for it gives up after LOCK_WAIT_S, as SQLite's busy timeout does."""

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_conn, _record):
        cur = dbapi_conn.cursor()
        cur.execute(f"SET lock_timeout = '{LOCK_WAIT_S}s'")
        cur.execute("SET synchronous_commit = on")  # a committed head is on disk, whatever the server default
        cur.close()
        dbapi_conn.commit()

    @event.listens_for(engine, "begin")
    def _on_begin(conn):
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({WRITER_LOCK_KEY})")


def sqlstate(e: BaseException) -> str | None:
    """The PostgreSQL SQLSTATE of a driver error (psycopg names it `sqlstate`, psycopg2 `pgcode`)."""
    return getattr(e, "sqlstate", None) or getattr(e, "pgcode", None)


def _lock_wait_ran_out(e: BaseException) -> bool:
    """SQLite's SQLITE_BUSY after the busy timeout, PostgreSQL's lock_not_available (55P03)."""
    return "database is locked" in str(e) or sqlstate(e) == "55P03"


def _disk_full(e: BaseException) -> bool:
    """SQLite's SQLITE_FULL ("database or disk is full"), PostgreSQL's disk_full (53100)."""
    return "full" in str(e).lower() or sqlstate(e) == "53100"


def _report_index_errors(engine: Engine) -> None:
    """A transaction that waited LOCK_WAIT_S for another raises IndexBusy instead of the driver's error,
    and any statement that found the index's disk full raises StoreFull (creating, forking, renaming,
    deleting a session: every write, not only a checkpoint's, `store_full_on_disk_full`)."""

    @event.listens_for(engine, "handle_error")
    def _on_error(ctx):
        if not isinstance(ctx.sqlalchemy_exception, OperationalError):
            return None
        if _lock_wait_ran_out(ctx.original_exception):
            return IndexBusy(f"the index {shown_url(engine)} stayed locked by another process for {LOCK_WAIT_S} s "
                             "(a stopped or hung kvstore, or another program holding the database); "
                             "nothing was changed: try again once it has finished")
        if _disk_full(ctx.original_exception):
            return IndexFull("the index: the disk is full; nothing was changed. Free some space (kvstore gc, "
                             "kvstore rm) and try again")
        return None


class IndexFull(StoreFull):
    """StoreFull raised by the index's own statements (`_report_index_errors`)."""


def migrations_dir() -> Path:
    return Path(str(resources.files("kvstore.migrations")))


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the schema to `revision` (no-op when it is there already)."""
    from alembic import command
    from alembic.runtime.migration import MigrationContext
    from alembic.script import ScriptDirectory

    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    script = ScriptDirectory.from_config(cfg)
    with engine.connect() as conn:
        current = MigrationContext.configure(conn).get_current_revision()
    heads = set(script.get_heads())
    if revision == "head" and current in heads:
        return
    known = {rev.revision for rev in script.walk_revisions()}
    if current is not None and current not in known:
        raise UnsupportedFormat(f"the index is at schema revision {current!r}, which this kvstore does not know; "
                                "upgrade kvstore to open this store")
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, revision)


@contextmanager
def store_full_on_disk_full(what: str):
    """The index's full disk (SQLite's "database or disk is full", PostgreSQL's disk_full: `IndexFull`,
    the same condition as ENOSPC) as `what`'s StoreFull, which says the last checkpoint is intact."""
    try:
        yield
    except IndexFull as e:
        raise StoreFull(f"{what}: the disk is full; the last checkpoint is intact. "
                        "Free some space (kvstore gc, kvstore rm) and try again") from e
