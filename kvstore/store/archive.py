"""The archive format (docs/FORMATS.md): one self-describing file per session, and its reader.

Layout: magic `\\x89KVS\\r\\n\\x1a\\n`, u32 version, u32 flags, u64 manifest length, u64 xxh3-64 of
the manifest, the manifest (UTF-8 JSON), then the data region: one compressed payload (`codec`) per
extent and layer, at the offsets the manifest lists, each with its raw size and raw xxh3-64.
Version 5 adds the session's `weights` (contract C6: how its model held the weight matrices, one
of WEIGHT_FORMATS; other ways compute other bits); before it every session's were "dense".
Version 4 added `last_hidden` (contract C2: the last token's final hidden state, hex, when every
token's KV is cached). Versions 5, 4 and 3 store byte planes in token order; versions 4, 3, 2
(planes channel-major) and 1 (one shuffled frame each) are still read.

`read_manifest` checks the magic, version, sizes and the manifest's checksum; `validate` checks the
manifest's shape and arithmetic (every field, token, message, extent and frame), so that import
(`import_archive`) commits nothing it has not verified. Writing is `export`. Nothing in an archive
is a path, and nothing is unpickled.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path
from typing import Any

import xxhash

from ..defaults import WEIGHT_FORMATS
from ..engine import grammar
from ..engine.settings import SamplerSettings
from ..errors import CorruptData, KvstoreError, UnsupportedFormat
from ..fileio import io
from .codec import ITEMSIZE
from .records import last_state_problem

MAGIC = b"\x89KVS\r\n\x1a\n"
VERSION = 5
READABLE = (1, 2, 3, 4, 5)  # the payload encoding (`codec` tells them apart), 4's last_hidden, 5's weights
WEIGHTS_SINCE = 5  # the first version whose session section records `weights`; earlier ones mean "dense"
HEADER = struct.Struct("<8sIIQQ")  # magic, version, flags, manifest length, manifest xxh3-64
MAX_MANIFEST = 256 << 20
MAX_FRAME_RAW = 1 << 30  # one layer of one extent: far above any real one, low enough to allocate
FIELDS = {  # every field a manifest of any readable version may hold, by section
    "": {"format", "version", "session", "model", "token_bytes", "tokens", "messages", "extents", "data_size"},
    "session": {"name", "seed", "sampler", "chunk_size", "checkpoint_every", "dtype", "kv_layout", "active_call",
                "n_tokens", "n_cached", "last_hidden", "weights"},
    "kv_layout": {"order", "n_layers", "per_token", "dtype"},
    "model": {"fingerprint", "arch", "config", "source"},
    "extent": {"start", "n_tokens", "frames"},
    "frame": {"offset", "size", "raw_size", "xxh3"},
}


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
    if not isinstance(manifest, dict) or manifest.get("version") != version:
        raise CorruptData(f"{path.name}: the header says format version {version}, the manifest "
                          f"{manifest.get('version') if isinstance(manifest, dict) else 'nothing'}; the archive is "
                          "damaged or forged")
    return manifest, HEADER.size + length, size - HEADER.size - length


# -- validation --------------------------------------------------------------------------------------
def token_bytes_of(layout: dict[str, Any], dtype: str) -> int:
    two, n_kv, hd = layout["per_token"]
    return two * n_kv * hd * ITEMSIZE[dtype]


def validate(man: Any, data_size: int, file: str) -> dict[str, Any]:
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
    need(is_int(man.get("version")) and man["version"] in READABLE,
         f"unknown format version {_short(man.get('version'))}")
    _validate_weights(man["version"], s, need)
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
    need(man.get("token_bytes") == token_bytes_of(layout, s["dtype"]), "token_bytes does not match the layout")
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


def weights_of(man: dict[str, Any]) -> str:
    """How the session's model held its weight matrices (WEIGHT_FORMATS), of a validated manifest:
    version 5's field; "dense" before it, as every session then was."""
    return man["session"]["weights"] if man["version"] >= WEIGHTS_SINCE else "dense"


def _validate_weights(version: int, s: dict[str, Any], need) -> None:
    """C6: from version 5 on the session names how its model held the weights, one of WEIGHT_FORMATS
    (a session continues only that way); earlier versions never wrote the field."""
    if version < WEIGHTS_SINCE:
        need("weights" not in s, f"session.weights in a version {version} archive (the field came with version "
             f"{WEIGHTS_SINCE}; earlier sessions' weights were dense)")
        return
    need("weights" in s, f"session.weights missing (a version {version} archive records how the model held its "
         f"weights: {', '.join(WEIGHT_FORMATS)})")
    weights = s["weights"]
    need(isinstance(weights, str) and weights in WEIGHT_FORMATS,
         f"unknown session.weights {_short(weights)} (one of {', '.join(WEIGHT_FORMATS)})")


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _validate_hidden(hidden, n_tokens: int, n_cached: int, cfg: dict[str, Any], dtype: str, need, is_int) -> None:
    """C2 (`records.last_state_problem`): the last token's state, hex of one hidden vector, exactly
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
    need(isinstance(call, dict)
         and set(call) <= {"kind", "start", "max_new_tokens", "stop", "stop_at_eos", "message", "format"}
         and call.get("kind") in ("raw", "chat") and is_int(call.get("start"), 0, n_tokens)
         and is_int(call.get("max_new_tokens"), 0, 1 << 31) and isinstance(call.get("stop", []), list)
         and all(isinstance(x, str) for x in call.get("stop", [])) and isinstance(call.get("stop_at_eos", True), bool),
         "bad generation in progress")
    if "format" in call:  # its response format, as `grammar.canonical` writes it
        try:
            ok = isinstance(call["format"], str) and grammar.canonical(call["format"]) == call["format"] != ""
        except KvstoreError:
            ok = False
        need(ok, "bad generation in progress (its response_format)")
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
