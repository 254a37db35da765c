"""kvstore: persistent, resumable LLM generation sessions.

The public API, everything the front ends (`kvstore_cli`, the coming service) use:

- `open_store(home=None, url=None) -> Store` (`new`, `open` -> `Session`; list, page, count, info,
  history, fork, delete, export, import_, pack, verify, gc, warm_up), `SessionInfo`, `SessionPage`;
- `load_model(spec) -> Model`, `load_tokenizer(spec)`, `pull(alias)`, `models_dir()`;
- the engine pieces for those who drive generation themselves: `Sequence`, `TokenEvent`,
  `SamplerSettings`, `KVCache`, `StreamDecoder`; `BlockPool` and `PagedCache` (many sequences'
  KV in one paged memory budget, as `kvstore serve` keeps them); `check_response_format(value)`
  (a call's `response_format`, checked: its canonical JSON text);
- the defaults: DEFAULT_MODEL, DEFAULT_DTYPE, DTYPE_NAMES, WEIGHT_FORMATS, DEFAULT_CHUNK, DEFAULT_MAX_NEW_TOKENS,
  DEFAULT_CHECKPOINT_EVERY;
- `errors` (every error derives from `errors.KvstoreError`), `native_will_build()`.

Names are imported on first use, so a command that only reads the index never loads torch. The
layers under it (engine -> store -> session -> this API) import one way only: pyproject.toml's
import-linter contracts check it.
"""

from importlib import import_module

from . import errors
from .defaults import VERSION as __version__
from .engine.pull import pull  # eager: the function shares its module's name (and needs no torch)

_WHERE = {
    "Store": "api", "open_store": "api", "Session": "session", "SessionInfo": "store.listing",
    "SessionPage": "store.listing", "restated": "store.records",
    "load_model": "engine.model", "load_tokenizer": "engine.model", "Model": "engine.model",
    "models_dir": "engine.pull", "KVCache": "engine.cache", "Sequence": "engine.sequence",
    "TokenEvent": "engine.sequence", "SamplerSettings": "engine.settings", "StreamDecoder": "engine.tokenizer",
    "BlockPool": "engine.paged", "PagedCache": "engine.paged",
    "native_will_build": "engine.native", "check_response_format": "engine.grammar",
    **{name: "defaults" for name in ("DEFAULT_MODEL", "DEFAULT_DTYPE", "DTYPE_NAMES", "WEIGHT_FORMATS", "DEFAULT_CHUNK",
                                     "DEFAULT_MAX_NEW_TOKENS", "DEFAULT_CHECKPOINT_EVERY")},
}

__all__ = ["errors", "pull", *_WHERE]


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    value = getattr(import_module(f".{_WHERE[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_WHERE])
