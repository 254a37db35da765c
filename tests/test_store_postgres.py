"""The index on PostgreSQL (`open_store(url=...)`, `kvstore --index URL`): the same schema through the
same migrations, the same verbs, the same byte-identical resume (contract C1: trace lines equal to
an uninterrupted run whose index was SQLite) and the same one-writer rules as on SQLite.

Each test gets a new database on a throwaway server (conftest's `postgres`, tests/pg_server.py);
without a server or a driver the tests skip and say why.
"""

from __future__ import annotations

import functools
import json
import threading

import pytest
from alembic import command
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from click.testing import CliRunner
from sqlalchemy import select

import kvstore
import store_harness as H
from kvstore.store import index
from kvstore.errors import IndexBusy, IndexUnavailable, SessionBusy, StoreMismatch, StoreMissing
from kvstore.store.identity import MARKER
from kvstore_cli.main import cli

N_NEW = 24


@pytest.fixture(scope="module")
def reference(tmp_path_factory, model):
    """(tokens, trace lines by position) of an uninterrupted sampled run, its index in SQLite."""
    tmp = tmp_path_factory.mktemp("reference")
    tokens = H.reference_run(tmp / "home", model, "ref", N_NEW, tmp / "t.jsonl", **H.SAMPLED)
    return tokens, H.by_position(H.read_trace(tmp / "t.jsonl"))


def new_session(home, url, model, name="s"):
    store = kvstore.open_store(home, url=url)
    s = store.new(name, model, seed=5, chunk_size=16, checkpoint_every=4, **H.SAMPLED)
    s.append_text(H.DOCUMENT)
    return store, s


def continue_to_end(session, reference, trace):
    list(session.generate(len(reference[0]) - len(session.tokens), trace=trace, stop_at_eos=False))
    H.assert_matches(reference, session.tokens, H.read_trace(trace))


def revision(engine) -> str | None:
    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def head_revision() -> str:
    return ScriptDirectory.from_config(index.alembic_config("sqlite://")).get_current_head()


# -- schema ------------------------------------------------------------------------------------------
def test_a_blank_database_migrates_to_the_models(pg_url):
    engine = index.make_engine(pg_url)
    index.upgrade(engine)
    assert revision(engine) == head_revision()
    with engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), index.Base.metadata) == []
    engine.dispose()


def test_a_store_at_the_first_revision_upgrades_on_open(pg_url, tmp_path, model):
    store, s = new_session(tmp_path / "home", pg_url, model, name="old")
    s.close()
    tokens = store.tokens("old")
    with store.engine.begin() as conn:
        cfg = index.alembic_config(store.engine.url.render_as_string(hide_password=False))
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0001")
    assert revision(store.engine) == "0001"
    store.close()
    upgraded = kvstore.open_store(tmp_path / "home", url=pg_url)
    assert revision(upgraded.engine) == head_revision()
    assert upgraded.tokens("old") == tokens
    assert upgraded.pack("old")["extents"] >= 1  # the tables of the later revision work
    assert upgraded.verify() == {"old": []}


