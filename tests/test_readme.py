"""README.md runs as written. Every fenced code block in it is either run here or listed here with the
reason it is not, and a block that is neither fails the suite: a new block must be classified, so
the README cannot drift from the code unnoticed.

- `blocks(markdown)` extracts the fenced code blocks: language, `##` section, nearest heading, text.
- `RUN` and `NOT_RUN` classify them; `problems(markdown)` says what is unclassified or ambiguous.
- The runs use the real default model (SmolLM2) where `kvstore pull` leaves it, in the user's models
  folder (here the test session's temporary one, holding a link to the GGUF file the tests pulled
  once), a temporary home and a temporary working directory:
  - Library: the Python block as written, after the command in its comment has made its text file;
    the only change is a smaller `max_new_tokens` (asserted to be the one change).
  - Service: against a live `kvstore serve` (tests/serve_kit.py) on a free port, serving the tiny
    random model under the default model's name: the shell block's lines in order, its `kvstore
    serve` line started by the test (its options as written) and the address changed to the
    test server's; the Python block as written, with that address.
  - Using the command, Quick start: the `kvstore` command lines in order, through click's CliRunner;
    generation commands that set no `-n` get `-n 8` appended; the input files the commands read
    are written first; `source .venv/bin/activate` is environment (`ENVIRONMENT`). After each
    command: its exit status and what it did (sessions, tokens, shared KV, archives, checksums).
    Every command has its own check, and every check must meet its command.

Not repeated here (tests/test_docs.py): the CLI reference equals `--help`, the scripts and examples
the README names exist and parse, the headings and contracts are there.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import pytest
from click.testing import CliRunner, Result

import kvstore
from kvstore_cli import reference
from kvstore_cli.main import cli

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text(encoding="utf-8")
sys.path.insert(0, str(ROOT / "examples"))

import stdlib_text  # noqa: E402

SHORT = 8  # tokens a reply may take here (README: 200 in the library example, 256 by default in the CLI)


# -- the blocks ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Block:
    lang: str  # the info string's first word ("" for none)
    section: str  # the `#`/`##` heading above it
    heading: str  # the nearest heading above it, of any level
    text: str
    line: int  # of the opening fence

    def __str__(self) -> str:
        return f"README.md:{self.line}: ```{self.lang} block under {self.heading!r}"


FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})\s*(?P<lang>[^\s`]*)[^`]*$")
HEADING = re.compile(r"^(?P<level>#{1,6})\s+(?P<title>.*?)(?:\s+#+)?\s*$")


def blocks(markdown: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, in order (CommonMark fences: ``` or ~~~, three or
    more, indented at most three spaces; a `#` line inside a block is not a heading)."""
    found: list[Block] = []
    section = heading = ""
    opened = None  # (fence, indent, lang, line, body) while inside a block
    for number, line in enumerate(markdown.splitlines(), 1):
        if opened is None:
            if m := FENCE.match(line):
                opened = (m["fence"], len(m["indent"]), m["lang"], number, [])
            elif h := HEADING.match(line):
                heading = h["title"]
                if len(h["level"]) <= 2:
                    section = heading
            continue
        fence, indent, lang, start, body = opened
        stripped = line.strip()
        if stripped and set(stripped) == {fence[0]} and len(stripped) >= len(fence):
            found.append(Block(lang, section, heading, "".join(f"{b}\n" for b in body), start))
            opened = None
        else:
            body.append(line[min(indent, len(line) - len(line.lstrip(" "))):])
    if opened is not None:
        raise ValueError(f"the code block opened at line {opened[3]} is never closed")
    return found


@dataclass(frozen=True)
class Kind:
    """Blocks of one kind: in `section`, in language `lang`, containing `marker`."""
    section: str
    lang: str
    marker: str
    why: str  # the test that runs it, or why it is not run
    count: Callable[[], int] | None = None  # how many blocks it must match (None: exactly one)

    def matches(self, block: Block) -> bool:
        return (block.section, block.lang) == (self.section, self.lang) and self.marker in block.text


