"""`store.prepared.Prepared`: a Core statement run on the driver's cursor writes and reads exactly what
`Connection.execute` would, inside the caller's transaction, on SQLite and on PostgreSQL; it refuses
a statement that would need a Python-side default, and a driver error comes back as SQLAlchemy's.
"""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import (JSON, Column, DateTime, Integer, LargeBinary, MetaData, String, Table, bindparam,
                        create_engine, exc, insert, select, update)

from kvstore.store.prepared import Prepared

META = MetaData()
ROWS = Table("rows", META,
             Column("id", Integer, primary_key=True, autoincrement=True),
             Column("name", String(32), unique=True),
             Column("settings", JSON, nullable=True),
             Column("blob", LargeBinary, nullable=True),
             Column("at", DateTime))
WITH_DEFAULT = Table("with_default", META, Column("id", Integer, primary_key=True),
                     Column("at", DateTime, default=dt.datetime.now))

ADD = Prepared(insert(ROWS))
ADD_RETURNING_ID = Prepared(insert(ROWS).returning(ROWS.c.id))
RENAME = Prepared(update(ROWS).where(ROWS.c.name == bindparam("p_name")))
AT = dt.datetime(2026, 12, 5, 16, 30, 1, 250000)


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request, tmp_path):
    url = f"sqlite:///{tmp_path / 'p.db'}" if request.param == "sqlite" else request.getfixturevalue("pg_url")
    engine = create_engine(url)
    META.create_all(engine)
    yield engine
    engine.dispose()


def stored(engine) -> list[tuple]:
    with engine.connect() as db:
        return [tuple(r) for r in db.execute(select(ROWS).order_by(ROWS.c.id))]


def row(name: str) -> dict:
    return {"name": name, "settings": {"temperature": 0.7, "stop": ["\n"]}, "blob": b"\x00\xff" * 3, "at": AT}


def test_a_prepared_insert_stores_what_connection_execute_stores(engine):
    with engine.begin() as db:
        db.execute(insert(ROWS), row("through-execute"))
        ADD(db, row("prepared"))
    (_, *a), (_, *b) = stored(engine)
    assert a[0] == "through-execute" and b[0] == "prepared"
    assert a[1:] == b[1:] == [{"temperature": 0.7, "stop": ["\n"]}, b"\x00\xff" * 3, AT]


def test_returning_rowcount_and_many_rows(engine):
    with engine.begin() as db:
        first = ADD_RETURNING_ID(db, row("a")).fetchone()[0]
        ADD(db, [row("b"), row("c")])  # one executemany
        assert RENAME(db, {"p_name": "b", "name": "b2"}).rowcount == 1
        assert RENAME(db, {"p_name": "nobody", "name": "x"}).rowcount == 0
    assert [(r[0], r[1]) for r in stored(engine)] == [(first, "a"), (first + 1, "b2"), (first + 2, "c")]


def test_it_runs_inside_the_callers_transaction(engine):
    with pytest.raises(RuntimeError):
        with engine.begin() as db:
            ADD(db, row("rolled back"))
            raise RuntimeError
    assert stored(engine) == []


def test_a_statement_that_needs_a_python_side_default_is_refused(engine):
    with engine.begin() as db:
        with pytest.raises(ValueError, match="pass every column"):
            Prepared(insert(WITH_DEFAULT))(db, {"id": 1})


def test_a_driver_error_is_raised_as_sqlalchemy_wraps_it(engine):
    with engine.begin() as db:
        ADD(db, row("twice"))
    with pytest.raises(exc.IntegrityError):
        with engine.begin() as db:
            ADD(db, row("twice"))
    assert [r[1] for r in stored(engine)] == ["twice"]