# -- byte-identical resume -----------------------------------------------------------------------------
def test_close_reopen_and_continue_match_the_sqlite_run(pg_url, tmp_path, model, reference):
    store, s = new_session(tmp_path / "home", pg_url, model)
    trace = tmp_path / "t.jsonl"
    list(s.generate(N_NEW // 3, trace=trace, stop_at_eos=False))
    s.close()
    store.close()
    with kvstore.open_store(tmp_path / "home", url=pg_url).open("s", model) as s:
        continue_to_end(s, reference, trace)


@pytest.mark.parametrize("delay", [0.02, 0.08, 0.2])
def test_sigkill_during_generation_then_resume(pg_url, tmp_path, model_path, model, reference, delay):
    store, s = new_session(tmp_path / "home", pg_url, model)
    s.close()
    trace = tmp_path / "t.jsonl"
    child = functools.partial(H.child_generate, url=pg_url)
    proc, conn = H.start(child, str(tmp_path / "home"), model_path, "s", N_NEW, str(trace), 2)
    H.wait_for(conn, "ready")
    acked = [m for m in H.kill_after(proc, conn, delay) if m[0] == "ack"]
    with store.open("s", model) as s:  # the server dropped the dead writer's transaction and lock
        if acked:
            assert len(s.tokens) >= acked[-1][2]  # no acknowledged checkpoint is lost
        if s.active_call:
            for _ in s.resume(trace=trace):
                pass
            assert s.tokens == reference[0]
        else:
            continue_to_end(s, reference, trace)


# -- the store's verbs ------------------------------------------------------------------------------------
def test_fork_pack_delete_gc_and_verify(pg_url, tmp_path, model, reference):
    store, s = new_session(tmp_path / "home", pg_url, model)
    list(s.generate(8, stop_at_eos=False))
    s.close()
    store.fork("s", "copy")
    assert store.info("copy").disk_bytes == 0 and store.info("s").forks == ["copy"]
    assert store.pack("s")["extents"] >= 1
    store.delete("s")
    store.gc()
    assert [i.name for i in store.list()] == ["copy"]
    assert store.verify() == {"copy": []}
    with store.open("copy", model) as c:
        continue_to_end(c, reference, tmp_path / "t.jsonl")


def test_export_to_sqlite_and_back_to_another_database(pg_url, postgres, tmp_path, model, reference):
    store, s = new_session(tmp_path / "home", pg_url, model)
    list(s.generate(8, stop_at_eos=False))
    s.close()
    store.export("s", tmp_path / "s.kvs")
    on_sqlite = kvstore.open_store(tmp_path / "sqlite-home")
    assert on_sqlite.import_(tmp_path / "s.kvs", model=model) == "s"
    on_sqlite.export("s", tmp_path / "again.kvs")
    other = kvstore.open_store(tmp_path / "other-home", url=postgres.new_database())
    assert other.import_(tmp_path / "again.kvs", name="back", model=model) == "back"
    with other.open("back", model) as b:
        continue_to_end(b, reference, tmp_path / "t.jsonl")


def test_any_text_round_trips_nul_included(pg_url, tmp_path, model):
    """PostgreSQL's text cannot hold U+0000; a message, a system prompt or a recorded call can."""
    odd = "a\x00b \uffff0 \uffff\uffff \x00\uffff"  # NUL, and the escape character used to store it
    store = kvstore.open_store(tmp_path / "home", url=pg_url)
    with store.new("s", model, system=odd) as s:
        list(s.chat(odd, max_new_tokens=3))
    texts = [m.text for m in store.messages("s")]
    assert texts[:2] == [odd, odd]
    with store.open("s", model) as s:
        assert s.messages[1]["text"] == odd


# -- writers ---------------------------------------------------------------------------------------------
def test_transactions_take_turns(pg_url, tmp_path):
    """Like SQLite's BEGIN IMMEDIATE: while one store holds a transaction, another store's waits."""
    store = kvstore.open_store(tmp_path / "home", url=pg_url)
    other = kvstore.open_store(tmp_path / "home", url=pg_url)
    listed = threading.Event()
    waiter = threading.Thread(target=lambda: (other.list(), listed.set()))
    with store.engine.begin():
        waiter.start()
        assert not listed.wait(0.5)  # cannot happen while this transaction holds the lock
    waiter.join(30)
    assert listed.is_set()
    store.close()
    other.close()


def test_a_transaction_held_past_the_wait_is_index_busy(pg_url, tmp_path, model, monkeypatch):
    """A transaction that another one keeps waiting longer than LOCK_WAIT_S raises IndexBusy, changes
    nothing, and the next try goes through once the other has finished."""
    monkeypatch.setattr(index, "LOCK_WAIT_S", 1)
    store = kvstore.open_store(tmp_path / "home", url=pg_url)
    other = kvstore.open_store(tmp_path / "home", url=pg_url)
    with store.engine.begin():
        with pytest.raises(IndexBusy, match="locked by another process for 1 s.*nothing was changed"):
            other.new("s", model)
    assert other.list() == []
    other.new("s", model).close()
    assert [i.name for i in store.list()] == ["s"]
    store.close()
    other.close()


def test_a_second_writer_is_busy_while_other_sessions_go_on(pg_url, tmp_path, model_path, model):
    store, s = new_session(tmp_path / "home", pg_url, model, name="a")
    s.close()
    child = functools.partial(H.child_generate, url=pg_url)
    proc, conn = H.start(child, str(tmp_path / "home"), model_path, "a", 100000, str(tmp_path / "t"), 1)
    H.wait_for(conn, "ready")
    H.wait_for(conn, "ack")
    with pytest.raises(SessionBusy):
        store.open("a", model)
    with store.new("b", model, seed=1, checkpoint_every=2) as b:  # the index serves both writers
        b.append_text(H.DOCUMENT)
        list(b.generate(6, stop_at_eos=False))
    H.kill_after(proc, conn, 0.0)
    with store.open("a", model) as a:
        assert len(a.tokens) > len(store.tokens("b")) - 6 - 1
    assert store.verify() == {"a": [], "b": []}


@pytest.mark.slow
def test_writers_forks_packs_and_gc_at_once(pg_url, tmp_path, model_path, model):
    H.churn_with_gc(str(tmp_path / "home"), pg_url, model_path, model)


# -- errors ----------------------------------------------------------------------------------------------
def test_bad_index_urls_get_clear_errors(tmp_path, postgres):
    home = tmp_path / "home"
    with pytest.raises(IndexUnavailable, match="check that the server runs") as e:
        kvstore.open_store(home, url="postgresql://kv:s3cret@127.0.0.1:1/none")
    assert "s3cret" not in str(e.value)
    with pytest.raises(IndexUnavailable, match="SQLite or PostgreSQL, not mysql"):
        kvstore.open_store(home, url="mysql://u@h/db")
    with pytest.raises(IndexUnavailable, match=r"pip install 'kvstore\[postgres\]'"):
        kvstore.open_store(home, url="postgresql+nosuchdriver://u@h/db")
    with pytest.raises(IndexUnavailable, match="not a database URL"):
        kvstore.open_store(home, url="not a url")
    assert index.database_url(postgres.url()).drivername.startswith("postgresql+")  # a driver was chosen


def test_an_empty_database_beside_session_files_is_refused(pg_url, postgres, tmp_path, model):
    store, s = new_session(tmp_path / "home", pg_url, model)
    s.close()
    store.close()
    with pytest.raises(StoreMissing, match="holds session files"):
        kvstore.open_store(tmp_path / "home", url=postgres.new_database())
    assert kvstore.open_store(tmp_path / "home", url=pg_url).tokens("s")  # nothing was touched


def test_one_database_serves_one_home(pg_url, tmp_path, model):
    """A second home pointed at a database that serves another home is refused: no store-id written,
    the first home's sessions untouched."""
    store, s = new_session(tmp_path / "first", pg_url, model)
    s.close()
    with pytest.raises(StoreMismatch, match="belongs to another kvstore home"):
        kvstore.open_store(tmp_path / "second", url=pg_url)
    assert not (tmp_path / "second" / MARKER).exists()
    assert [i.name for i in store.list()] == ["s"]


def test_an_empty_home_moves_to_a_new_database(postgres, tmp_path):
    first = kvstore.open_store(tmp_path / "home", url=postgres.new_database())
    store_id = (tmp_path / "home" / MARKER).read_text().strip()
    first.close()
    moved = kvstore.open_store(tmp_path / "home", url=postgres.new_database())
    with moved.db() as db:
        assert db.scalar(select(index.StoreIdentityRow.id)) == store_id


def test_the_cli_takes_the_index_from_an_option_or_the_environment(pg_url, tmp_path, model_path, monkeypatch):
    home = str(tmp_path / "home")
    run = CliRunner().invoke(cli, ["--home", home, "--index", pg_url, "new", "s", "--model", model_path,
                                   "--prompt", "hello", "-n", "4"])
    assert run.exit_code == 0, run.output
    assert kvstore.open_store(home, url=pg_url).info("s").n_tokens > 4
    assert not (tmp_path / "home" / "kvstore.db").exists()
    monkeypatch.setenv("KVSTORE_INDEX", pg_url)
    listed = CliRunner().invoke(cli, ["--home", home, "list", "--json"])
    assert listed.exit_code == 0 and [r["name"] for r in json.loads(listed.stdout)] == ["s"]
    down = CliRunner().invoke(cli, ["--home", home, "--index", "postgresql://u@127.0.0.1:1/x", "list"])
    assert down.exit_code == 1 and "Error: cannot use the index database" in down.output