RUN = {
    "library": Kind("Library", "python", "kvstore.open_store(", "test_library_example"),
    "commands": Kind("Using the command", "bash", "kvstore new notes", "test_using_the_command"),
    "quickstart": Kind("Quick start", "bash", "kvstore new quickstart", "test_quick_start_commands"),
    "training": Kind("Training the tiny model", "bash", "python -m kvstore.train", "test_training_the_tiny_model"),
    "service-curl": Kind("Service", "bash", "kvstore serve", "test_service_with_curl"),
    "service-openai": Kind("Service", "python", "import openai", "test_service_with_openai"),
}
NOT_RUN = (
    Kind("Quick start", "bash", "bash scripts/quickstart.sh",
         "the scripts create a virtual environment and install torch and kvstore into it (minutes, and "
         "network): CI and the reviewer run them; tests/test_docs.py checks that they exist and parse, and "
         "the kvstore commands quickstart.sh runs are the next block's, run here"),
    Kind("CLI reference", "text", "Usage: kvstore",
         "generated from `--help`: tests/test_docs.py checks each page against `kvstore ... --help`",
         count=lambda: len(reference.help_pages())),
    Kind("On-disk and archive formats", "", "$KVSTORE_HOME/",
         "a diagram of the files in a home and in the models folder, not code (docs/FORMATS.md specifies them)"),
)


def problems(markdown: str) -> list[str]:
    """What keeps a Markdown text's blocks from being fully classified: a block that no kind (or
    more than one) matches, a kind that matches no block or the wrong number of them."""
    found = blocks(markdown)
    out = []
    kinds = [*RUN.values(), *NOT_RUN]
    for block in found:
        matched = [k for k in kinds if k.matches(block)]
        if not matched:
            out.append(f"{block} is neither run nor listed: run it in tests/test_readme.py, or add it to "
                       f"NOT_RUN with the reason")
        elif len(matched) > 1:
            out.append(f"{block} matches {len(matched)} kinds: make their markers distinct")
    for kind in kinds:
        n, want = sum(kind.matches(b) for b in found), kind.count() if kind.count else 1
        if n != want:
            out.append(f"{kind.lang or 'plain'} blocks under {kind.section!r} containing {kind.marker!r}: "
                       f"{n}, expected {want}")
    return out


def the_block(name: str) -> Block:
    (block,) = [b for b in blocks(README) if RUN[name].matches(b)]
    return block


# -- classification --------------------------------------------------------------------------------
SAMPLE = """# Title

Text with `inline` code.

## First

```bash
echo one
# a comment, not a heading
```

### Sub

~~~python
print("two")
```not a fence end
~~~

  ````
  plain, indented
  ````

## Second
"""


def test_blocks_have_their_language_heading_and_text():
    assert blocks(SAMPLE) == [
        Block("bash", "First", "First", "echo one\n# a comment, not a heading\n", 7),
        Block("python", "First", "Sub", 'print("two")\n```not a fence end\n', 14),
        Block("", "First", "Sub", "plain, indented\n", 19),
    ]
    with pytest.raises(ValueError, match="line 3 is never closed"):
        blocks("# T\n\n```bash\nkvstore list\n")


def test_every_readme_block_is_run_or_listed():
    assert problems(README) == []
    assert all(callable(globals().get(kind.why)) for kind in RUN.values())  # each names its test


@pytest.mark.parametrize("extra,problem", [
    ("\n## Deploying\n\n```bash\nkvstore serve --port 8080\n```\n",  # a new section
     "```bash block under 'Deploying' is neither run nor listed"),
    ("\n## Using the command\n\n```sh\nkvstore verify\n```\n",  # a known section, another language
     "```sh block under 'Using the command' is neither run nor listed"),
    ("\n## Library\n\n```python\nimport kvstore\nkvstore.open_store().gc()\n```\n",  # a second example
     "python blocks under 'Library' containing 'kvstore.open_store(': 2, expected 1"),
])
def test_a_block_neither_run_nor_listed_fails(extra, problem):
    found = problems(README + extra)
    assert len(found) == 1 and problem in found[0], found


def test_a_listed_block_that_is_gone_fails():
    without_diagram, n = re.subn(r"```\n\$KVSTORE_HOME/.*?```\n", "", README, flags=re.S)
    assert n == 1
    assert problems(without_diagram) == ["plain blocks under 'On-disk and archive formats' containing "
                                         "'$KVSTORE_HOME/': 0, expected 1"]


