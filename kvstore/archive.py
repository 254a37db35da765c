"""Export and import: one self-describing file per session (format documented in docs/FORMATS.md).

Layout: magic `\\x89KVS\\r\\n\\x1a\\n`, u32 version, u32 flags, u64 manifest length, u64 xxh3-64 of
the manifest, the manifest (UTF-8 JSON), then the data region: one compressed payload (`codec`) per
extent and layer, at the offsets the manifest lists, each with its raw size and raw xxh3-64.
Version 4 adds the session's `last_hidden` (contract C2: the last token's final hidden state, hex,
when every token's KV is cached); its payloads are version 3's: byte planes in token order.
Versions 3, 2 (planes channel-major) and 1 (one shuffled frame each) are still read.
Import checks the magic, version, sizes, every frame's declared size (before inflating it) and
checksum, the model fingerprint and the KV layout before anything is committed; a failure leaves
the store as it was. Nothing in an archive is a path, and nothing is unpickled.
"""

from __future__ import annotations

import errno
import json
import os
import re
import struct
import uuid
from pathlib import Path
from typing import Any, Callable

import numpy as np
import xxhash
from sqlalchemy import select

from . import codec, segments
from .codec import ITEMSIZE
from .errors import CorruptData, KvstoreError, ModelMismatch, SessionExists, SessionNotFound, UnsupportedFormat
from .extents import kv_bytes, read_layers_unlocked, session_extents
from .fileio import io, temp_in_use
from .index import (CheckpointRow, ExtentRow, MessageRow, ModelRow, SegmentRow, SessionExtentRow, SessionRow,
                    TokenBlockRow, utcnow)
from .locking import SessionLock
from .progress import Progress, Tally
from .sampling import SamplerSettings
from .store import check_name, encode_tokens, last_state_problem, read_tokens

MAGIC = b"\x89KVS\r\n\x1a\n"
VERSION = 4
READABLE = (1, 2, 3, 4)  # they differ in the payload encoding, which `codec` tells apart, and in 4's last_hidden
HEADER = struct.Struct("<8sIIQQ")  # magic, version, flags, manifest length, manifest xxh3-64
TEMP_NAME = re.compile(r"\..+\.\d+\.tmp")  # .NAME.PID.tmp: an export in progress, or a killed one
MAX_MANIFEST = 256 << 20
MAX_FRAME_RAW = 1 << 30  # one layer of one extent: far above any real one, low enough to allocate
FIELDS = {  # every field a manifest of any readable version may hold, by section
    "": {"format", "version", "session", "model", "token_bytes", "tokens", "messages", "extents", "data_size"},
    "session": {"name", "seed", "sampler", "chunk_size", "checkpoint_every", "dtype", "kv_layout", "active_call",
                "n_tokens", "n_cached", "last_hidden"},
    "kv_layout": {"order", "n_layers", "per_token", "dtype"},
    "model": {"fingerprint", "arch", "config", "source"},
    "extent": {"start", "n_tokens", "frames"},
    "frame": {"offset", "size", "raw_size", "xxh3"},
}


