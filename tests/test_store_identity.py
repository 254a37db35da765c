"""One index serves one home (kvstore/identity.py): the index and the home's `store-id` file carry the
same id; a store from before identities takes one on open; an index that belongs to another home
is refused with what to do, and nothing is changed."""

from __future__ import annotations

import shutil

import pytest
from alembic import command
from sqlalchemy import select

import kvstore
import store_harness as H
from kvstore.store import index
from kvstore.errors import StoreMismatch
from kvstore.store.identity import MARKER


def index_id(store) -> str:
    with store.db() as db:
        return db.scalar(select(index.StoreIdentityRow.id))


def make_store(home, model, name="s"):
    store = kvstore.open_store(home)
    with store.new(name, model, seed=1) as s:
        s.append_text(H.DOCUMENT)
    return store


def test_a_new_store_binds_its_home_and_index(tmp_path, model):
    store = make_store(tmp_path / "home", model)
    marker = (tmp_path / "home" / MARKER).read_text().strip()
    assert len(marker) == 32 and marker == index_id(store)
    store.close()
    assert index_id(kvstore.open_store(tmp_path / "home")) == marker  # reopening keeps it


def test_a_store_from_before_identities_takes_one_on_open(tmp_path, model):
    store = make_store(tmp_path / "home", model)
    tokens = store.tokens("s")
    url = store.engine.url.render_as_string(hide_password=False)
    with store.engine.begin() as conn:
        cfg = index.alembic_config(url)
        cfg.attributes["connection"] = conn
        command.downgrade(cfg, "0002")
    store.close()
    (tmp_path / "home" / MARKER).unlink()
    again = kvstore.open_store(tmp_path / "home")
    assert (tmp_path / "home" / MARKER).read_text().strip() == index_id(again)
    assert again.tokens("s") == tokens and again.verify() == {"s": []}


def test_an_index_copied_from_another_home_is_refused(tmp_path, model):
    a = make_store(tmp_path / "a", model, name="in-a")
    b = make_store(tmp_path / "b", model, name="in-b")
    a.close()
    b.close()
    b_index = (tmp_path / "b" / "kvstore.db").read_bytes()
    shutil.copy(tmp_path / "a" / "kvstore.db", tmp_path / "b" / "kvstore.db")
    with pytest.raises(StoreMismatch, match="belong to different stores: one index serves one home"):
        kvstore.open_store(tmp_path / "b")
    (tmp_path / "b" / "kvstore.db").write_bytes(b_index)  # nothing in b was touched: its own index opens it
    assert kvstore.open_store(tmp_path / "b").verify() == {"in-b": []}


def test_a_lost_store_id_is_refused_until_written_back(tmp_path, model):
    store = make_store(tmp_path / "home", model)
    store_id = index_id(store)
    store.close()
    marker = tmp_path / "home" / MARKER
    marker.unlink()
    with pytest.raises(StoreMismatch, match=f"write {store_id} into") as e:
        kvstore.open_store(tmp_path / "home")
    assert str(marker) in str(e.value) and not marker.exists()
    marker.write_text(store_id + "\n")  # what the message says to do
    assert kvstore.open_store(tmp_path / "home").tokens("s")