# -- running them ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def user_models(smollm2_path) -> Path:
    """A user's models folder after `kvstore pull`: the test session's own ($KVSTORE_MODELS, see
    conftest.py), holding the default model's file (a link to the one the tests pulled, unless it was
    pulled there) and, once a test has loaded it, its converted weights (shared with the other tests)."""
    folder = Path(os.environ["KVSTORE_MODELS"])
    target = folder / smollm2_path.name
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        target.symlink_to(smollm2_path.resolve())
    return folder


@pytest.fixture
def workdir(tmp_path, monkeypatch, user_models) -> Iterator[Path]:
    """A new user's working directory (temporary; the home is conftest's temporary one). Afterwards
    the cache memory the run left in the process's pool (`kvstore.engine.cache.POOL`) is given back,
    as a new user's process would at exit: later tests in this process must not meet those buffers."""
    from kvstore.engine.cache import POOL

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    yield work
    POOL.clear()


def home() -> Path:
    return Path(os.environ["KVSTORE_HOME"])


def store() -> kvstore.Store:
    return kvstore.open_store()


@pytest.mark.realmodel
def test_library_example(workdir, capsys):
    block = the_block("library")
    code = block.text
    # The text file, made by the command in the block's comment, as the user would (the repository's
    # examples/ beside it, `python` this interpreter).
    command = re.search(r"# e\.g\. `([^`]+)`", code)[1]
    written = re.fullmatch(r"python examples/\S+\.py \d+ > (\S+)", command)[1]
    assert f'open("{written}")' in code
    (workdir / "examples").symlink_to(ROOT / "examples")
    (workdir / "bin").mkdir()  # `python` is this interpreter, with its environment (a link would lose it)
    (workdir / "bin" / "python").write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} \"$@\"\n")
    (workdir / "bin" / "python").chmod(0o755)
    subprocess.run(["bash", "-c", command], cwd=workdir, check=True, timeout=60,
                   env={**os.environ, "PATH": f"{workdir / 'bin'}{os.pathsep}{os.environ['PATH']}"})
    text = (workdir / written).read_text(encoding="utf-8")

    # The one change: replies of SHORT tokens instead of the 200 written (each takes seconds here).
    as_written = int(re.search(r"max_new_tokens=(\d+)", code)[1])
    short = code.replace(f"max_new_tokens={as_written}", f"max_new_tokens={SHORT}")
    assert code.count("max_new_tokens=") == 1 and short != code
    names: dict = {"__name__": "readme"}
    exec(compile(short, f"README.md:{block.line + 1}", "exec"), names)
    out = capsys.readouterr().out

    model, s = names["model"], names["store"]
    assert s.home == home()  # the test's temporary one
    doc = model.tokenizer.encode(text)
    claimed = int(re.search(r"about ([\d,]+) tokens", code)[1].replace(",", ""))
    assert abs(len(doc) - claimed) <= claimed // 10, f"the README says about {claimed:,} tokens; {len(doc):,}"
    assert f"{len(doc)}/{len(doc)}" in out  # the progress reached the end
    assert s.names() == ["stdlib", "stdlib-q0", "stdlib-q1"]
    assert s.tokens("stdlib") == doc
    parent = s.info("stdlib")
    questions = ast.literal_eval(re.search(r"enumerate\((\[.*?\])\)", code)[1])
    assert len(questions) == 2
    for i, question in enumerate(questions):
        name = f"stdlib-q{i}"
        info, (asked, reply) = s.info(name), s.messages(name)
        assert info.parent == "stdlib" and info.fork_position == len(doc)
        assert s.tokens(name)[:len(doc)] == doc
        assert info.disk_bytes < parent.disk_bytes / 10  # the document's KV is shared, not copied
        assert (asked.role, asked.text, reply.role) == ("user", question, "assistant")
        assert reply.text.strip() and reply.text in out
        assert 0 < reply.token_end - reply.token_start <= SHORT
        # as written, with the longest reply, the session still fits in the model's context
        assert reply.token_start + as_written <= model.config.max_context


