"""The torture kit shared by the fault tests (it holds no tests itself): a tiny reference run,
a template store per verb, the verbs, the invariants every crash must leave true (`check`), and
the trials that run a verb under a fault: in process under `faults.FaultyIO` (power loss, process
death then power loss) or in a child that SIGKILLs itself before a chosen file operation. Also the
kill oracle and the two racing writers.

Verbs: checkpoint, create (a new session's prefill), fork, pack, export, import, gc, delete and
open (recovery after a writer died with uncommitted bytes).
"""

from __future__ import annotations

import multiprocessing
import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from sqlalchemy import delete as sql_delete
from sqlalchemy import select

import kvstore
import store_harness as H
from faults import Crash, FaultyIO
from kvstore import fileio
from kvstore.store import segments
from kvstore.errors import KvstoreError, SessionBusy
from kvstore.store.extents import session_extents
from kvstore.store.index import BlobRow, SegmentRow, SessionRow
from kvstore.store.locking import SessionLock

# -- scenarios: a store in a known state, one verb run on it, and what must hold afterwards ----------
SETTINGS = dict(seed=5, chunk_size=16, checkpoint_every=4, temperature=0.9, top_k=40, top_p=0.95)
DOCUMENT = ("The store keeps every layer's keys and values on disk; a session resumes where it stopped. "
            "Nothing acknowledged is lost.")
N_GEN, N_MORE, N_TOTAL = 8, 4, 24  # tokens generated in the template, by a verb, by the reference
VERBS = ("checkpoint", "create", "fork", "pack", "export", "import", "gc", "delete", "open")


class Lost(AssertionError):
    """An acknowledged state is gone (a checkpoint, a session, an archive)."""


class Corrupt(AssertionError):
    """The store does not verify, a load fails, or loads other bytes than were committed."""


@dataclass
class Reference:
    tokens: list[int]
    kv: list  # per layer, the cache rows [len(tokens) - 1, 2, n_kv_heads, head_dim] as uint8
    lines: dict[int, dict]  # trace lines by position


def make_reference(tmp: Path, model) -> Reference:
    store = kvstore.open_store(tmp / "reference-home")
    with store.new("ref", model, **SETTINGS) as s:
        s.append_text(DOCUMENT)
        list(s.generate(N_TOTAL, trace=tmp / "reference.jsonl", stop_at_eos=False))
        kv = [t.clone().view(-1).view(torch.uint8) for t in s.seq.cache.state()]
        tokens = list(s.tokens)
    store.close()
    return Reference(tokens, kv, H.by_position(H.read_trace(tmp / "reference.jsonl")))


def build_template(root: Path, model, verb: str) -> dict[str, int]:
    """The store a verb starts from, in root/home (plus root/s.kvs); returns each session's tokens."""


    store = kvstore.open_store(root / "home")
    with store.new("s", model, **SETTINGS) as s:
        s.append_text(DOCUMENT)
        list(s.generate(N_GEN, stop_at_eos=False))
    if verb == "pack":
        store.fork("s", "f", at=40)  # shares extents with 's', the last one in part
    if verb in ("gc", "delete"):
        store.fork("s", "f")
        with store.open("f", model) as f:  # continues the same stream in its own files
            list(f.generate(6, stop_at_eos=False))
    if verb == "gc":  # garbage: a deleted session's rows, files and blobs, a stray folder, a stale temp
        with store.new("d", model, **{**SETTINGS, "seed": 9}) as d:
            d.append_text(DOCUMENT[:40])
        store.pack("d")
        with store.db() as db, db.begin():
            db.execute(sql_delete(SessionRow).where(SessionRow.name == "d"))
        stray = store.sessions_dir / ("0" * 32)
        stray.mkdir()
        (stray / "layer-000.kv").write_bytes(b"\0" * 4096)
        (store.blobs_dir / ".x.kvz.123.tmp").write_bytes(b"partial")  # no writer holds it
    if verb == "import":
        store.export("s", root / "s.kvs")
    if verb == "open":  # a writer killed after writing an extent, before committing it

        s = store.open("s", model)
        list(s.seq.generate(s.settings, seed=s.seed, max_new_tokens=3))
        segments.append(s.directory, s.head.committed_end, [t.contiguous() for t in s.seq.cache.state(s.head.n_cached)])
        (s.directory / ".layer-000.kv.1.tmp").write_bytes(b"junk")
        s.lock.release()
    floors = {i.name: i.n_tokens for i in store.list()}
    store.close()
    return floors


