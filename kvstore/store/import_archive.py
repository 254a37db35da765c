"""Import: an archive verified completely (`archive.read_manifest`, `archive.validate`, every
frame inflated within its declared size and checked against its checksum, the model fingerprint
and, for a given model, how it holds its weights (`archive.weights_of`), the KV layout), then
committed as a new session in one transaction. A failure at any point leaves the store as it was:
the new folder is removed and no row is written.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any
from uuid import uuid4

import numpy as np

from ..errors import CorruptData, ModelMismatch
from ..fileio import io
from . import codec, segments
from .archive import read_manifest, validate, weights_of
from .codec import ITEMSIZE
from .index import ExtentRow, MessageRow, ModelRow, SessionExtentRow
from .locking import SessionLock
from .progress import Progress, Tally
from .records import add_session, check_name, claim_name

ALREADY = "import with another name (--as NAME)"


def archive_name(path: Path) -> str:
    """The name of the session an archive holds (its manifest checked, nothing else read): the name
    `import_session` gives the session when it is given none."""
    manifest, _, data_size = read_manifest(path)
    return check_name(validate(manifest, data_size, path.name)["session"]["name"])


def import_session(store, path: Path, name: str | None, model, progress: Progress | None = None) -> str:
    """Verify the archive at `path` completely, then commit it as a new session; returns its name.
    `progress(done, total)` gets the KV bytes inflated and verified so far after each extent."""
    manifest, data_start, data_size = read_manifest(path)
    plan = validate(manifest, data_size, path.name)
    name = check_name(name if name is not None else plan["session"]["name"])
    fingerprint = plan["model"]["fingerprint"]
    if model is not None and model.fingerprint != fingerprint:
        raise ModelMismatch(f"{path.name} was exported with model {fingerprint[:12]}, not {model.fingerprint[:12]} "
                            f"({model.source}); import it without a model or with the right one")
    weights = weights_of(plan)
    if model is not None and model.weights != weights:
        raise ModelMismatch(f"{path.name} holds a session made with the model's weights held {weights!r}, this model "
                            f"holds them {model.weights!r}; import it without a model, or load the model with "
                            f"weights={weights!r}")
    with store.db() as db:
        claim_name(db, name, ALREADY)
        known = db.get(ModelRow, fingerprint)
        if known is not None and known.config != plan["model"]["config"]:
            raise CorruptData(f"{path.name}: model {fingerprint[:12]} is recorded here with another config; "
                              "the archive's model description was altered")
    session_id = uuid4().hex
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
    with store.db() as db, db.begin():
        claim_name(db, name, ALREADY)  # again: another process may have taken it meanwhile
        if db.get(ModelRow, m["fingerprint"]) is None:
            db.add(ModelRow(fingerprint=m["fingerprint"], arch=m["arch"], config=m["config"], source=m["source"]))
            db.flush()
        add_session(db, session_id=session_id, name=name, model_fingerprint=m["fingerprint"], dtype=s["dtype"],
                    weights=weights_of(plan), kv_layout=s["kv_layout"], seed=s["seed"], sampler=s["sampler"],
                    chunk_size=s["chunk_size"],
                    checkpoint_every=s["checkpoint_every"], token_bytes=plan["token_bytes"], reason="import",
                    tokens=plan["tokens"], n_cached=s["n_cached"], active_call=s["active_call"],
                    last_hidden=bytes.fromhex(s["last_hidden"]) if s.get("last_hidden") else None,
                    committed_end=written[-1][1].end if written else 0)
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