ENVIRONMENT = {
    "source .venv/bin/activate": "puts the virtual environment's `kvstore` first on PATH; here the command "
                                 "runs in this interpreter, which has kvstore installed",
}


def run_block(block: Block, checks: dict[str, Callable[[Result], None]]) -> tuple[list[str], list[str]]:
    """Run a bash block's command lines in order, each `kvstore` command followed by its check (keyed
    by the command as written, without its comment). Returns the commands as they ran (with any
    `-n` appended) and the lines skipped as environment."""
    ran, skipped, unchecked = [], [], dict(checks)
    for line in block.text.splitlines():
        words = shlex.split(line, comments=True)
        if not words:
            continue
        if " ".join(words) in ENVIRONMENT:
            skipped.append(" ".join(words))
            continue
        assert not {"|", "||", ";", "&", ">", ">>", "<"} & set(words), f"{block}: {line!r}: only `&&` is supported"
        commands = [[]]
        for word in words:
            if word == "&&":
                commands.append([])
            else:
                commands[-1].append(word)
        for command in commands:
            written = " ".join(command)
            assert command[0] == "kvstore", (f"{block}: {written!r} is not a kvstore command: run it here, or "
                                             f"list it in ENVIRONMENT with the reason")
            assert written in unchecked, f"{block}: no check for {written!r} (add one; the README changed?)"
            args = command[1:]
            if args[0] in ("new", "continue") and not {"-n", "--max-new-tokens"} & set(args):
                args += ["-n", str(SHORT)]
            result = CliRunner().invoke(cli, args, prog_name="kvstore")
            shown = (f"kvstore {shlex.join(args)} -> {result.exit_code}\n"
                     f"stdout: {result.stdout}\nstderr: {result.stderr}")
            if result.exc_info and not isinstance(result.exception, SystemExit):
                shown += "\n" + "".join(traceback.format_exception(*result.exc_info))
            assert result.exit_code == 0, shown
            unchecked.pop(written)(result)
            ran.append(f"kvstore {shlex.join(args)}")
    assert not unchecked, f"{block}: checks for commands it no longer has: {list(unchecked)}"
    return ran, skipped


def turns(name: str) -> list[tuple[str, str]]:
    return [(m.role, m.text) for m in store().messages(name)]


@pytest.fixture(scope="module")
def tokens_of(user_models) -> Callable[[Path], list[int]]:
    """The default model's token ids of a text file (its tokenizer, loaded once)."""
    tokenizer = kvstore.load_tokenizer("smollm2")
    return lambda path: tokenizer.encode(path.read_text(encoding="utf-8"))


