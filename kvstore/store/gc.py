"""Garbage collection: delete what no session references any more.

In one transaction: extents no session uses, then segments with no extents whose session is gone,
then blobs no extent uses. Files go only after that commit, so a crash leaves at worst an
unreferenced file that the next gc removes. Session folders with no index row (a writer killed
while creating one), temp files no writer holds (flock) and the raw files of fully packed
segments of sessions no one is writing are removed too. Blobs are left alone while a pack runs
(`blobs.hold`): a blob it has written is not in the index until its commit.
"""

from __future__ import annotations

from sqlalchemy import delete, select

from ..errors import SessionBusy
from ..fileio import io, temp_in_use
from . import blobs, segments
from .index import BlobRow, ExtentBlobRow, ExtentRow, SegmentRow, SessionExtentRow, SessionRow
from .locking import SessionLock
from .pack import free_packed_segment, has_unpacked_extents


def collect(store) -> dict[str, int]:
    lock = blobs.hold(store.home, shared=False)  # None while a pack runs: its blobs wait for the next gc
    try:
        return _collect(store, blobs_too=lock is not None)
    finally:
        if lock is not None:
            io.unlock(lock)


def _collect(store, blobs_too: bool) -> dict[str, int]:
    with store.db() as db, db.begin():
        used = select(SessionExtentRow.extent_id)
        dead_extents = list(db.scalars(select(ExtentRow.id).where(ExtentRow.id.not_in(used))))
        if dead_extents:
            db.execute(delete(ExtentBlobRow).where(ExtentBlobRow.extent_id.in_(dead_extents)))
            db.execute(delete(ExtentRow).where(ExtentRow.id.in_(dead_extents)))
        dead_segments = list(db.scalars(
            select(SegmentRow.id).where(SegmentRow.id.not_in(select(ExtentRow.segment_id)))
            .where(SegmentRow.id.not_in(select(SessionRow.id)))))
        if dead_segments:
            db.execute(delete(SegmentRow).where(SegmentRow.id.in_(dead_segments)))
        dead_blobs = list(db.scalars(select(BlobRow.hash).where(BlobRow.hash.not_in(select(ExtentBlobRow.blob_hash))))
                          ) if blobs_too else []
        if dead_blobs:
            db.execute(delete(BlobRow).where(BlobRow.hash.in_(dead_blobs)))
        live_segments = set(db.scalars(select(SegmentRow.id)))
        live_blobs = set(db.scalars(select(BlobRow.hash)))
    removed_dirs = _remove_dead_dirs(store, live_segments)
    removed_blobs = _remove_dead_blobs(store, live_blobs) if blobs_too else 0
    freed = _free_packed_segments(store, live_segments)
    return {"extents": len(dead_extents), "segments": removed_dirs, "blobs": removed_blobs, "packed_freed": freed}


def _remove_dead_dirs(store, live: set[str]) -> int:
    count = 0
    for directory in io.listdir(store.sessions_dir):
        if io.is_dir(directory) and directory.name not in live:
            if _segment_exists(store, directory.name):  # made since our snapshot: leave its lock alone
                continue
            try:  # a folder being created by a writer right now holds its lock
                lock = SessionLock(directory, directory.name).acquire(patience_s=0)
            except SessionBusy:
                continue
            try:
                if _segment_exists(store, directory.name):  # committed while we took the lock?
                    continue
                _remove_tree(directory)
                count += 1
            finally:
                lock.release()
    if count:
        io.fsync_dir(store.sessions_dir)
    return count


def _remove_dead_blobs(store, live: set[str]) -> int:
    count = 0
    for path in io.listdir(store.blobs_dir):
        stem = path.name.removesuffix(".kvz")
        if (path.name.endswith(".tmp") and not temp_in_use(path)) or \
                (path.name.endswith(".kvz") and stem not in live):
            io.unlink(path)
            count += 1
    return count


def _segment_exists(store, segment_id: str) -> bool:
    with store.db() as db:
        return db.get(SegmentRow, segment_id) is not None


def _remove_tree(directory) -> None:
    try:
        io.rmtree(directory)
    except OSError:  # what is left is removed by the next gc
        pass


def _free_packed_segments(store, live: set[str]) -> int:
    freed = 0
    for segment_id in sorted(live):
        directory = store.session_dir(segment_id)
        if not any(segments.LAYER_FILE.fullmatch(p.name) for p in io.listdir(directory)):
            continue
        if has_unpacked_extents(store, segment_id):  # the common case: asked without touching its lock
            continue
        try:
            lock = SessionLock(directory, segment_id).acquire(patience_s=0)
        except SessionBusy:
            continue
        try:
            freed += free_packed_segment(store, segment_id)
        finally:
            lock.release()
    return freed
