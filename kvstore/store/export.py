"""Export: a session written to one archive file (`archive`'s format), atomically, one extent in
memory at a time.

The data region is written first, into room left for the manifest (`_manifest_bytes(widest=True)`
is its longest possible form); then the manifest and the header go before it. The file is an
`atomic_write` (temp file, flocked; a killed export's temp file is removed by the next export to
the same path); a full disk says the archive was not written. Readers hold no lock, so an extent a
pack moved meanwhile is read from its blob (`extents.read_layers_unlocked`), and a session deleted
meanwhile is SessionNotFound, not damage.
"""

from __future__ import annotations

import errno
import json
from pathlib import Path
from typing import Any, Callable

import xxhash

from ..errors import CorruptData, SessionNotFound
from ..fileio import FolderNotSynced, atomic_write, io
from . import codec
from .archive import HEADER, MAGIC, VERSION, token_bytes_of
from .codec import ITEMSIZE
from .extents import kv_bytes, read_layers_unlocked, session_extents
from .index import ModelRow
from .progress import Progress, Tally
from .records import read_messages, read_tokens


def export_session(store, name: str, path: Path, progress: Progress | None = None) -> dict[str, Any]:
    """Write `name` to `path` atomically (temp file, fsync, rename), one extent in memory at a time.
    Returns a summary; `progress(done, total)` gets the KV bytes read so far after each extent."""
    with store.db() as db:
        row = store.row(db, name)
        model = db.get(ModelRow, row.model_fingerprint)
        refs = session_extents(db, row.id)
        tokens = read_tokens(db, row.id)
        messages = read_messages(db, row.id)
    manifest = {
        "format": "kvstore-archive", "version": VERSION,
        "session": {"name": row.name, "seed": row.seed, "sampler": row.sampler, "chunk_size": row.chunk_size,
                    "checkpoint_every": row.checkpoint_every, "dtype": row.dtype, "kv_layout": row.kv_layout,
                    "active_call": row.active_call, "n_tokens": row.n_tokens, "n_cached": row.n_cached,
                    "last_hidden": row.last_hidden.hex() if row.last_hidden is not None else None,
                    "weights": row.weights},
        "model": {"fingerprint": model.fingerprint, "arch": model.arch, "config": model.config,
                  "source": model.source},
        "token_bytes": refs[0].token_bytes if refs else token_bytes_of(row.kv_layout, row.dtype),
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
    """`write(fd)` fills the archive's temp file (`atomic_write`, which removes a killed export's temp
    files first); returns what `write` returned. On any error `path` is untouched; an OSError of the
    file system names `path`, not the temp file."""
    try:
        with atomic_write(path, clean=True) as temp:
            result = write(temp.fd)
    except FolderNotSynced:
        raise  # already about the archive, and it is there: only its folder's sync failed
    except OSError as e:
        raise _archive_error(e, path) from e
    return result


def _archive_error(e: OSError, path: Path) -> OSError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return OSError(e.errno, "the disk is full; the archive was not written (free some space there, or "
                       "export elsewhere)", str(path))
    return OSError(e.errno, f"cannot write the archive ({e.strerror})", str(path))
