"""Core statements of a hot path, compiled once per dialect and run on the driver's cursor.

A decode checkpoints every few tokens, and each checkpoint runs about six statements on the index
(`commit.py`). Through `Connection.execute` each costs SQLAlchemy's execution machinery (an
execution context, parameter and result processing, events) on top of the driver's own time: about
0.13 ms against 0.04 ms with SQLite, on the thread that competes with the decode for the cores.

`Prepared(statement)(db, params)` runs the same statement on the same connection, inside the same
transaction, through the DBAPI cursor of `db`:
- the SQL text is SQLAlchemy's compilation of the statement for the connection's dialect, for the
  keys given (an INSERT or UPDATE names the columns passed), made once per dialect and key set;
- every value goes through its column type's bind processor (JSON, DateTime, ...), as
  `Connection.execute` would send it;
- a list of parameter dicts runs as one `executemany`;
- a driver error is raised as SQLAlchemy's wrapper of it (`DBAPIError.instance`: OperationalError,
  IntegrityError, ...), so callers catch what they would catch from `Connection.execute`.

What it does not do: run execution events, or fill Python-side column defaults. A statement whose
compiled form needs a value that was not given is refused when it is compiled (pass every column).
Returns the DBAPI cursor (`rowcount`; `fetchone()` after RETURNING).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from sqlalchemy import exc
from sqlalchemy.engine import Connection


@dataclass(frozen=True)
class _Form:
    sql: str
    names: tuple[str, ...]  # the bound parameters, in the order of a positional paramstyle
    positional: bool
    processors: tuple[Callable[[Any], Any] | None, ...]  # per name


class Prepared:
    """A Core statement run on the driver's cursor (see the module's docstring)."""

    def __init__(self, statement):
        self.statement = statement
        self._forms: dict[tuple[str, str, frozenset[str]], _Form] = {}

    def __call__(self, db: Connection, params: dict[str, Any] | list[dict[str, Any]]):
        many = isinstance(params, list)
        first = params[0] if many else params
        dialect = db.dialect
        key = (dialect.name, dialect.driver, frozenset(first))
        form = self._forms.get(key)
        if form is None:
            form = self._forms[key] = self._compile(dialect, first)
        rows = [self._bound(form, p) for p in (params if many else [params])]
        cursor = db.connection.dbapi_connection.cursor()
        try:
            if many:
                cursor.executemany(form.sql, rows)
            else:
                cursor.execute(form.sql, rows[0])
        except dialect.loaded_dbapi.Error as e:
            raise exc.DBAPIError.instance(form.sql, rows, e, dialect.loaded_dbapi.Error, dialect=dialect) from e
        return cursor

    def _compile(self, dialect, params: dict[str, Any]) -> _Form:
        compiled = self.statement.compile(dialect=dialect, column_keys=sorted(params))
        names = tuple(compiled.positiontup) if compiled.positional else tuple(compiled.binds)
        missing = sorted(set(names) - set(params))
        if missing:
            raise ValueError(f"{self.statement!s} needs values for {missing}: pass every column it writes")
        processors = tuple(compiled.binds[n].type.dialect_impl(dialect).bind_processor(dialect) for n in names)
        return _Form(compiled.string, names, compiled.positional, processors)

    @staticmethod
    def _bound(form: _Form, params: dict[str, Any]):
        values = [params[n] if p is None else p(params[n]) for n, p in zip(form.names, form.processors)]
        return tuple(values) if form.positional else dict(zip(form.names, values))
