"""Where a store is: its home directory and its index database (models are the user's: `engine.pull`)."""

from __future__ import annotations

import os
from pathlib import Path

ENV_HOME = "KVSTORE_HOME"
ENV_INDEX = "KVSTORE_INDEX"  # a database URL for the index instead of the home's kvstore.db


def home_dir(home: str | os.PathLike | None = None) -> Path:
    """The kvstore home: the argument, else $KVSTORE_HOME, else click's per-user app directory."""
    if home is not None:
        return Path(home).expanduser()
    if os.environ.get(ENV_HOME):
        return Path(os.environ[ENV_HOME]).expanduser()
    import click

    return Path(click.get_app_dir("kvstore"))


def index_url(url: str | None = None) -> str | None:
    """The index's database URL: the argument, else $KVSTORE_INDEX, else None (the home's SQLite file)."""
    return url or os.environ.get(ENV_INDEX) or None
