"""Alembic environment for the kvstore index.

kvstore runs migrations itself when a store is opened (`kvstore.index.upgrade`), handing over its
connection in `config.attributes["connection"]`; the `alembic` command line works too, with
`sqlalchemy.url` set in the config.
"""

from alembic import context
from sqlalchemy import create_engine

from kvstore.store.index import Base, database_url

target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
        context.run_migrations()
        return
    engine = create_engine(database_url(context.config.get_main_option("sqlalchemy.url")))
    with engine.begin() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        context.run_migrations()


def run_migrations_offline() -> None:
    context.configure(url=context.config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
