"""The verbs on stored sessions: list, show, history, fork, rm, export, import, pack, verify, gc.

None of them loads a model (`history` reads only the tokenizer, and only for raw text).
"""

from __future__ import annotations

import shlex
from pathlib import Path

import click

import kvstore

from .render import (bytes_bar, echo_json, human_bytes, note, show_session, stream_json_array, stream_table,
                     summary_text)


def register(cli: click.Group) -> None:
    for command in (list_, show, history, fork, rm, export, import_, pack, verify, gc):
        cli.add_command(command)


LIST_HEADERS = ["NAME", "TOKENS", "CHECKPOINTS", "DISK", "MODEL", "PARENT", "UPDATED"]


@click.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of session records.")
@click.option("--limit", type=click.IntRange(min=1), metavar="N",
              help="List at most N sessions; when more follow, stderr says how to list the next page "
                   "[default: all, read a page at a time].")
@click.option("--after", metavar="NAME",
              help="Start after the session NAME (in name order): the last name of the previous page.")
@click.pass_obj
def list_(app, as_json: bool, limit: int | None, after: str | None):
    """List the sessions in the store, in name order."""
    listed = Listing(app.store, limit, after)
    if as_json:
        stream_json_array(info.to_dict() for page in listed.pages() for info in page)
    else:
        stream_table(LIST_HEADERS, ([list_row(i) for i in page] for page in listed.pages()))
    if listed.total == 0 and not as_json:
        note(f"no sessions after {after!r} in {app.store.home}" if after is not None else
             f"no sessions in {app.store.home}")
    if listed.next is not None:
        flags = " --json" if as_json else ""
        note(f"more sessions follow; the next page: kvstore list{flags} --limit {limit} "
             f"--after {shlex.quote(listed.next)}")


class Listing:
    """The pages of `kvstore list`: PAGE sessions per query up to `limit` (all when None), each page
    read only when the one before it is written; `next` is the cursor left when `limit` stopped it."""

    PAGE = 1000

    def __init__(self, store, limit: int | None, after: str | None):
        self.store, self.limit, self.after = store, limit, after
        self.total, self.next = 0, None

    def pages(self):
        after = self.after
        while self.limit is None or self.total < self.limit:
            want = self.PAGE if self.limit is None else min(self.PAGE, self.limit - self.total)
            page = self.store.page(want, after)
            self.total += len(page.sessions)
            yield page.sessions
            if page.next is None:
                return
            after = page.next
        self.next = after


def list_row(i) -> list[str]:
    return [i.name, f"{i.n_tokens:,}", f"{i.checkpoints:,}", human_bytes(i.disk_bytes), Path(i.model_source).name,
            i.parent or "-", i.updated_at + (" (unfinished)" if i.active_call else "")]


@click.command()
@click.argument("session")
@click.option("--json", "as_json", is_flag=True, help="Print the session record as JSON.")
@click.pass_obj
def show(app, session: str, as_json: bool):
    """Show a session: model, tokens, checkpoints, disk bytes, forks."""
    info = app.store.info(session)
    if as_json:
        echo_json(info.to_dict())
    else:
        show_session(info)


@click.command()
@click.argument("session")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of {role, text, token_start, token_end}.")
@click.pass_obj
def history(app, session: str, as_json: bool):
    """Print the text of a session: its chat turns and any raw text."""
    entries = app.store.history(session)
    if as_json:
        echo_json(entries)
        return
    for e in entries:
        where = (f"restated at token {e['token_start']:,}: the one in effect, not read again" if kvstore.restated(e)
                 else f"tokens {e['token_start']:,}-{e['token_end']:,}")
        click.echo(f"--- {e['role']} ({where})")
        click.echo(e["text"])


@click.command()
@click.argument("session")
@click.argument("new")
@click.option("--at", type=click.IntRange(min=1), help="Keep only the first N tokens [default: all].")
@click.option("--weights", type=click.Choice(kvstore.WEIGHT_FORMATS),
              help="Go on with the model's weights held this way instead of SESSION's (other bits from the fork on) "
                   "[default: SESSION's].")
@click.pass_obj
def fork(app, session: str, new: str, at: int | None, weights: str | None):
    """Create NEW from SESSION (or its first N tokens), sharing its KV."""
    app.store.fork(session, new, at=at, weights=weights)
    info = app.store.info(new)
    note(f"forked {session!r} at {info.n_tokens:,} tokens into {new!r}")


@click.command()
@click.argument("session")
@click.pass_obj
def rm(app, session: str):
    """Delete a session (forks keep what they share with it)."""
    app.store.delete(session)
    note(f"deleted {session!r}")


@click.command()
@click.argument("session")
@click.option("--output", "-o", required=True, type=click.Path(dir_okay=False, path_type=Path),
              help="Archive file to write (not one that exists, unless --force).")
@click.option("--force", "-f", is_flag=True, help="Replace the file at --output if there is one.")
@click.pass_obj
def export(app, session: str, output: Path, force: bool):
    """Write a session to one self-describing archive file."""
    if output.exists() and not force:  # an archive there may be the only copy of a session deleted since
        raise click.ClickException(f"{output} exists; pass --force to replace it, or choose another --output")
    with bytes_bar("export") as bar:
        summary = app.store.export(session, output, progress=bar)
    note(f"exported {session!r} to {output} ({human_bytes(summary['bytes'])}, {summary['tokens']:,} tokens)")


@click.command(name="import")
@click.argument("file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--as", "name", help="Session name [default: the exported one].")
@click.pass_obj
def import_(app, file: Path, name: str | None):
    """Import an archive; every checksum is verified before storing."""
    with bytes_bar("import") as bar:
        imported = app.store.import_(file, name=name, progress=bar)
    note(f"imported {file} as {imported!r}")


@click.command()
@click.argument("session")
@click.pass_obj
def pack(app, session: str):
    """Compress a paused session's KV into blobs; free its raw files."""
    with bytes_bar("pack") as bar:
        summary = app.store.pack(session, progress=bar)
    details = summary_text(summary)
    note(f"packed {session!r}" + (f": {details}" if details else ""))


@click.command()
@click.argument("session", required=False)
@click.pass_obj
def verify(app, session: str | None):
    """Check every checksum and the index; exit 1 if anything is wrong."""
    with bytes_bar("verify") as bar:
        report = app.store.verify(session, progress=bar)
    bad = {name: problems for name, problems in report.items() if problems}
    for name in report:
        if name in bad:
            for problem in bad[name]:
                click.echo(f"{name}: {problem}")
        else:
            click.echo(f"{name}: ok")
    if not report:
        note("no sessions to verify")
    if bad:
        raise click.ClickException(f"{len(bad)} of {len(report)} session(s) have problems")


@click.command()
@click.pass_obj
def gc(app):
    """Delete files no session refers to any more."""
    summary = app.store.gc()
    details = summary_text(summary)
    note("gc: " + (details or "nothing to do"))
