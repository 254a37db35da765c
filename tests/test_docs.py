"""The docs agree with the code: every command has help, the README's CLI reference is `--help`
verbatim, the README's library example runs, and the scripts it names exist."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvstore_cli import reference
from kvstore_cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")


def commands() -> list[tuple[str, click.Command]]:
    ctx = click.Context(cli, info_name="kvstore")
    return [(name, cli.get_command(ctx, name)) for name in cli.list_commands(ctx)]


@pytest.mark.parametrize("name,command", commands())
def test_every_command_and_option_has_help(name, command):
    assert command.help and command.help.strip(), f"`kvstore {name}` has no docstring"
    first = command.help.strip().splitlines()[0]
    assert len(first) <= 66, f"`kvstore {name}`: the first docstring line is cut in `kvstore --help`: {first!r}"
    for param in command.params:
        if isinstance(param, click.Option):
            assert param.help, f"`kvstore {name}` option {param.opts} has no help text"


def test_the_issue_commands_exist():
    names = {n for n, _ in commands()}
    assert names >= {"pull", "new", "continue", "list", "show", "history", "fork", "rm", "export", "import", "pack",
                     "verify", "gc"}


def test_readme_cli_reference_is_generated_from_help():
    assert reference.section(README) == reference.render(), (
        "README.md's CLI reference is out of date: run `python -m kvstore_cli.reference README.md`")


@pytest.mark.parametrize("line,text", reference.help_pages())
def test_readme_cli_reference_matches_help_output(line, text):
    args = line.split()[1:] + ["--help"]
    result = CliRunner().invoke(cli, args, prog_name="kvstore", terminal_width=reference.WIDTH)
    assert result.exit_code == 0
    assert f"```text\n{result.stdout.rstrip()}\n```" in README, f"`{line} --help` differs from the README"


def test_readme_names_real_files_and_sections():
    for path in re.findall(r"`((?:scripts|examples)/[\w./-]+)`", README):
        assert (ROOT / path).exists(), path
    for heading in ("## Quick start", "## Library", "## Guarantees", "## On-disk and archive formats",
                    "## Benchmarks", "## CLI reference"):
        assert heading in README
    for contract in range(1, 9):
        assert f"**C{contract}," in README
    assert "bash scripts/quickstart.sh" in README and "bash scripts/test.sh" in README


def test_scripts_parse():
    for script in ("scripts/quickstart.sh", "examples/crash_recover.sh"):
        subprocess.run(["bash", "-n", str(ROOT / script)], check=True)


def test_readme_library_example_runs(tiny, tmp_path, monkeypatch):
    """The README's Python example, with the tiny model and a short text in place of SmolLM2's."""
    block = re.search(r"## Library\n\n```python\n(.*?)```", README, re.S).group(1)
    folder = str(tiny("llama-gqa").folder)
    code = block.replace('"smollm2"', repr(folder)).replace("max_new_tokens=200", "max_new_tokens=8")
    assert code != block
    monkeypatch.chdir(tmp_path)
    (tmp_path / "stdlib.txt").write_text("heapq\n-----\nHeap queue algorithm (a.k.a. priority queue).\n")
    exec(compile(code, "README.md", "exec"), {"__name__": "readme"})
    import kvstore

    store = kvstore.open_store()
    assert store.names() == ["stdlib", "stdlib-q0", "stdlib-q1"]
    assert all(len(store.messages(f"stdlib-q{i}")) == 2 for i in range(2))