def prepare(verb: str, store, model, root: Path):
    """What runs before the faults start (opening, generating): returns the verb's action."""
    if verb in ("checkpoint", "fork"):
        s = store.open("s", model)
        list(s.seq.generate(s.settings, seed=s.seed, max_new_tokens=N_MORE))
        if verb == "checkpoint":
            return lambda: (s.checkpoint(), s.close())
        return lambda: (s.fork("f").close(), s.close())
    return {
        "create": lambda: _create(store, model),
        "pack": lambda: store.pack("s"),
        "export": lambda: store.export("s", root / "out.kvs"),
        "import": lambda: store.import_(root / "s.kvs", name="t"),
        "gc": lambda: store.gc(),
        "delete": lambda: store.delete("s"),
        "open": lambda: store.open("s", model).close(),
    }[verb]


def _create(store, model) -> None:
    with store.new("n", model, **SETTINGS) as s:
        s.append_text(DOCUMENT)


def check(root: Path, model, ref: Reference, verb: str, floors: dict[str, int], acked: bool, *,
          trace: bool = False) -> None:
    """Everything a crash must leave true; raises Lost or Corrupt (AssertionErrors) otherwise."""
    store = kvstore.open_store(root / "home")
    try:
        problems = {k: v for k, v in store.verify().items() if v}
        if problems:
            raise Corrupt(f"verify after {verb}: {problems}")
        names = set(store.names())
        gone = {"s"} if verb == "delete" else set()
        for name, floor in floors.items():
            if name not in names and name not in gone:
                raise Lost(f"session {name!r} is gone after {verb}")
        if acked:
            _check_acked(root, store, verb, floors, names)
        for name in sorted(names - {"d"}):
            try:
                n = _check_content(store, model, ref, name)
            except KvstoreError as e:
                raise Corrupt(f"session {name!r} does not load after {verb}: {e}") from e
            if name in floors and n < floors[name]:
                raise Lost(f"session {name!r} went back from {floors[name]} to {n} tokens after {verb}")
        if verb == "checkpoint" and store.info("s").n_tokens not in (floors["s"], floors["s"] + N_MORE):
            raise Corrupt(f"session 's' has {store.info('s').n_tokens} tokens: neither the old nor the new head")
        if verb == "export" and (root / "out.kvs").exists():
            _check_archive(root, model, ref)
        store.gc()
        if leftovers := orphans(store):
            raise Corrupt(f"gc after {verb} leaves {leftovers}")
        if trace:
            _check_continuation(root, store, model, ref, next(n for n in ("s", "n", "t", "f") if n in names))
    finally:
        store.close()


def _check_acked(root: Path, store, verb: str, floors: dict[str, int], names: set[str]) -> None:
    need = {"create": "n", "fork": "f", "import": "t"}.get(verb)
    if need is not None and need not in names:
        raise Lost(f"{verb} was acknowledged but session {need!r} is missing")
    if verb == "delete" and "s" in names:
        raise Lost("delete was acknowledged but the session is still there")
    if verb in ("checkpoint", "fork") and store.info("s").n_tokens != floors["s"] + N_MORE:
        raise Lost(f"acknowledged checkpoint lost: 's' has {store.info('s').n_tokens} tokens")
    if verb == "export" and not (root / "out.kvs").exists():
        raise Lost("export was acknowledged but the archive is missing")
    if verb == "pack":
        with store.db() as db:
            if any(r.blob is None for r in session_extents(db, store.info("s").id)):
                raise Lost("pack was acknowledged but extents of 's' are not packed")


def _check_content(store, model, ref: Reference, name: str) -> int:
    """Open a session (checksums verified) and compare its tokens and cache bytes with the reference."""

    with store.open(name, model) as s:
        n, cached = len(s.tokens), s.seq.cache.length
        if s.tokens != ref.tokens[:n]:
            raise Corrupt(f"session {name!r}: its tokens are not those committed")
        for layer, rows in enumerate(s.seq.cache.state()):
            got = rows.contiguous().view(-1).view(torch.uint8)
            if not torch.equal(got, ref.kv[layer][:got.numel()]):
                raise Corrupt(f"session {name!r}: layer {layer} of its cache loads other bytes than committed")
        if not (cached in (n - 1, n) or cached % SETTINGS["chunk_size"] == 0):  # C2, or mid-prefill
            raise Corrupt(f"session {name!r}: {cached} cached positions for {n} tokens")
    return n