@pytest.mark.realmodel
def test_using_the_command(workdir, user_models, smollm2_path, tokens_of):
    report = workdir / "report.txt"
    report.write_text(stdlib_text.document(2_000), encoding="utf-8")  # about 540 tokens
    doc = tokens_of(report)
    seen: dict[str, list[int]] = {}

    def pull(r: Result):
        path = Path(r.stdout.strip())  # the model's file, found where the user pulled it: no download
        assert path == user_models / smollm2_path.name and path.resolve() == smollm2_path.resolve()

    def new_notes(r: Result):
        ((user, asked), (assistant, reply)) = turns("notes")
        assert (user, asked, assistant) == ("user", "Give me three names for a cat.", "assistant")
        assert reply.strip() and r.stdout in (reply, reply + "\n")  # the reply streamed
        seen["notes"] = store().tokens("notes")

    def continue_notes(r: Result):
        assert [t for t, _ in turns("notes")] == ["user", "assistant", "user", "assistant"]
        assert turns("notes")[2] == ("user", "Shorter ones, please.") and turns("notes")[3][1].strip()
        assert store().tokens("notes")[:len(seen["notes"])] == seen["notes"]  # on top of the saved turn

    def history_notes(r: Result):
        for _, text in turns("notes"):
            assert text.strip() in r.stdout

    def new_report(r: Result):
        assert store().tokens("report") == doc and turns("report") == []  # read, nothing generated

    def fork(r: Result):
        info = store().info("report-risks")
        assert info.parent == "report" and store().tokens("report-risks") == store().tokens("report")
        assert info.disk_bytes < 64 << 10  # kilobytes: the fork refers to the document's KV

    def continue_risks(r: Result):
        assert turns("report-risks")[0] == ("user", "What are the main risks?") and turns("report-risks")[1][1].strip()
        assert store().tokens("report-risks")[:len(doc)] == doc
        assert store().tokens("report") == doc  # the document is unchanged

    def listing(r: Result):
        for name in ("notes", "report", "report-risks"):
            assert name in r.stdout

    def export(r: Result):
        assert (workdir / "report.kvs").stat().st_size > 0

    def import_(r: Result):
        assert store().tokens("report-copy") == store().tokens("report")
        assert store().info("report-copy").parent is None  # a session of its own

    def pack(r: Result):
        info = store().info("report")
        assert list((home() / "blobs").glob("*.kvz"))
        assert not list((home() / "sessions" / info.id).glob("layer-*.kv"))  # the raw files are freed
        assert store().tokens("report") == doc

    def verify(r: Result):
        assert sorted(r.stdout.splitlines()) == sorted(f"{n}: ok" for n in store().names())
        assert store().names() == ["notes", "report", "report-copy", "report-risks"]

    ran, skipped = run_block(the_block("commands"), {
        "kvstore pull": pull,
        "kvstore new notes --prompt Give me three names for a cat.": new_notes,
        "kvstore continue notes --prompt Shorter ones, please.": continue_notes,
        "kvstore history notes": history_notes,
        "kvstore new report --raw --file report.txt --max-new-tokens 0": new_report,
        "kvstore fork report report-risks": fork,
        "kvstore continue report-risks --prompt What are the main risks?": continue_risks,
        "kvstore list": listing,
        "kvstore export report -o report.kvs": export,
        "kvstore import report.kvs --as report-copy": import_,
        "kvstore pack report": pack,
        "kvstore verify": verify,
    })
    assert skipped == ["source .venv/bin/activate"]
    assert [c for c in ran if c.endswith(" -n 8")] == [  # the one change: shorter replies
        "kvstore new notes --prompt 'Give me three names for a cat.' -n 8",
        "kvstore continue notes --prompt 'Shorter ones, please.' -n 8",
        "kvstore continue report-risks --prompt 'What are the main risks?' -n 8"]


@pytest.mark.realmodel
def test_quick_start_commands(workdir, tokens_of):
    """The commands scripts/quickstart.sh runs and the README shows; its text here is shorter (the
    script's is about 2,300 tokens; CI runs the script)."""
    text = workdir / "stdlib.txt"
    text.write_text(stdlib_text.document(1_000), encoding="utf-8")  # about 380 tokens
    doc = tokens_of(text)
    # quickstart.sh reads its timings from these --verbose lines on stderr
    prefill = re.compile(r"prefill: ([0-9,]+) tokens.* in ([0-9.]+) s")
    restore = re.compile(r"restore: .* in ([0-9.]+) s")
    seen: dict[str, list[int]] = {}

    def new(r: Result):
        assert int(prefill.search(r.stderr)[1].replace(",", "")) == len(doc)
        tokens = seen["new"] = store().tokens("quickstart")
        assert tokens[:len(doc)] == doc and 0 < len(tokens) - len(doc) <= 24

    def continue_(r: Result):
        assert restore.search(r.stderr), r.stderr
        tokens = store().tokens("quickstart")
        assert tokens[:len(seen["new"])] == seen["new"] and 0 < len(tokens) - len(seen["new"]) <= 24

    ran, skipped = run_block(the_block("quickstart"), {
        "kvstore new quickstart --raw --file stdlib.txt --max-new-tokens 24 --verbose": new,
        "kvstore continue quickstart --max-new-tokens 24 --verbose": continue_,
    })
    assert len(ran) == 2 and skipped == []  # as written: their -n is already small


# The README trains the default size (about half a minute here); the test trains the tests' shape for
# a few steps: what it checks is that each command runs as written and what it writes loads and runs.
TRAIN_HERE = ["--layers", "2", "--context", "128", "--vocab-size", "400", "--ffn-size", "128", "--steps", "40", "-q"]


