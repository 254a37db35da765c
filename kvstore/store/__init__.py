"""The store: sessions at rest on disk, and every verb on them that runs no model.

    store.py                 Store (a home and its index) and open_store
    listing.py               SessionInfo, SessionPage: a page of sessions in two index queries
    records.py               a session's rows built and read in one place; names; contract C2's rule
    index.py                 the schema (SQLAlchemy), the database engines, migrations
    identity.py, paths.py    which home an index serves; where the home and the index are
    locking.py               one writer per session (flock)
    segments.py, extents.py  raw per-layer KV files, and a session's extents read back verified
    codec.py, blobs.py,      checksums and compressed payloads; packed (cold) extents
    pack.py
    restore.py               a session's rows, cache and last state read back for a writer
    archive.py, export.py,   the archive format, writing one, verifying and importing one
    import_archive.py
    verify.py, gc.py         re-check everything; delete what nothing refers to
    progress.py              the progress(done, total) callback of long jobs

The store imports the engine's torch-free parts at the top (settings, buffers) and its tensor
parts (the cache, a model) only inside the functions that make tensors, so the index-only commands
never load torch. It knows nothing of sessions being written (`kvstore.session`, above it).
"""