def _check_archive(root: Path, model, ref: Reference) -> None:
    other = kvstore.open_store(root / "import-check")
    try:
        other.import_(root / "out.kvs", model=model)
        _check_content(other, model, ref, "s")
    except KvstoreError as e:
        raise Corrupt(f"the exported archive does not import: {e}") from e
    finally:
        other.close()


def _check_continuation(root: Path, store, model, ref: Reference, name: str) -> None:
    """Continue the session to the reference's length: every token and logits bit as uninterrupted."""
    trace = root / "continued.jsonl"
    with store.open(name, model) as s:
        list(s.generate(len(ref.tokens) - len(s.tokens), trace=trace, stop_at_eos=False))
        if s.tokens != ref.tokens:
            raise Corrupt(f"session {name!r} continued into other tokens than the uninterrupted run")
    for position, line in H.by_position(H.read_trace(trace)).items():
        if line != ref.lines.get(position):
            raise Corrupt(f"position {position} of {name!r} differs from the uninterrupted run")


def orphans(store) -> list[str]:
    """Files the index does not account for (after a gc): folders of no segment, blobs of no row, temps."""


    with store.db() as db:
        segments = set(db.scalars(select(SegmentRow.id)))
        blobs = {f"{h}.kvz" for h in db.scalars(select(BlobRow.hash))}
    out = [f"sessions/{p.name}" for p in sorted(store.sessions_dir.iterdir()) if p.name not in segments]
    if store.blobs_dir.is_dir():
        out += [f"blobs/{p.name}" for p in sorted(store.blobs_dir.iterdir()) if p.name not in blobs]
    out += [str(p.relative_to(store.home)) for p in store.home.rglob("*.tmp")]
    return out


# -- trials: run a verb from a copy of its template under a fault, then check --------------------------
def copy_template(template: Path, root: Path) -> Path:
    shutil.copytree(template, root)
    return root


def start_verb(root: Path, model, verb: str, fs: FaultyIO):
    """Open the store through `fs`, prepare the verb; returns (store, action, operations so far)."""
    with fileio.use(fs):
        store = kvstore.open_store(root / "home")
        action = prepare(verb, store, model, root)
    return store, action, len(fs.log)


def dry_run(template: Path, scratch: Path, model, verb: str) -> tuple[list[tuple[str, str]], int]:
    """The operations the verb performs (names, paths) and how many of them are fsyncs."""

    fs = FaultyIO(track=False)
    store, action, base = start_verb(copy_template(template, scratch), model, verb, fs)
    before = fs.n_syncs
    with fileio.use(fs):
        action()
    store.close()
    return fs.log[base:], fs.n_syncs - before


def power_trial(template: Path, root: Path, model, ref: Reference, verb: str, floors: dict[str, int],
                sync: int | None, data: str, dirs: str, seed: int = 0) -> dict:
    """Power fails at the verb's `sync`-th fsync (None: after it returns); then recover and check."""
    fs = FaultyIO(seed=seed)
    store, action, _ = start_verb(copy_template(template, root), model, verb, fs)
    if sync is not None:
        fs.crash_at_sync(fs.n_syncs + sync)
    acked = False
    with fileio.use(fs):
        try:
            action()
            acked = True
        except Crash:
            pass
    undone = fs.power_loss(data=data, dirs=dirs)
    store.close()
    check(root, model, ref, verb, floors, acked)
    return {"acked": acked, **undone}


def kill_power_trial(template: Path, root: Path, model, ref: Reference, verb: str, floors: dict[str, int],
                     op: int, data: str = "drop", dirs: str = "undo", seed: int = 0) -> dict:
    """The verb's process dies at operation `op`; a new one recovers and writes to every session
    that follows the reference (acknowledged); then the power fails. Nothing acknowledged may be
    lost: recovery must make durable what it relies on, not only what it wrote itself."""
    fs = FaultyIO(seed=seed)
    store, action, base = start_verb(copy_template(template, root), model, verb, fs)
    fs.crash_at_op(base + op)
    with fileio.use(fs):
        try:
            action()
        except Crash:
            pass
    fs.process_death()
    store.close()
    written = {}
    with fileio.use(fs):
        store = kvstore.open_store(root / "home")
        for name in [n for n in ("s", "n", "t") if n in store.names()]:
            with store.open(name, model) as s:
                if s.tokens:
                    list(s.generate(2, stop_at_eos=False))
                else:  # created, killed before its document was recorded
                    s.append_text(DOCUMENT)
                written[name] = len(s.tokens)
        store.close()
    fs.power_loss(data=data, dirs=dirs)
    check(root, model, ref, verb, {**floors, **written}, acked=False)
    return written


