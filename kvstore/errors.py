"""Every error kvstore raises on purpose, in one hierarchy.

Each message says what is wrong and what to do about it; the CLI prints it as one line.
`assert` is kept for internal invariants; anything a user can cause raises one of these.
"""


class KvstoreError(Exception):
    """Base of all kvstore errors."""


# -- models ------------------------------------------------------------------------------------
class ModelError(KvstoreError):
    """A model file or folder cannot be used."""


class UnsupportedModel(ModelError):
    """The architecture or one of its settings is not implemented."""


class MissingTensor(ModelError):
    """A tensor the architecture needs is not in the file."""


class TensorShapeMismatch(ModelError):
    """A tensor has another shape than the config implies."""


class TruncatedFile(ModelError):
    """A model file ends before the data its header announces."""


class PullError(KvstoreError):
    """Fetching the default model failed (network, hash mismatch)."""


class BuildError(KvstoreError):
    """The native kernels could not be built or loaded; the message says why and what to do. The
    model then runs on torch's kernels (`kvstore.engine.native` warns once)."""


class PoolFull(KvstoreError):
    """The KV memory budget cannot hold what a sequence needs now, even after evicting every idle
    sequence (the others are busy): it may later."""


class PoolTooSmall(PoolFull):
    """One sequence alone needs more KV memory than the whole budget."""


# -- arguments ---------------------------------------------------------------------------------
class InvalidArgument(KvstoreError, ValueError):
    """A value given to the library is out of its range (a chunk size of 0, a fork past the end, a
    negative token count). Also a ValueError, so callers that caught that before still do."""


# -- sessions and the store --------------------------------------------------------------------
class SessionNotFound(KvstoreError):
    """No session of that name."""


class SessionExists(KvstoreError):
    """A session of that name exists already."""


class SessionBusy(KvstoreError):
    """Another process holds the session's writer lock."""


class ModelMismatch(KvstoreError):
    """The session was made with another model, dtype or KV layout."""


class CorruptData(KvstoreError):
    """Stored bytes fail their checksum, are truncated or disagree with the index."""


class InvalidName(KvstoreError):
    """A session name that is not allowed."""


class UnsupportedFormat(KvstoreError):
    """An archive or store of an unknown format or version."""


class StoreFull(KvstoreError):
    """The disk is full (ENOSPC); the session's last checkpoint is intact."""


class StoreMissing(KvstoreError):
    """The index is gone while session files remain; nothing is recreated silently."""


class StoreMismatch(KvstoreError):
    """The home and the index belong to different stores (one index serves one home)."""


class IndexBusy(KvstoreError):
    """Another process kept the index locked longer than a transaction waits (`index.LOCK_WAIT_S`);
    nothing was changed."""


class IndexUnavailable(KvstoreError):
    """The index database cannot be used: not a SQLite or PostgreSQL URL, no driver, server unreachable."""
