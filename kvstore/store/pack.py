"""Packing: a paused session's extents become compressed blobs; its own KV files are freed.

Each extent the session uses is read (checksums verified), packed into a content-addressed blob
(`blobs.py`), and recorded in `extent_blobs` in one transaction. Blobs are written durably before
that commit (their bytes, their names and the blobs folder's name: all fsynced), and the raw files are removed only after it, so a crash at any point leaves every
extent readable from one place or the other. Extents shared with forks are packed once for all.
Raw files of other sessions' segments are left alone (their owner may be writing); `gc` frees them.
"""

from __future__ import annotations

from sqlalchemy import select

from ..fileio import io, reraise_full
from . import blobs, codec, segments
from .extents import kv_bytes, read_layers_unlocked, session_extents
from .index import BlobRow, ExtentBlobRow, ExtentRow, SessionRow
from .progress import Progress, Tally


def pack_session(store, session_id: str, name: str, progress: Progress | None = None) -> dict[str, int]:
    """Pack every unpacked extent of the session; returns raw and packed byte counts.
    `progress(done, total)` gets the KV bytes of the extents packed so far."""
    with store.db() as db:
        refs = [r for r in session_extents(db, session_id) if r.blob is None]
        dtype_size = codec.ITEMSIZE[db.get(SessionRow, session_id).dtype]
    packed_bytes = 0
    raw = Tally(progress, sum(kv_bytes(ref) for ref in refs))
    new_rows = []
    lock = blobs.hold(store.home, shared=True)  # no gc deletes a blob between its write and our commit
    try:
        for ref in refs:
            layers = read_layers_unlocked(store, ref, dtype_size, session=name)  # a parent's pack may overtake us
            digest = blobs.content_hash(layers)
            packed = _committed_blob(store, digest) or \
                blobs.pack(store.blobs_dir, layers, dtype_size, ref.token_bytes, digest)
            new_rows.append((ref.extent_id, packed))
            packed_bytes += packed.size
            raw.add(kv_bytes(ref))
        if new_rows:  # the blobs' names (some perhaps left by an earlier, killed run) and the folder's own
            try:
                io.fsync_dir(store.blobs_dir)
                io.fsync_dir(store.home)
            except OSError as e:
                reraise_full(e, f"packing {name!r}")
        _commit(store, new_rows)
    finally:
        io.unlock(lock)
    free_packed_segment(store, session_id)
    return {"extents": len(refs), "raw_bytes": raw.done, "packed_bytes": packed_bytes}


def _committed_blob(store, digest: str) -> blobs.Packed | None:
    """The blob already committed for these bytes (a fork packed them first), kept as it is, if its
    file is there at its committed size; else None: the blob is written again, which also mends the
    sessions that share it, before this session's raw files are freed."""
    with store.db() as db:
        row = db.get(BlobRow, digest)
    if row is None:
        return None
    path = blobs.blob_path(store.blobs_dir, digest)
    if not io.exists(path) or io.file_size(path) != row.size:
        return None
    return blobs.Packed(row.hash, row.frames, row.size, row.file_checksum)


def _commit(store, new_rows: list) -> None:
    with store.db() as db, db.begin():
        for extent_id, p in new_rows:
            row = db.get(BlobRow, p.hash)
            if row is None:
                db.add(BlobRow(hash=p.hash, frames=p.frames, size=p.size, file_checksum=p.file_checksum))
                db.flush()
            elif (row.frames, row.size, row.file_checksum) != (p.frames, p.size, p.file_checksum):
                row.frames, row.size, row.file_checksum = p.frames, p.size, p.file_checksum  # written again
            if db.get(ExtentBlobRow, extent_id) is None:
                db.add(ExtentBlobRow(extent_id=extent_id, blob_hash=p.hash))


def has_unpacked_extents(store, segment_id: str) -> bool:
    with store.db() as db:
        return db.scalar(select(ExtentRow.id).where(ExtentRow.segment_id == segment_id)
                         .where(ExtentRow.id.not_in(select(ExtentBlobRow.extent_id))).limit(1)) is not None


def free_packed_segment(store, segment_id: str) -> bool:
    """Delete a segment's layer files once every extent in it is packed (caller holds its lock)."""
    if has_unpacked_extents(store, segment_id):
        return False
    directory = store.session_dir(segment_id)
    try:
        if io.is_dir(directory):
            for path in io.listdir(directory):
                if segments.LAYER_FILE.fullmatch(path.name):
                    io.unlink(path)
            io.fsync_dir(directory)
    except OSError:  # the extents are packed and committed: what is left, the next gc frees
        return False
    return True
