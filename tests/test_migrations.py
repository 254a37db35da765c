"""The index schema is owned by Alembic: a blank database migrates to exactly the models, an old
store upgrades on open with its data intact, and a store from a newer kvstore is refused."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import text

import kvstore
from kvstore.store import index
from kvstore.errors import UnsupportedFormat


def test_a_blank_database_upgrades_to_the_models(tmp_path):
    url = f"sqlite:///{tmp_path / 'k.db'}"
    engine = index.make_engine(url)
    index.upgrade(engine)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), index.Base.metadata) == []


def test_sqlite_runs_in_wal_mode_with_full_sync_and_foreign_keys(tmp_path):
    store = kvstore.open_store(tmp_path)
    with store.engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
        assert conn.execute(text("PRAGMA synchronous")).scalar() == 2  # FULL
        assert conn.execute(text("PRAGMA foreign_keys")).scalar() == 1


def test_a_store_at_the_first_revision_opens_after_the_upgrade(tmp_path, tiny):
    from alembic import command

    model = kvstore.load_model(tiny("llama-gqa").folder)
    store = kvstore.open_store(tmp_path)
    with store.new("old", model, seed=2) as s:  # a raw session lives entirely in 0001's tables
        s.append_text("written before the upgrade")
        tokens = list(s.tokens)
    store.close()
    url = f"sqlite:///{tmp_path / 'kvstore.db'}"
    engine = index.make_engine(url)
    with engine.begin() as conn:
        cfg = index.alembic_config(url)
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0001")
    with engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == "0001"
        assert "blobs" not in {r[0] for r in conn.execute(text("SELECT name FROM sqlite_master"))}
    engine.dispose()
    upgraded = kvstore.open_store(tmp_path)  # migrates 0001 -> head
    with upgraded.engine.connect() as conn:
        assert MigrationContext.configure(conn).get_current_revision() == "0007"
    assert upgraded.info("old").n_cached == len(tokens) - 1  # 0004's downgrade left the last token pending
    assert upgraded.info("old").weights == "dense"  # 0006: every session from before had dense weights
    with upgraded.open("old", model) as s:
        assert s.tokens == tokens
    assert upgraded.pack("old")["extents"] >= 1  # the new tables work
    assert upgraded.verify() == {"old": []}


def downgrade(url: str, revision: str) -> None:
    from alembic import command

    engine = index.make_engine(url)
    with engine.begin() as conn:
        cfg = index.alembic_config(url)
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, revision)
    engine.dispose()


def test_0005_indexes_the_parent_of_forks_so_a_page_finds_its_forks_without_a_scan(tmp_path):
    """0001 -> head gives exactly the models; 0005 alone adds and drops ix_sessions_parent_id."""
    url = f"sqlite:///{tmp_path / 'k.db'}"
    engine = index.make_engine(url)
    index.upgrade(engine, "0001")
    index.upgrade(engine)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), index.Base.metadata) == []
        plan = " ".join(str(r) for r in conn.execute(text("EXPLAIN QUERY PLAN SELECT name FROM sessions "
                                                             "WHERE parent_id = 'x'")))
        assert "ix_sessions_parent_id" in plan
    engine.dispose()
    downgrade(url, "0004")
    engine = index.make_engine(url)
    with engine.connect() as conn:
        assert "ix_sessions_parent_id" not in {r[0] for r in conn.execute(text("SELECT name FROM sqlite_master"))}
    index.upgrade(engine)
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), index.Base.metadata) == []
    engine.dispose()


def test_0006_records_how_a_session_held_its_weights_and_older_ones_held_them_dense(tmp_path, tiny):
    from engine_models import Q

    path, _ = tiny("llama-gqa").gguf(Q.Q8_0)
    store = kvstore.open_store(tmp_path)
    store.create("q8", kvstore.load_model(path, weights="stored"))
    store.create("dense", kvstore.load_model(path, weights="dense"))
    store.close()
    url = f"sqlite:///{tmp_path / 'kvstore.db'}"
    downgrade(url, "0005")
    engine = index.make_engine(url)
    with engine.connect() as conn:
        assert "weights" not in {r[1] for r in conn.execute(text("PRAGMA table_info(sessions)"))}
    engine.dispose()
    store = kvstore.open_store(tmp_path)  # back to head
    assert (store.info("q8").weights, store.info("dense").weights) == ("dense", "dense")
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), index.Base.metadata) == []


def test_0007_adds_the_prefix_index_and_sessions_from_before_are_no_prefix_source(tmp_path, tiny):
    """Sessions written before 0007 get no keys and n_reusable 0 (how their KV was computed is not
    known: see the migration); those written after are indexed at each checkpoint. Down and up again
    gives exactly the models."""
    model = kvstore.load_model(tiny("llama-gqa").folder)
    ids = tiny("llama-gqa").ids(40)
    store = kvstore.open_store(tmp_path)
    with store.new("before", model, chunk_size=8) as s:
        s.append_tokens(ids[:20])
    store.close()
    url = f"sqlite:///{tmp_path / 'kvstore.db'}"
    downgrade(url, "0006")
    engine = index.make_engine(url)
    with engine.connect() as conn:
        tables = {r[0] for r in conn.execute(text("SELECT name FROM sqlite_master WHERE type = 'table'"))}
        assert not {"prefix_keys", "prefix_entries"} & tables
        assert "n_reusable" not in {r[1] for r in conn.execute(text("PRAGMA table_info(sessions)"))}
    engine.dispose()
    store = kvstore.open_store(tmp_path)  # back to head
    with store.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), index.Base.metadata) == []
    assert store.find_prefix(model, ids[:20], 8) is None  # not backfilled
    with store.new("after", model, chunk_size=8) as s:
        s.append_tokens(ids[:20])
    hit = store.find_prefix(model, ids[:20], 8)
    assert (hit.name, hit.length) == ("after", 16)
    with store.open("before", model) as s:  # continued: still no source (its first 20 are not known alike)
        s.append_tokens(ids[20:40])
    assert store.find_prefix(model, ids[:40], 8).name == "after"


def test_a_store_from_a_newer_kvstore_is_refused(tmp_path):
    store = kvstore.open_store(tmp_path)
    with store.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = '9999'"))
    store.close()
    with pytest.raises(UnsupportedFormat, match="9999"):
        kvstore.open_store(tmp_path)
