"""The verbs on stored sessions: list, show, history, fork, rm, export, import, pack, verify, gc.

None of them loads a model (`history` reads only the tokenizer, and only for raw text).
"""

from __future__ import annotations

from pathlib import Path

import click

from .render import bytes_bar, echo_json, human_bytes, note, show_session, summary_text, table


def register(cli: click.Group) -> None:
    for command in (list_, show, history, fork, rm, export, import_, pack, verify, gc):
        cli.add_command(command)


@click.command(name="list")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON array of session records.")
@click.pass_obj
def list_(app, as_json: bool):
    """List the sessions in the store."""
    infos = app.store.list()
    if as_json:
        echo_json([i.to_dict() for i in infos])
    elif not infos:
        note(f"no sessions in {app.store.home}")
    else:
        table(["NAME", "TOKENS", "CHECKPOINTS", "DISK", "MODEL", "PARENT", "UPDATED"],
              [[i.name, f"{i.n_tokens:,}", f"{i.checkpoints:,}", human_bytes(i.disk_bytes),
                Path(i.model_source).name, i.parent or "-", i.updated_at + (" (unfinished)" if i.active_call else "")]
               for i in infos])


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
        click.echo(f"--- {e['role']} (tokens {e['token_start']:,}-{e['token_end']:,})")
        click.echo(e["text"])


@click.command()
@click.argument("session")
@click.argument("new")
@click.option("--at", type=click.IntRange(min=1), help="Keep only the first N tokens [default: all].")
@click.pass_obj
def fork(app, session: str, new: str, at: int | None):
    """Create NEW from SESSION (or its first N tokens), sharing its KV."""
    app.store.fork(session, new, at=at)
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
              help="Archive file to write.")
@click.pass_obj
def export(app, session: str, output: Path):
    """Write a session to one self-describing archive file."""
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
