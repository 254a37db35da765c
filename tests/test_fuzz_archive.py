"""Contract C8 under fuzzing: imports of mutated, forged and hostile archives (hypothesis) either
refuse with a kvstore error, leaving the store as it was, or import a session that verifies and
opens; never another exception, never a write outside the home. The format has no paths: a
manifest naming paths or symlink-like entries is refused. Hostile names and metadata (chat text,
a system prompt with SQL, NUL or megabytes) are stored verbatim and never reach a path or the SQL
text sent to the index."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy import delete as sql_delete
from sqlalchemy import event

import kvstore
from kvstore.store.archive import HEADER, MAGIC, VERSION
from kvstore.errors import KvstoreError
from kvstore.store.index import ModelRow

FUZZ = settings(max_examples=40, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
FUZZ_MORE = settings(max_examples=1500, deadline=None, suppress_health_check=list(HealthCheck))
SQL = "x'); DROP TABLE sessions; --"
HOSTILE_TEXT = [SQL, "nul\0byte", "\u202e\u200b\ufeff", "🙂" * 1000, "a" * (1 << 20), "\\x00%s%n{0}", "\r\n\t"]
PATHS = ["../../escape", "/etc/passwd", "..", "a/../../b", "link -> /etc", "C:\\Windows", "~/x", "sessions/../x"]


@pytest.fixture(scope="module")
def archive(tmp_path_factory, model) -> bytes:
    root = tmp_path_factory.mktemp("archive")
    store = kvstore.open_store(root / "home")
    with store.new("s", model, seed=3, system="Be brief.", chunk_size=4) as s:
        list(s.chat("Hi there.", max_new_tokens=5))
    store.export("s", root / "s.kvs")
    store.close()
    return (root / "s.kvs").read_bytes()


class Importer:
    """One store for many imports; checks the invariants of each and tidies up after it."""

    def __init__(self, root: Path, model):
        self.root, self.model = root, model
        self.store = kvstore.open_store(root / "home")
        self.outside = self.snapshot()
        self.counts = {"refused": 0, "imported": 0}

    def snapshot(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*")
                      if not str(p.relative_to(self.root)).startswith("home"))

    def __call__(self, data: bytes) -> str:
        path = self.root / "in.kvs"
        path.write_bytes(data)
        try:
            name = self.store.import_(path)
        except KvstoreError:
            self.counts["refused"] += 1
            assert self.store.names() == [], "a refused import committed a session"
            assert list(self.store.sessions_dir.iterdir()) == [], "a refused import left files"
            return "refused"
        finally:
            path.unlink()
            assert self.snapshot() == self.outside, "the import wrote outside the home"
        self.counts["imported"] += 1
        assert self.store.verify() == {name: []}
        try:
            self.store.open(name, self.model).close()
        except KvstoreError:
            pass  # e.g. another model's fingerprint: refused at open, precisely
        self.store.delete(name)
        assert list(self.store.sessions_dir.iterdir()) == []
        self.forget_models()
        return "imported"

    def forget_models(self) -> None:
        """Each example starts from a store that knows no model (a forged one may have been recorded)."""
        with self.store.db() as db, db.begin():
            db.execute(sql_delete(ModelRow))


@pytest.fixture(scope="module")
def importer(tmp_path_factory, model):
    return Importer(tmp_path_factory.mktemp("fuzz"), model)


def split(data: bytes) -> tuple[dict, bytes]:
    length = HEADER.unpack(data[:HEADER.size])[3]
    return json.loads(data[HEADER.size:HEADER.size + length]), data[HEADER.size + length:]


def join(manifest, payload: bytes, *, version: int | None = None, flags: int = 0) -> bytes:
    """An archive of `manifest` and `payload`; the header's version is the manifest's unless given (a
    mismatch is refused by itself, which would hide what a test forges)."""
    if version is None:
        version = manifest.get("version", VERSION) if isinstance(manifest, dict) else VERSION
        version = version if isinstance(version, int) and not isinstance(version, bool) and 0 <= version < 2 ** 32 \
            else VERSION
    body = json.dumps(manifest).encode()  # ensure_ascii: lone surrogates travel as \ud800 escapes
    return HEADER.pack(MAGIC, version, flags, len(body), xxhash.xxh3_64_intdigest(body)) + body + payload


# -- byte-level mutations ------------------------------------------------------------------------------
mutation = st.tuples(st.sampled_from(["flip", "set", "insert", "delete", "cut", "append"]),
                     st.integers(0, 1 << 20), st.binary(min_size=1, max_size=16))


def mutate(data: bytes, edits) -> bytes:
    out = bytearray(data)
    for kind, where, blob in edits:
        i = where % (len(out) + 1)
        if kind == "flip" and i < len(out):
            out[i] ^= blob[0] or 1
        elif kind == "set":
            out[i:i + len(blob)] = blob
        elif kind == "insert":
            out[i:i] = blob
        elif kind == "delete":
            del out[i:i + len(blob)]
        elif kind == "cut":
            del out[i:]
        else:
            out += blob
    return bytes(out)


@FUZZ
@given(edits=st.lists(mutation, min_size=1, max_size=4))
def test_byte_mutations(importer, archive, edits):
    importer(mutate(archive, edits))


@pytest.mark.slow
@FUZZ_MORE
@given(edits=st.lists(mutation, min_size=1, max_size=6))
def test_byte_mutations_many(importer, archive, edits):
    importer(mutate(archive, edits))


# -- structured, re-signed manifests ---------------------------------------------------------------------
hostile_value = st.one_of(
    st.none(), st.booleans(), st.integers(-(1 << 70), 1 << 70), st.sampled_from([0, -1, 1, 2, 1 << 31, 1 << 62, 1 << 63]),
    st.floats(allow_nan=True), st.text(max_size=20), st.sampled_from(PATHS + HOSTILE_TEXT[:4] + ["\ud800", "bfloat16"]),
    st.lists(st.integers(-2, 1 << 17), max_size=4), st.dictionaries(st.sampled_from(["path", "symlink", "a"]),
                                                                    st.sampled_from(PATHS), max_size=2))


def nodes(value, path=()):
    """Every (path, value) in a JSON tree."""
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from nodes(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:8]):
            yield from nodes(v, (*path, i))


def replace(tree, path, value):
    if not path:
        return value
    parent = tree
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = value
    return tree


@st.composite
def forged(draw, archive: bytes):
    manifest, payload = split(archive)
    for _ in range(draw(st.integers(1, 3))):
        paths = [p for p, _ in nodes(manifest)]
        where = draw(st.sampled_from(paths))
        action = draw(st.sampled_from(["replace", "replace", "add-key", "drop-key"]))
        target = manifest
        for key in where:
            target = target[key]
        if action == "add-key" and isinstance(target, dict):
            target[draw(st.sampled_from(["path", "symlink", "file", "extra"]))] = draw(hostile_value)
        elif action == "drop-key" and isinstance(target, dict) and target:
            target.pop(draw(st.sampled_from(sorted(target))))
        else:
            manifest = replace(manifest, where, draw(hostile_value))
    return join(manifest, payload)


def test_structured_forgeries(importer, archive):
    @FUZZ
    @given(data=forged(archive))
    def run(data):
        importer(data)
    run()


@pytest.mark.slow
def test_structured_forgeries_many(importer, archive):
    @FUZZ_MORE
    @given(data=forged(archive))
    def run(data):
        importer(data)
    run()


# -- forged sizes and bombs ------------------------------------------------------------------------------
def consistent_layout(manifest, n_kv: int, head_dim: int) -> None:
    """Forge the KV layout, the model config and token_bytes so that they agree with each other."""
    manifest["session"]["kv_layout"]["per_token"] = [2, n_kv, head_dim]
    manifest["model"]["config"].update(n_kv_heads=n_kv, head_dim=head_dim)
    manifest["token_bytes"] = 2 * n_kv * head_dim * 2
    for extent in manifest["extents"]:
        for frame in extent["frames"]:
            frame["raw_size"] = extent["n_tokens"] * manifest["token_bytes"]


@pytest.mark.parametrize("n_kv,head_dim", [(65536, 65536), (4096, 65536), (1, 1 << 16)])
@pytest.mark.parametrize("declared", [True, False], ids=["size-in-header", "no-size"])
def test_forged_huge_extents_are_refused_without_allocating(importer, archive, n_kv, head_dim, declared):
    manifest, payload = split(archive)
    consistent_layout(manifest, n_kv, head_dim)
    raw = manifest["extents"][0]["frames"][0]["raw_size"]
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * 64)
    if declared:  # a frame header that claims the forged size
        frame = frame[:4] + bytes([frame[4] | 0xC0]) + frame[5:]
    manifest["extents"][0]["frames"][0].update(offset=len(payload), size=len(frame))
    manifest["data_size"] = len(payload) + len(frame)
    assert raw >= 1 << 30 or n_kv == 1
    assert importer(join(manifest, payload + frame)) == "refused"


@pytest.mark.parametrize("bomb", ["zeros-declared", "zeros-undeclared", "two-frames", "skippable"])
def test_decompression_bombs_are_refused(importer, archive, bomb):
    manifest, payload = split(archive)
    fr = manifest["extents"][0]["frames"][0]
    big = b"\0" * (fr["raw_size"] * 64)
    if bomb == "zeros-declared":
        frame = zstandard.ZstdCompressor().compress(big)
    elif bomb == "zeros-undeclared":
        frame = zstandard.ZstdCompressor(write_content_size=False).compress(big)
    elif bomb == "two-frames":
        one = zstandard.ZstdCompressor().compress(b"\0" * fr["raw_size"])
        frame = one + one
    else:
        frame = b"\x50\x2a\x4d\x18" + (16).to_bytes(4, "little") + b"\0" * 16
    fr.update(offset=len(payload), size=len(frame))
    manifest["data_size"] = len(payload) + len(frame)
    assert importer(join(manifest, payload + frame)) == "refused"


@pytest.mark.parametrize("length", [1 << 63, (1 << 32) + 5, 300 << 20])
def test_a_forged_manifest_length_is_refused(importer, archive, length):
    head = HEADER.unpack(archive[:HEADER.size])
    assert importer(HEADER.pack(MAGIC, head[1], head[2], length, head[4]) + archive[HEADER.size:]) == "refused"


# -- paths inside archives ----------------------------------------------------------------------------------
@pytest.mark.parametrize("where", ["top", "session", "model", "extent", "frame"])
@pytest.mark.parametrize("key", ["path", "symlink", "file"])
def test_a_manifest_naming_a_path_or_link_is_refused(importer, archive, where, key):
    manifest, payload = split(archive)
    target = {"top": manifest, "session": manifest["session"], "model": manifest["model"],
              "extent": manifest["extents"][0], "frame": manifest["extents"][0]["frames"][0]}[where]
    target[key] = "../../outside" if key != "symlink" else {"from": "x", "to": "/etc"}
    assert importer(join(manifest, payload)) == "refused"


@pytest.mark.parametrize("name", PATHS)
def test_a_session_name_that_is_a_path_is_refused(importer, archive, name):
    manifest, payload = split(archive)
    manifest["session"]["name"] = name
    assert importer(join(manifest, payload)) == "refused"


# -- hostile metadata, stored verbatim --------------------------------------------------------------------------
@pytest.fixture
def sql_log(tmp_path):
    """The SQL text of every statement sent to the index (parameters excluded)."""
    statements: list[str] = []
    store = kvstore.open_store(tmp_path / "home")
    event.listen(store.engine, "before_cursor_execute", lambda conn, cursor, sql, *a: statements.append(sql))
    return store, statements


@pytest.mark.parametrize("text", HOSTILE_TEXT, ids=["sql", "nul", "bidi", "emoji", "megabyte", "format", "crlf"])
def test_hostile_metadata_is_stored_verbatim_and_never_reaches_sql_or_a_path(sql_log, model, tmp_path, text):
    store, statements = sql_log
    name = "q3:report@draft+v1.final"
    with store.new(name, model, seed=2, system=text) as s:
        if len(text) < 100:  # a long system prompt would not fit the tiny model's context
            list(s.chat(text, max_new_tokens=2))
    assert [m.text for m in store.messages(name)][:2] == [text, text][:1 + (len(text) < 100)]
    store.export(name, tmp_path / "a.kvs")
    other = kvstore.open_store(tmp_path / "other")
    assert other.import_(tmp_path / "a.kvs", name="copy") == "copy"
    assert [m.text for m in other.messages("copy")] == [m.text for m in store.messages(name)]
    needles = [text[:40], name] if len(text) > 3 else [text]
    assert not [sql for sql in statements if any(n in sql for n in needles)], "a value reached the SQL text"
    for home in (store.home, other.home):
        assert all(len(p.name) == 32 for p in (home / "sessions").iterdir())  # server-made ids only
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.kvs", "home", "other"]


@FUZZ
@given(text=st.text(max_size=300), role=st.sampled_from(["user", "assistant", "system", SQL[:32], "../x"]))
def test_hostile_message_text_in_an_archive_round_trips(importer, archive, text, role):
    manifest, payload = split(archive)
    manifest["messages"][-1]["text"], manifest["messages"][-1]["role"] = text, role
    data = join(manifest, payload)
    path = importer.root / "msg.kvs"
    path.write_bytes(data)
    try:
        name = importer.store.import_(path)
        assert [(m.role, m.text) for m in importer.store.messages(name)][-1] == (role, text)
        importer.store.delete(name)
        importer.forget_models()
    finally:
        path.unlink()


def test_lone_surrogates_in_an_archive_are_refused_not_a_crash(importer, archive):
    manifest, payload = split(archive)
    manifest["messages"][-1]["text"] = "half \ud800 a pair"
    assert importer(join(manifest, payload)) == "refused"


def test_no_fuzz_example_wrote_outside_the_home(importer):
    assert importer.snapshot() == importer.outside
    assert os.listdir(importer.store.sessions_dir) == []


@pytest.mark.parametrize("body", [b"[" * 100_000 + b"]" * 100_000, b'{"a":' * 50_000 + b"1" + b"}" * 50_000],
                         ids=["deep-list", "deep-object"])
def test_a_deeply_nested_manifest_is_refused_not_a_crash(importer, body):
    assert importer(HEADER.pack(MAGIC, 1, 0, len(body), xxhash.xxh3_64_intdigest(body)) + body) == "refused"


FORGED_CALLS = [
    {"kind": "chat", "start": 3, "max_new_tokens": 5, "stop": [], "message": 99},
    {"kind": "raw", "start": -50, "max_new_tokens": "x", "stop": [1, 2]},
    {"kind": "chat", "start": 0, "max_new_tokens": 5, "stop": []},
    {"kind": "shell", "start": 0, "max_new_tokens": 5, "stop": []},
    {"kind": "raw", "start": 10 ** 9, "max_new_tokens": 5, "stop": [], "stop_at_eos": "no"},
    {"kind": "chat", "start": 0, "max_new_tokens": 5, "stop": [], "message": 0},  # the system message
]
FORGED_SAMPLERS = [{"temperature": "hot"}, {"top_k": -3}, {"bogus": 1}, {"top_p": float("nan")}]


@pytest.mark.parametrize("call", FORGED_CALLS, ids=range(len(FORGED_CALLS)))
def test_a_forged_call_in_progress_is_refused_or_resumes(importer, archive, model, call):
    manifest, payload = split(archive)
    manifest["session"]["active_call"] = call
    if importer(join(manifest, payload)) == "imported":  # then resuming it must work
        path = importer.root / "call.kvs"
        path.write_bytes(join(manifest, payload))
        name = importer.store.import_(path)
        path.unlink()
        with importer.store.open(name, model) as s:
            list(s.resume())
        importer.store.delete(name)
        importer.forget_models()


@pytest.mark.parametrize("sampler", FORGED_SAMPLERS, ids=range(len(FORGED_SAMPLERS)))
def test_forged_sampler_settings_are_refused(importer, archive, sampler):
    manifest, payload = split(archive)
    manifest["session"]["sampler"].update(sampler)
    assert importer(join(manifest, payload)) == "refused"