def kill_child(root: str, model_path: str, verb: str, kill_at: int | None, conn) -> None:
    """Run a verb; SIGKILL this process before its `kill_at`-th operation (reported on the pipe)."""


    torch.set_num_threads(1)
    model = kvstore.load_model(model_path)
    fs = FaultyIO(track=False)
    store, action, base = start_verb(Path(root), model, verb, fs)
    fs.on_kill = lambda n, name, path: conn.send(("kill", n - base, name, path))
    if kill_at is not None:
        fs.kill_at(base + kill_at)
    with fileio.use(fs):
        action()
    conn.send(("acked", len(fs.log) - base))


_CTX = None


def context():
    """A forkserver with the store's modules imported once, so a child starts in ~0.1 s."""
    global _CTX
    if _CTX is None:

        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "kvstore", "kvstore.session", "kvstore.store.archive", "kvstore.store.gc",
                                     "kvstore.store.pack", "kvstore.store.verify", "alembic.command", "store_harness",
                                     "faults", "faults_kit"])
    return _CTX


def start(target, *args):
    """`store_harness.start` in a child of our forkserver (its preloads include the torture kit)."""
    return H.start(target, *args, ctx=context())


def kill_trial(template: Path, root: Path, model_path: str, model, ref: Reference, verb: str,
               floors: dict[str, int], kill_at: int | None, *, trace: bool = True) -> tuple:
    """A child runs the verb and dies at operation `kill_at`; returns the message it sent last."""
    copy_template(template, root)
    proc, parent = start(kill_child, str(root), model_path, verb, kill_at)
    messages = []
    while True:
        try:
            messages.append(parent.recv())
        except EOFError:
            break
    proc.join(30)
    last = messages[-1] if messages else ("none",)
    if kill_at is not None and last[0] != "kill":
        raise AssertionError(f"the child was to die at operation {kill_at} of {verb} but sent {last} "
                             f"(exit code {proc.exitcode})")
    if kill_at is None and (proc.exitcode != 0 or last[0] != "acked"):
        raise AssertionError(f"the child failed running {verb} (exit code {proc.exitcode})")
    check(root, model, ref, verb, floors, acked=last[0] == "acked", trace=trace)
    return last


class Kit:
    """Per test module: the tiny model, the reference run, and each verb's template (built once)."""
    def __init__(self, tmp_factory, model_path: str):

        self.tmp, self.model_path = tmp_factory, model_path
        self.model = kvstore.load_model(model_path)
        self.ref = make_reference(tmp_factory.mktemp("reference"), self.model)
        self._templates: dict[str, tuple[Path, dict[str, int]]] = {}
        self._ops: dict[str, tuple[list, int]] = {}

    def template(self, verb: str) -> tuple[Path, dict[str, int]]:
        if verb not in self._templates:
            root = self.tmp.mktemp(f"template-{verb}")
            self._templates[verb] = (root, build_template(root, self.model, verb))
        return self._templates[verb]

    def ops(self, verb: str) -> tuple[list[tuple[str, str]], int]:
        if verb not in self._ops:
            self._ops[verb] = dry_run(self.template(verb)[0], self.tmp.mktemp(f"dry-{verb}") / "t",
                                      self.model, verb)
        return self._ops[verb]

    def power(self, verb: str, sync: int | None, data: str, dirs: str, seed: int = 0) -> dict:
        template, floors = self.template(verb)
        root = self.tmp.mktemp(f"power-{verb}") / "t"
        try:
            return power_trial(template, root, self.model, self.ref, verb, floors, sync, data, dirs, seed)
        except AssertionError as e:
            raise type(e)(f"power loss at fsync {sync} of {verb} ({data}/{dirs}, seed {seed}): {e}") from e
        finally:
            shutil.rmtree(root.parent, ignore_errors=True)

    def kill_then_power(self, verb: str, op: int, data: str = "drop", dirs: str = "undo", seed: int = 0) -> dict:
        template, floors = self.template(verb)
        root = self.tmp.mktemp(f"killpower-{verb}") / "t"
        try:
            return kill_power_trial(template, root, self.model, self.ref, verb, floors, op, data, dirs, seed)
        except AssertionError as e:
            name, path = self.ops(verb)[0][op]
            raise type(e)(f"process death at operation {op} of {verb} ({name} {Path(path).name}), recovery, "
                          f"then power loss ({data}/{dirs}, seed {seed}): {e}") from e
        finally:
            shutil.rmtree(root.parent, ignore_errors=True)

    def kill(self, verb: str, kill_at: int | None, *, trace: bool = True) -> tuple:
        template, floors = self.template(verb)
        root = self.tmp.mktemp(f"kill-{verb}") / "t"
        try:
            return kill_trial(template, root, self.model_path, self.model, self.ref, verb, floors, kill_at,
                              trace=trace)
        except AssertionError as e:
            op = self.ops(verb)[0][kill_at] if kill_at is not None else ("end", "")
            raise type(e)(f"SIGKILL at operation {kill_at} of {verb} ({op[0]} {Path(op[1]).name}): {e}") from e
        finally:
            shutil.rmtree(root.parent, ignore_errors=True)