def test_training_the_tiny_model(workdir):
    """The three lines as written, in order: train (here smaller and shorter), a session on the
    folder through the `kvstore` command, and the example on it (which checks its own resume)."""
    lines = [shlex.split(line, comments=True) for line in the_block("training").text.splitlines()]
    lines = [words for words in lines if words]
    assert [" ".join(w) for w in lines] == ["python -m kvstore.train --out tiny-model",
                                            "kvstore new demo --model tiny-model --prompt heapq.merge",
                                            "python examples/tiny_model.py --model tiny-model"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run([sys.executable, *lines[0][1:], *TRAIN_HERE], cwd=workdir, check=True, timeout=300, env=env)
    assert kvstore.load_model(workdir / "tiny-model").config.n_layers == 2

    result = CliRunner().invoke(cli, [*lines[1][1:], "-n", str(SHORT)], prog_name="kvstore")
    assert result.exit_code == 0, result.output
    ((user, asked), (assistant, reply)) = turns("demo")
    assert (user, asked, assistant) == ("user", "heapq.merge", "assistant") and result.stdout.strip() == reply.strip()

    done = subprocess.run([sys.executable, str(ROOT / lines[2][1]), *lines[2][2:]], cwd=workdir, timeout=300,
                          env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "identical to the uninterrupted reply" in done.stdout


# -- the service -------------------------------------------------------------------------------------
README_URL = "http://127.0.0.1:8000"


@pytest.fixture(scope="module")
def service_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("service")


@pytest.fixture(scope="module")
def service(service_dir, tiny):
    """The Service section's shell block up to its `kvstore serve` line, run; then that server, live:
    the tiny model named as the default one, the block's options as written."""
    from serve_kit import LiveServer

    lines = [line for line in the_block("service-curl").text.splitlines() if line.strip()]
    (at,) = [i for i, line in enumerate(lines) if line.startswith("kvstore serve")]
    before = "\n".join(lines[:at])
    subprocess.run(["bash", "-euc", before], cwd=service_dir, check=True, timeout=30)
    args = shlex.split(lines[at], comments=True)[2:]
    assert "--port" not in args and README_URL.endswith(":8000")  # the default port: the test uses a free one
    options = [str(service_dir / a) if (service_dir / a).exists() else a for a in args]
    with LiveServer(service_dir / "home", tiny("llama-gqa").folder, *options, "--chunk-size", "16", "--threads", "1",
                    name=kvstore.DEFAULT_MODEL) as live:
        yield live, "\n".join(lines[at + 1:]).replace(README_URL, live.url)


def json_values(text: str) -> list:
    """The JSON values printed one after another (curl -s prints no newline)."""
    import json

    decoder, out, i = json.JSONDecoder(), [], 0
    while i < len(text):
        if text[i].isspace():
            i += 1
            continue
        value, i = decoder.raw_decode(text, i)
        out.append(value)
    return out


def test_service_with_curl(service, service_dir):
    if shutil.which("curl") is None:
        pytest.skip("curl is not installed")
    live, after = service
    done = subprocess.run(["bash", "-euc", after], cwd=service_dir, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    health, reply, session = json_values(done.stdout)
    assert health["status"] == "ok"
    assert reply["object"] == "chat.completion" and reply["model"] == kvstore.DEFAULT_MODEL
    assert reply["choices"][0]["message"]["content"] and reply["kvstore"]["session"] == "notes"
    assert 0 < reply["usage"]["completion_tokens"] <= 64
    assert session["name"] == "notes" and session["n_tokens"] == reply["usage"]["total_tokens"]


def test_service_with_openai(service, capsys):
    live, _ = service
    block = the_block("service-openai")
    assert block.text.count(README_URL) == 1
    exec(compile(block.text.replace(README_URL, live.url), f"README.md:{block.line + 1}", "exec"), {})
    out = capsys.readouterr().out
    cached = int(re.search(r"\n(\d+) prompt tokens came from the store", out)[1])
    key = re.search(r'api_key="([^"]+)"', block.text)[1]
    with live.http(key) as http:
        stored = http.get("/v1/sessions/cats/messages").json()["data"]
    assert [m["role"] for m in stored] == ["user", "assistant", "user", "assistant"]
    assert stored[2]["content"] == "Shorter ones, please." and stored[3]["content"] in out
    assert cached >= stored[1]["token_end"] - 1  # the second turn's prompt came from the stored first turn
