"""The `kvstore` command: the group, its global options, and library errors as one-line messages.

Each verb is a thin function over the library (`generation.py`: new, continue; `manage.py`: the
verbs on stored sessions). The library is imported inside the commands, so `--help` stays fast.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import click

import kvstore

from kvstore_serve.command import serve as serve_command

from . import generation, manage

EXIT_ERROR = 1  # a library error (unknown session, busy, wrong model, corrupt data, ...)
EXIT_INTERRUPTED = 130  # 128 + SIGINT: stopped by Ctrl-C after a checkpoint
EXIT_PIPE = 128 + signal.SIGPIPE  # 141: stdout's reader went away


class App:
    """What every command shares: the home directory, the index URL and, once asked for, the open store."""

    def __init__(self, home: Path | None, index: str | None = None):
        self.home = home
        self.index = index
        self._store = None

    @property
    def store(self):
        if self._store is None:
            import kvstore

            self._store = kvstore.open_store(self.home, url=self.index)
        return self._store

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
            self._store = None


class Group(click.Group):
    """Turns the library's errors into `Error: <one line>` and exit status 1, never a traceback; a
    stdout whose reader went away into a quiet exit, status 141 (as `new`/`continue` do after their
    checkpoint)."""

    def invoke(self, ctx: click.Context):
        from kvstore.errors import KvstoreError

        try:
            result = super().invoke(ctx)
            sys.stdout.flush()  # output still buffered meets a closed pipe here, not at interpreter exit
            return result
        except BrokenPipeError:  # the reader of stdout went away (`kvstore list | head`): end quietly
            quiet_stdout()
            ctx.exit(EXIT_PIPE)
        except (KvstoreError, ValueError, OSError) as e:
            raise click.ClickException(one_line(e)) from None
        except KeyboardInterrupt:
            click.echo("kvstore: interrupted", err=True)
            ctx.exit(EXIT_INTERRUPTED)


def quiet_stdout() -> None:
    """Point stdout at /dev/null so that flushing it at exit does not raise again."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
    except (OSError, ValueError, AttributeError):  # no real file descriptor (e.g. under a test runner)
        pass


def one_line(error: BaseException) -> str:
    from kvstore.errors import CorruptData

    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, CorruptData) and "kvstore verify" not in text:
        text += "; `kvstore verify` lists every damaged session"
    if isinstance(error, OSError) and not isinstance(error, click.ClickException):
        text = f"{error.strerror or text}: {error.filename}" if error.filename else text
    return text


@click.group(name="kvstore", cls=Group)
@click.option("--home", type=click.Path(file_okay=False, path_type=Path), envvar="KVSTORE_HOME", show_envvar=True,
              help="Store directory (default: the per-user app directory).")
@click.option("--index", metavar="URL", envvar="KVSTORE_INDEX", show_envvar=True,
              help="Keep the index in this PostgreSQL database (postgresql://USER@HOST/DB) instead of the "
                   "home's kvstore.db; session files stay in the home.")
@click.version_option(package_name="kvstore", prog_name="kvstore")
@click.pass_context
def cli(ctx: click.Context, home: Path | None, index: str | None):
    """kvstore: persistent, resumable LLM generation sessions.

    A session keeps its KV cache on disk, so a long prompt is read once: `continue` picks up where
    the last run stopped (or was killed) without recomputing it, token for token.
    """
    ctx.obj = App(home, index)
    ctx.call_on_close(ctx.obj.close)


@cli.command()
@click.argument("model", default=kvstore.DEFAULT_MODEL)
@click.pass_obj
def pull(app: App, model: str):
    """Download a default model (hashes checked); print its path."""
    click.echo(str(kvstore.pull(model, home=app.home)))


generation.register(cli)
manage.register(cli)
cli.add_command(serve_command)