# -- the kill oracle ----------------------------------------------------------------------------------
def oracle_round(kit: "Kit", tmp_path: Path, rng: random.Random) -> dict:
    """One child generates (checkpoint per token, each acknowledged on the pipe) and is killed at a
    random moment; returns what was acknowledged and what came back."""
    home = tmp_path / "home"
    store = kvstore.open_store(home)
    with store.new("s", kit.model, **{**SETTINGS, "checkpoint_every": 1}) as s:
        s.append_text(DOCUMENT)
    trace = tmp_path / "t.jsonl"
    proc, conn = start(H.child_generate, str(home), kit.model_path, "s", N_TOTAL, str(trace), 1)
    H.wait_for(conn, "ready")
    acks = [m for m in H.kill_after(proc, conn, rng.uniform(0.0, 0.4)) if m[0] == "ack"]
    with store.db() as db:
        head = db.scalar(select(SessionRow.head).where(SessionRow.name == "s"))
    if acks and head < acks[-1][1]:
        raise Lost(f"head {head} is behind the last acknowledged checkpoint {acks[-1][1]}")
    if problems := store.verify()["s"]:
        raise Corrupt(f"verify after the kill: {problems}")
    with store.open("s", kit.model) as s:
        if acks and len(s.tokens) < acks[-1][2]:
            raise Lost(f"{len(s.tokens)} tokens, {acks[-1][2]} were acknowledged")
        for _ in (s.resume(trace=trace) if s.active_call else ()):
            pass
        list(s.generate(len(kit.ref.tokens) - len(s.tokens), trace=trace, stop_at_eos=False))
        if s.tokens != kit.ref.tokens:
            raise Corrupt("the resumed session produced other tokens")
    for position, line in H.by_position(H.read_trace(trace)).items():
        if line != kit.ref.lines[position]:
            raise Corrupt(f"position {position} differs from the uninterrupted run")
    store.close()
    return {"acks": len(acks), "head": head}



# -- two writers at once ------------------------------------------------------------------------------
def racer(home: str, model_path: str, text: str, use_lock: bool, barrier, conn) -> None:
    """Open session 's' when the other racer does, prefill `text`, checkpoint when the other does.
    Without the lock, the flock is skipped, so only the index's compare-and-set stands between them."""


    torch.set_num_threads(1)
    if not use_lock:
        SessionLock.acquire = lambda self: (setattr(self, "fd", -1), self)[1]
        SessionLock.release = lambda self: setattr(self, "fd", None)
    model = kvstore.load_model(model_path)
    store = kvstore.open_store(home)
    barrier.wait(30)
    try:
        s = store.open("s", model)
    except SessionBusy:
        barrier.wait(30)
        conn.send(("busy",))
        return
    s.seq.add(model.tokenizer.encode(text, add_bos=False))
    list(s.seq.prefill())
    barrier.wait(30)
    try:
        s.checkpoint("race")
        conn.send(("won", text))
    except SessionBusy:
        conn.send(("lost", text))
    finally:
        s.lock.release()


def race(home: Path, model_path: str, texts: tuple[str, str], use_lock: bool) -> list[tuple]:
    ctx = context()
    barrier = ctx.Barrier(2)
    runs = [start(racer, str(home), model_path, text, use_lock, barrier) for text in texts]
    out = []
    for proc, conn in runs:
        try:
            out.append(conn.recv())
        except EOFError:
            out.append(("died", proc.exitcode))
        proc.join(30)
    return out
