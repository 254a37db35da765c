"""The docs agree with the code: every command has help, the README's CLI reference is `--help`
verbatim, the scripts and examples it names exist, its code map names every module. (Its code
blocks run in tests/test_readme.py.)"""

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


# How the README's code map (section "Development") names a module of each folder.
CODE_MAP = {
    "kvstore": lambda p: {p.stem, f"kvstore/{p.name}"},
    "kvstore/engine": lambda p: {p.stem},
    "kvstore/engine/models": lambda p: {f"models/{p.name}"},
    "kvstore/engine/native": lambda p: {"native/"},
    "kvstore/store": lambda p: {p.stem},
    "kvstore/train": lambda p: {p.stem},
    "cli": lambda p: {p.stem},
}
NOT_IN_CODE_MAP = {"kvstore/engine/__init__.py", "kvstore/engine/models/__init__.py", "kvstore/store/__init__.py",
                   "kvstore/train/__init__.py",
                   "cli/__init__.py", "cli/__main__.py"}


def code_map(readme: str) -> str:
    start = readme.index("- The code, in layers")
    return readme[start:readme.index("\n- ", start)]


def test_readme_code_map_names_every_module_and_only_real_ones():
    text = code_map(README)
    named = set(re.findall(r"`([^`\s]+)`", text))
    packages = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "kvstore").rglob("__init__.py")}
    assert packages <= set(CODE_MAP), f"packages CODE_MAP does not cover: {sorted(packages - set(CODE_MAP))}"
    for folder, spellings in CODE_MAP.items():
        for path in sorted((ROOT / folder).glob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in NOT_IN_CODE_MAP:
                assert spellings(path) & named, f"README's code map (Development) does not name {rel}"
    for folder in ("kvstore/engine", "kvstore/store", "kvstore/train"):  # their bullets list modules only
        bullet = re.search(rf"- `{folder}/`[^:]*:(.*?)(?:\n  - |\Z)", text, re.S)[1]
        for name in re.findall(r"`([^`\s]+)`", bullet):
            assert (ROOT / folder / name).is_dir() or (ROOT / folder / f"{name}.py").is_file() \
                or (ROOT / folder / name).is_file(), f"README's code map names {folder}/{name}, which does not exist"
