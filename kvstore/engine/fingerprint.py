"""A model's identity: what a stored KV cache is only valid for.

The fingerprint hashes the architecture config, every tensor's name, shape and dtype, and the
bytes of every file the model was read from (xxh3-128). File hashes are cached in
`fingerprints.json` in the per-user models folder, keyed by path, size and mtime, so a large file
is hashed once per machine (the file is replaced whole: `fileio.atomic_write`). Two models with the same architecture but other weights never share a fingerprint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import xxhash

from ..fileio import PLAIN, atomic_write
from .weights import file_identity, iter_file_chunks

_memory: dict[tuple[str, int, int], str] = {}


def file_hash(path: Path, cache_file: Path | None) -> str:
    key = file_identity(path)
    if key in _memory:
        return _memory[key]
    stored = _load(cache_file)
    digest = stored.get(_key_text(key))
    if digest is None:
        h = xxhash.xxh3_128()
        for chunk in iter_file_chunks(path):
            h.update(chunk)
        digest = h.hexdigest()
        stored[_key_text(key)] = digest
        _save(cache_file, stored)
    _memory[key] = digest
    return digest


def model_fingerprint(config: dict, tensors: Iterable[tuple[str, tuple[int, ...], str]], files: list[Path],
                      cache_file: Path | None) -> str:
    """xxh3-128 over the config, the tensor table and the source files' hashes."""
    h = xxhash.xxh3_128()
    h.update(json.dumps(config, sort_keys=True).encode())
    for name, shape, dtype in sorted(tensors):
        h.update(f"{name}:{list(shape)}:{dtype};".encode())
    for f in files:
        h.update(file_hash(f, cache_file).encode())
    return h.hexdigest()


def _key_text(key: tuple[str, int, int]) -> str:
    return f"{key[0]}|{key[1]}|{key[2]}"


def _load(cache_file: Path | None) -> dict[str, str]:
    if cache_file is None or not cache_file.exists():
        return {}
    try:
        return json.loads(cache_file.read_text())
    except (OSError, ValueError):
        return {}  # a damaged cache only costs a re-hash


def _save(cache_file: Path | None, data: dict[str, str]) -> None:
    if cache_file is None:
        return
    try:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        with atomic_write(cache_file, ops=PLAIN, clean=True) as out:
            PLAIN.pwrite(out.fd, json.dumps(data).encode(), 0)
    except OSError:
        pass  # a read-only folder: hash again next time
