"""A throwaway PostgreSQL server for the tests of an index on PostgreSQL.

`Server` runs `initdb` into a new temporary folder, starts the server on a free port of 127.0.0.1
(trust authentication, no fsync: the tests kill clients, never the server) and hands out one fresh
database per test (`new_database`). The binaries come from PATH or Debian's
`/usr/lib/postgresql/<version>/bin`; PostgreSQL refuses to run as root, so as root the server runs
as the `postgres` user that Debian's package creates. `unavailable()` says why there is no server
(the tests skip with that reason).
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path

USER = "kvstore"


def bin_dir() -> Path | None:
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parts[-3]))
    return versions[-1].parent if versions else None


def unavailable() -> str | None:
    """Why no server can be started here, or None."""
    if importlib.util.find_spec("psycopg") is None and importlib.util.find_spec("psycopg2") is None:
        return "no PostgreSQL driver (pip install 'kvstore[postgres]')"
    if bin_dir() is None:
        return "no PostgreSQL server binaries (initdb) on PATH or in /usr/lib/postgresql (apt-get install postgresql)"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root, and there is no `postgres` user to run the server as"
    return None


class Server:
    def __init__(self):
        self.bin = bin_dir()
        self.dir = Path(tempfile.mkdtemp(prefix="kvstore-pg-"))
        self.port = _free_port()
        self.as_user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        if self.as_user:
            shutil.chown(self.dir, "postgres")

    def start(self) -> None:
        data = self.dir / "data"
        self._run("initdb", "-D", str(data), "-U", USER, "-A", "trust", "-E", "UTF8", "--no-sync")
        options = f"-p {self.port} -k {self.dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run("pg_ctl", "-D", str(data), "-o", options, "-l", str(self.dir / "server.log"), "-w", "start")

    def stop(self) -> None:
        try:
            self._run("pg_ctl", "-D", str(self.dir / "data"), "-m", "immediate", "stop")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """The URL of a new, empty database."""
        from sqlalchemy import create_engine, text

        from kvstore.store.index import database_url

        name = "kv_" + uuid.uuid4().hex[:12]
        admin = create_engine(database_url(self.url()), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(text(f"CREATE DATABASE {name}"))
        finally:
            admin.dispose()
        return self.url(name)

    def _run(self, tool: str, *args: str) -> None:
        done = subprocess.run([*self.as_user, str(self.bin / tool), *args], capture_output=True, text=True)
        if done.returncode != 0:
            log = self.dir / "server.log"
            raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr.strip()}\n"
                               + (log.read_text() if log.exists() else ""))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