# -- export ------------------------------------------------------------------------------------------
def export_session(store, name: str, path: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Write `name` to `path` atomically (temp file, fsync, rename), one extent in memory at a time.
    Returns a summary; `progress(done, total)` gets the KV bytes read so far after each extent."""
    with store.db() as db:
        row = store.row(db, name)
        model = db.get(ModelRow, row.model_fingerprint)
        refs = session_extents(db, row.id)
        tokens = read_tokens(db, row.id)
        messages = [{"ordinal": m.ordinal, "role": m.role, "text": m.text, "token_start": m.token_start,
                     "token_end": m.token_end}
                    for m in db.scalars(select(MessageRow).where(MessageRow.session_id == row.id)
                                        .order_by(MessageRow.ordinal))]
    manifest = {
        "format": "kvstore-archive", "version": VERSION,
        "session": {"name": row.name, "seed": row.seed, "sampler": row.sampler, "chunk_size": row.chunk_size,
                    "checkpoint_every": row.checkpoint_every, "dtype": row.dtype, "kv_layout": row.kv_layout,
                    "active_call": row.active_call, "n_tokens": row.n_tokens, "n_cached": row.n_cached,
                    "last_hidden": row.last_hidden.hex() if row.last_hidden is not None else None},
        "model": {"fingerprint": model.fingerprint, "arch": model.arch, "config": model.config,
                  "source": model.source},
        "token_bytes": refs[0].token_bytes if refs else _token_bytes(row.kv_layout, row.dtype),
        "tokens": tokens, "messages": messages, "extents": [], "data_size": 0,
    }
    room = len(_manifest_bytes(manifest, refs, widest=True))
    data_start = HEADER.size + room

    read = Tally(progress, sum(kv_bytes(ref) for ref in refs))

    def write(fd: int) -> int:  # the data region first, then the manifest and header before it
        offset = 0
        for ref in refs:
            try:
                offset = _export_extent(store, name, row.dtype, ref, manifest["extents"], fd, data_start, offset)
            except CorruptData:
                if not store.still_there(row.id):  # its files were freed under us: not damage
                    raise SessionNotFound(f"session {name!r} was deleted while it was being exported; "
                                          "no archive was written") from None
                raise
            read.add(kv_bytes(ref))
        manifest["data_size"] = offset
        body = _manifest_bytes(manifest, refs, widest=False).ljust(room)  # JSON allows trailing spaces
        io.pwrite(fd, HEADER.pack(MAGIC, VERSION, 0, room, xxhash.xxh3_64_intdigest(body)) + body, 0)
        return data_start + offset

    size = _write_atomic(path, write)
    return {"bytes": size, "extents": len(refs), "tokens": len(tokens)}


def _export_extent(store, name: str, dtype: str, ref, entries: list, fd: int, data_start: int, offset: int) -> int:
    """Compress and write one extent's layers at `offset` in the data region; returns the new offset."""
    itemsize, used = ITEMSIZE[dtype], ref.n_tokens * ref.token_bytes
    entry = {"start": ref.start, "n_tokens": ref.n_tokens, "frames": []}
    for data in read_layers_unlocked(store, ref, itemsize, session=name):
        frame = codec.pack_frame(data[:used], itemsize, ref.token_bytes)
        io.pwrite(fd, frame, data_start + offset)
        entry["frames"].append({"offset": offset, "size": len(frame), "raw_size": used,
                                "xxh3": codec.checksum(data[:used])})
        offset += len(frame)
    entries.append(entry)
    return offset


def _manifest_bytes(manifest: dict[str, Any], refs: list, *, widest: bool) -> bytes:
    """The manifest as UTF-8 JSON. `widest` puts the largest possible value in every number the data
    region decides (offsets, sizes, checksums): the length the header must leave room for."""
    if widest:
        big, digest = 2 ** 64 - 1, "f" * 16  # offsets and sizes are below 2**64; an xxh3-64 is 16 hex digits
        manifest = {**manifest, "data_size": big, "extents": [
            {"start": r.start, "n_tokens": r.n_tokens,
             "frames": [{"offset": big, "size": big, "raw_size": r.n_tokens * r.token_bytes, "xxh3": digest}]
             * len(r.checksums)} for r in refs]}
    return json.dumps(manifest, separators=(",", ":")).encode()


def _write_atomic(path: Path, write: Callable[[int], int]) -> int:
    """`write(fd)` fills a temp file beside `path`; fsynced, it replaces `path` (and the folder is
    fsynced). Returns what `write` returned. On any error the temp file is removed and `path` is
    untouched; an OSError of the file system names `path`, not the temp file. The temp file is
    flocked while written; those of earlier exports to `path` that no one holds (a killed
    export's) are removed first."""
    folder = path.parent if str(path.parent) else Path(".")
    tmp = folder / f".{path.name}.{os.getpid()}.tmp"
    try:
        _remove_abandoned_temps(folder, path.name)
        fd = io.lock(tmp)
    except OSError as e:  # no such folder, not writable, full, ...
        raise _archive_error(e, path) from e
    try:
        io.truncate(fd, 0)
        result = write(fd)
        io.fsync(fd)
        io.rename(tmp, path)
    except BaseException as e:
        io.unlock(fd)
        io.unlink(tmp)
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise _archive_error(e, path) from e
        raise
    io.unlock(fd)
    try:
        io.fsync_dir(folder)
    except OSError as e:
        raise OSError(e.errno, f"the archive was written, but syncing its folder failed ({e.strerror}): a power "
                      "loss could still undo it; export again to be sure", str(path)) from e
    return result


def _archive_error(e: OSError, path: Path) -> OSError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OSError(e.errno, "the disk is full; the archive was not written (free some space there, or "
                       "export elsewhere)", str(path))
    return OSError(e.errno, f"cannot write the archive ({e.strerror})", str(path))


def _remove_abandoned_temps(folder: Path, name: str) -> None:
    for candidate in io.listdir(folder):
        if TEMP_NAME.fullmatch(candidate.name) and candidate.name[1:].rsplit(".", 2)[0] == name \
                and not temp_in_use(candidate):
            io.unlink(candidate)


# -- import ------------------------------------------------------------------------------------------
def read_manifest(path: Path) -> tuple[dict[str, Any], int, int]:
    """(manifest, data start, data size) after checking magic, version, sizes and the manifest checksum."""
    fd = io.open_read(path)
    try:
        size = io.size(fd)
        head = io.pread(fd, HEADER.size, 0)
        if len(head) < HEADER.size or head[:8] != MAGIC:
            raise UnsupportedFormat(f"{path.name} is not a kvstore archive (bad magic); export one with `kvstore export`")
        magic, version, flags, length, digest = HEADER.unpack(head)
        if version not in READABLE:
            raise UnsupportedFormat(f"{path.name} is archive format version {version}; this kvstore reads "
                                    f"versions {', '.join(map(str, READABLE))} (upgrade kvstore)")
        if flags != 0:
            raise UnsupportedFormat(f"{path.name} uses archive flags {flags:#x} this kvstore does not know")
        if length > MAX_MANIFEST or HEADER.size + length > size:
            raise CorruptData(f"{path.name}: manifest length {length} does not fit the file ({size} bytes)")
        body = io.pread(fd, length, HEADER.size)
    finally:
        io.close(fd)
    if xxhash.xxh3_64_intdigest(body) != digest:
        raise CorruptData(f"{path.name}: the manifest fails its checksum; the archive is damaged")
    try:
        manifest = json.loads(body)
        json.dumps(manifest, ensure_ascii=False).encode()  # JSON escapes can spell lone surrogates
    except (UnicodeError, ValueError, RecursionError) as e:
        raise CorruptData(f"{path.name}: the manifest is not valid JSON text ({e})") from e
    return manifest, HEADER.size + length, size - HEADER.size - length


def import_session(store, path: Path, name: str | None, model, progress: Progress | None = None) -> str:
    """Verify the archive at `path` completely, then commit it as a new session; returns its name.
    `progress(done, total)` gets the KV bytes inflated and verified so far after each extent."""
    manifest, data_start, data_size = read_manifest(path)
    plan = _validate(manifest, data_size, path.name)
    name = check_name(name if name is not None else plan["session"]["name"])
    fingerprint = plan["model"]["fingerprint"]
    if model is not None and model.fingerprint != fingerprint:
        raise ModelMismatch(f"{path.name} was exported with model {fingerprint[:12]}, not {model.fingerprint[:12]} "
                            f"({model.source}); import it without a model or with the right one")
    with store.db() as db:
        if db.scalar(select(SessionRow.id).where(SessionRow.name == name)):
            raise SessionExists(f"a session named {name!r} exists; import with another name (--as NAME)")
        known = db.get(ModelRow, fingerprint)
        if known is not None and known.config != plan["model"]["config"]:
            raise CorruptData(f"{path.name}: model {fingerprint[:12]} is recorded here with another config; "
                              "the archive's model description was altered")
    session_id = uuid.uuid4().hex
    directory = store.session_dir(session_id)
    lock = SessionLock(directory, name).acquire(fresh=True)  # gc leaves a folder alone while it is locked
    try:
        written = _write_extents(path, plan, data_start, directory, progress)
        _commit(store, plan, name, session_id, written)
    except BaseException:
        _discard(directory)
        raise
    finally:
        lock.release()
    return name


def _write_extents(path: Path, plan: dict[str, Any], data_start: int, directory: Path,
                   progress: Progress | None) -> list:
    """Inflate and verify every frame, appending each extent to the new segment (not yet committed)."""
    itemsize, end, written = ITEMSIZE[plan["session"]["dtype"]], 0, []
    inflated = Tally(progress, sum(_raw_size(extent) for extent in plan["extents"]))
    n_kv, hd = plan["session"]["kv_layout"]["per_token"][1:]
    fd = io.open_read(path)
    try:
        for e_index, extent in enumerate(plan["extents"]):
            layers = []
            for layer, fr in enumerate(extent["frames"]):
                what = f"{path.name}: extent {e_index}, layer {layer}"
                frame = io.pread(fd, fr["size"], data_start + fr["offset"])
                raw = codec.unpack_frame(frame, fr["raw_size"], itemsize, plan["token_bytes"], what=what)
                if codec.checksum(raw) != fr["xxh3"]:
                    raise CorruptData(f"{what}: checksum mismatch; the archive is damaged")
                layers.append(raw)
            import torch

            tensors = [torch.from_numpy(np.ascontiguousarray(d)).view(torch.uint8)
                       .view(extent["n_tokens"], 2, n_kv, hd * itemsize) for d in layers]
            w = segments.append(directory, end, tensors, names_synced=bool(written))
            end = w.end
            written.append((extent, w))
            inflated.add(_raw_size(extent))
    finally:
        io.close(fd)
    return written


def _raw_size(extent: dict[str, Any]) -> int:
    """Raw bytes of an archive extent, all layers."""
    return sum(fr["raw_size"] for fr in extent["frames"])


def _commit(store, plan: dict[str, Any], name: str, session_id: str, written: list) -> None:
    s, m = plan["session"], plan["model"]
    now = utcnow()
    with store.db() as db, db.begin():
        if db.get(ModelRow, m["fingerprint"]) is None:
            db.add(ModelRow(fingerprint=m["fingerprint"], arch=m["arch"], config=m["config"], source=m["source"],
                            created_at=now))
            db.flush()
        db.add(SessionRow(id=session_id, name=name, model_fingerprint=m["fingerprint"], dtype=s["dtype"],
                          kv_layout=s["kv_layout"], seed=s["seed"], sampler=s["sampler"], chunk_size=s["chunk_size"],
                          checkpoint_every=s["checkpoint_every"], head=0, n_tokens=s["n_tokens"],
                          n_cached=s["n_cached"], active_call=s["active_call"], created_at=now, updated_at=now,
                          last_hidden=bytes.fromhex(s["last_hidden"]) if s.get("last_hidden") else None))
        db.flush()
        end = written[-1][1].end if written else 0
        db.add(SegmentRow(id=session_id, n_layers=s["kv_layout"]["n_layers"], token_bytes=plan["token_bytes"],
                          committed_end=end))
        db.flush()
        db.add(CheckpointRow(session_id=session_id, seq=0, n_tokens=s["n_tokens"], n_cached=s["n_cached"],
                             reason="import", created_at=now))
        db.add(TokenBlockRow(session_id=session_id, start=0, ids=encode_tokens(plan["tokens"])))
        for extent, w in written:
            row = ExtentRow(segment_id=session_id, offset=w.offset, n_tokens=w.n_tokens, checksums=w.checksums)
            db.add(row)
            db.flush()
            db.add(SessionExtentRow(session_id=session_id, start=extent["start"], extent_id=row.id,
                                    n_tokens=extent["n_tokens"]))
        for msg in plan["messages"]:
            db.add(MessageRow(session_id=session_id, **msg))


def _discard(directory: Path) -> None:
    try:
        io.rmtree(directory)
    except OSError:  # a leftover folder without an index row is removed by gc
        pass


# -- validation --------------------------------------------------------------------------------------
def _token_bytes(layout: dict[str, Any], dtype: str) -> int:
    two, n_kv, hd = layout["per_token"]
    return two * n_kv * hd * ITEMSIZE[dtype]


def _validate(man: Any, data_size: int, file: str) -> dict[str, Any]:
    """Check the manifest's shape and arithmetic; CorruptData naming the first thing wrong."""
    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CorruptData(f"{file}: {what}; the archive is damaged or forged")

    def is_int(x, lo=0, hi=1 << 62) -> bool:
        return isinstance(x, int) and not isinstance(x, bool) and lo <= x <= hi

    need(isinstance(man, dict) and man.get("format") == "kvstore-archive", "not a kvstore manifest")
    s, m = man.get("session"), man.get("model")
    need(isinstance(s, dict) and isinstance(m, dict), "session or model section missing")
    unknown = _unknown_fields(man)
    need(not unknown, f"unknown manifest field(s) {', '.join(unknown[:5])} (an archive names no paths, links "
         "or files; everything it holds is listed in docs/FORMATS.md)")
    need(isinstance(s.get("dtype"), str) and s["dtype"] in ITEMSIZE, f"unknown KV dtype {s.get('dtype')!r}")
    layout = s.get("kv_layout")
    need(isinstance(layout, dict) and layout.get("order") == "token-major" and isinstance(layout.get("per_token"), list)
         and len(layout["per_token"]) == 3 and all(is_int(v, 1, 1 << 16) for v in layout["per_token"])
         and layout["per_token"][0] == 2 and is_int(layout.get("n_layers"), 1, 4096), "bad KV layout")
    need(isinstance(m.get("fingerprint"), str) and len(m["fingerprint"]) <= 64 and isinstance(m.get("config"), dict)
         and isinstance(m.get("arch"), str) and isinstance(m.get("source"), str), "bad model section")
    cfg = m["config"]
    need(cfg.get("n_layers") == layout["n_layers"] and cfg.get("n_kv_heads") == layout["per_token"][1]
         and cfg.get("head_dim") == layout["per_token"][2], "KV layout does not match the model config")
    need(man.get("token_bytes") == _token_bytes(layout, s["dtype"]), "token_bytes does not match the layout")
    tokens, n_tokens, n_cached = man.get("tokens"), s.get("n_tokens"), s.get("n_cached")
    vocab = cfg.get("vocab_size")
    need(is_int(vocab, 1, 1 << 31) and isinstance(tokens, list) and all(is_int(t, 0, vocab - 1) for t in tokens),
         "token ids missing or out of the model's vocabulary")
    need(is_int(n_tokens) and n_tokens == len(tokens), "token count does not match")
    need(is_int(n_cached) and (n_cached <= n_tokens - 1 or n_tokens == n_cached == 0 or n_cached == n_tokens),
         "cached count out of range")
    _validate_hidden(s.get("last_hidden"), n_tokens, n_cached, cfg, s["dtype"], need, is_int)
    need(is_int(s.get("seed"), -(1 << 63), (1 << 63) - 1) and is_int(s.get("chunk_size"), 1, 1 << 20)
         and is_int(s.get("checkpoint_every"), 1, 1 << 20) and isinstance(s.get("sampler"), dict),
         "bad session settings")
    need(isinstance(s.get("name"), str), "session name missing")
    try:
        SamplerSettings.from_dict(s["sampler"])
    except (KvstoreError, TypeError, ValueError) as e:
        need(False, f"bad sampler settings ({e})")
    _validate_messages(man.get("messages"), n_tokens, need, is_int)
    _validate_call(s.get("active_call"), n_tokens, man["messages"], need, is_int)
    _validate_extents(man, layout, n_cached, data_size, need, is_int)
    return man


def _validate_hidden(hidden, n_tokens: int, n_cached: int, cfg: dict[str, Any], dtype: str, need, is_int) -> None:
    """C2 (`store.last_state_problem`): the last token's state, hex of one hidden vector, exactly
    when every token's KV is cached."""
    need(hidden is None or (isinstance(hidden, str) and re.fullmatch(r"(?:[0-9a-f]{2})*", hidden) is not None),
         "the last token's state is not lowercase hex")
    size = cfg["hidden_size"] * ITEMSIZE[dtype] if is_int(cfg.get("hidden_size"), 1, 1 << 20) else -1
    problem = last_state_problem(n_tokens, n_cached, None if hidden is None else bytes.fromhex(hidden), size)
    need(problem is None, str(problem))


def _unknown_fields(man: dict[str, Any]) -> list[str]:
    """Dotted names of the manifest's fields that no version defines."""
    def extra(d, section: str, where: str) -> list[str]:
        return [f"{where}{k}" for k in sorted(map(str, d)) if k not in FIELDS[section]] if isinstance(d, dict) else []

    s = man["session"]
    out = extra(man, "", "") + extra(s, "session", "session.") + extra(man["model"], "model", "model.")
    out += extra(s.get("kv_layout"), "kv_layout", "session.kv_layout.")
    for i, e in enumerate(man.get("extents") if isinstance(man.get("extents"), list) else []):
        out += extra(e, "extent", f"extents[{i}].")
        for j, fr in enumerate(e.get("frames") if isinstance(e, dict) and isinstance(e.get("frames"), list) else []):
            out += extra(fr, "frame", f"extents[{i}].frames[{j}].")
    return out


def _validate_messages(messages, n_tokens, need, is_int) -> None:
    need(isinstance(messages, list), "messages missing")
    for i, msg in enumerate(messages):
        need(isinstance(msg, dict) and set(msg) == {"ordinal", "role", "text", "token_start", "token_end"}
             and msg["ordinal"] == i and isinstance(msg["role"], str) and len(msg["role"]) <= 32
             and isinstance(msg["text"], str) and is_int(msg["token_start"]) and is_int(msg["token_end"])
             and msg["token_start"] <= msg["token_end"] <= n_tokens, f"bad message {i}")


def _validate_call(call, n_tokens, messages, need, is_int) -> None:
    """A generation in progress, as Session records it: resuming it must be possible."""
    if call is None:
        return
    need(isinstance(call, dict) and set(call) <= {"kind", "start", "max_new_tokens", "stop", "stop_at_eos", "message"}
         and call.get("kind") in ("raw", "chat") and is_int(call.get("start"), 0, n_tokens)
         and is_int(call.get("max_new_tokens"), 0, 1 << 31) and isinstance(call.get("stop", []), list)
         and all(isinstance(x, str) for x in call.get("stop", [])) and isinstance(call.get("stop_at_eos", True), bool),
         "bad generation in progress")
    if call["kind"] == "chat":
        i = call.get("message")
        need(is_int(i, 0, len(messages) - 1) and i == len(messages) - 1 and messages[i]["role"] == "assistant"
             and messages[i]["token_start"] == call["start"], "bad generation in progress (its reply message)")


def _validate_extents(man, layout, n_cached, data_size, need, is_int) -> None:
    extents, position = man.get("extents"), 0
    need(isinstance(extents, list) and is_int(man.get("data_size")) and man["data_size"] == data_size,
         f"data region is {data_size} bytes, the manifest says {man.get('data_size')}")
    for e in extents:
        need(isinstance(e, dict) and e.get("start") == position and is_int(e.get("n_tokens"), 1, n_cached)
             and isinstance(e.get("frames"), list) and len(e["frames"]) == layout["n_layers"],
             f"extent at position {position} malformed")
        raw = e["n_tokens"] * man["token_bytes"]
        need(raw <= MAX_FRAME_RAW, f"extent at position {position} claims {raw} bytes per layer "
             f"(at most {MAX_FRAME_RAW} are accepted)")
        for fr in e["frames"]:
            need(isinstance(fr, dict) and is_int(fr.get("offset")) and is_int(fr.get("size"), 1)
                 and fr["offset"] + fr["size"] <= data_size and fr.get("raw_size") == raw
                 and isinstance(fr.get("xxh3"), str), f"frame of extent at {position} malformed or out of bounds")
        position += e["n_tokens"]
    need(position == n_cached, f"extents cover {position} positions, the session has {n_cached}")
