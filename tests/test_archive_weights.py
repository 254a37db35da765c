"""Contract C6 through the archive: how a session's model held its weight matrices ("stored",
"dense", "q8_0": each computes other bits) travels with it (archive format version 5).

- export writes the session's `weights`; import stores it; the imported session then opens only with
  a model loaded that way, and continues there exactly as the exported session does (trace lines:
  tokens and logits bits); `kvstore import` (the CLI) does the same;
- an archive of versions 1 to 4 has no such field: its session is "dense", as every session was;
- a version-5 manifest without the field or with an unknown value, and an older one carrying it, are
  refused by `archive.validate` (CorruptData naming it), and the store is left as it was;
- an import given a model that holds its weights another way is a ModelMismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import xxhash
from click.testing import CliRunner

import kvstore
import store_harness as H
from engine_models import Q
from kvstore.errors import CorruptData, ModelMismatch
from kvstore.store import archive
from kvstore_cli.main import cli

GOLDEN = Path(__file__).parent / "golden"


# -- archives taken apart and put together again ---------------------------------------------------------
def parts(path: Path) -> tuple[dict, bytes]:
    data = path.read_bytes()
    length = archive.HEADER.unpack_from(data)[3]
    return json.loads(data[archive.HEADER.size:archive.HEADER.size + length]), data[archive.HEADER.size + length:]


def write(path: Path, manifest: dict, payload: bytes) -> Path:
    """An archive of `manifest` and `payload`, signed, its header's version the manifest's."""
    body = json.dumps(manifest).encode()
    path.write_bytes(archive.HEADER.pack(archive.MAGIC, manifest["version"], 0, len(body),
                                         xxhash.xxh3_64_intdigest(body)) + body + payload)
    return path


# -- refusals -----------------------------------------------------------------------------------------------
def _missing(s: dict) -> None:
    del s["weights"]


FORGED_V5 = {
    "missing": (_missing, "session.weights missing"),
    "unknown": (lambda s: s.update(weights="int4"), "unknown session.weights 'int4'"),
    "capitalized": (lambda s: s.update(weights="Stored"), "unknown session.weights 'Stored'"),
    "null": (lambda s: s.update(weights=None), "unknown session.weights None"),
    "number": (lambda s: s.update(weights=8), "unknown session.weights 8"),
    "list": (lambda s: s.update(weights=["stored"]), r"unknown session.weights \['stored'\]"),
    "long": (lambda s: s.update(weights="q" * 10_000), r"unknown session.weights 'q{30,}\.\.\. \(one of"),
}


@pytest.mark.parametrize("forge", FORGED_V5)
def test_a_version_5_manifest_without_known_weights_is_refused(tmp_path, forge):
    edit, message = FORGED_V5[forge]
    manifest, payload = parts(GOLDEN / "v5-bfloat16.kvs")
    edit(manifest["session"])
    with pytest.raises(CorruptData, match=message):
        archive.validate(manifest, len(payload), "v5.kvs")
    store = kvstore.open_store(tmp_path / "home")
    with pytest.raises(CorruptData, match=message):
        store.import_(write(tmp_path / "forged.kvs", manifest, payload))
    assert store.names() == [] and list(store.sessions_dir.iterdir()) == []
    store.close()


@pytest.mark.parametrize("version", [1, 2, 3, 4])
@pytest.mark.parametrize("weights", ["dense", "stored"])
def test_an_older_manifest_carrying_weights_is_refused(tmp_path, version, weights):
    """Versions 1 to 4 never wrote the field: one that has it was not written by kvstore."""
    manifest, payload = parts(GOLDEN / f"v{version}-float32.kvs")
    assert archive.validate(manifest, len(payload), "old.kvs") is manifest  # sound as it was written
    manifest["session"]["weights"] = weights
    with pytest.raises(CorruptData, match=f"session.weights in a version {version} archive"):
        archive.validate(manifest, len(payload), "old.kvs")
    store = kvstore.open_store(tmp_path / "home")
    with pytest.raises(CorruptData, match="session.weights"):
        store.import_(write(tmp_path / "forged.kvs", manifest, payload))
    assert store.names() == [] and list(store.sessions_dir.iterdir()) == []
    store.close()


@pytest.mark.parametrize("version", [True, 0, 6, "5", 5.0, None])
def test_a_manifest_of_an_unknown_version_is_refused_by_validate(version):
    """`read_manifest` refuses another header version; `validate` checks the manifest's own too."""
    manifest, payload = parts(GOLDEN / "v5-float32.kvs")
    manifest["version"] = version
    with pytest.raises(CorruptData, match="unknown format version"):
        archive.validate(manifest, len(payload), "v.kvs")


# -- a real (tiny) GGUF model, every way of holding its weights ---------------------------------------------
@pytest.fixture(scope="module")
def models(tiny) -> dict:
    path, _ = tiny("llama-gqa").gguf(Q.Q8_0)
    return {w: kvstore.load_model(path, weights=w) for w in kvstore.WEIGHT_FORMATS}


def exported(tmp_path: Path, model) -> tuple[Path, list[dict]]:
    """(archive, trace of 8 tokens the session generates after the export) of a session made with
    `model`: the continuation an import must reproduce."""
    store = kvstore.open_store(tmp_path / "home")
    with store.new("q", model, seed=1) as s:
        s.append_text(H.DOCUMENT[:200])
    store.export("q", tmp_path / "q.kvs")
    with store.open("q", model) as s:
        list(s.generate(8, trace=tmp_path / "ref.jsonl", stop_at_eos=False))
    store.close()
    return tmp_path / "q.kvs", H.read_trace(tmp_path / "ref.jsonl")


def continues_only_its_own_way(store, name: str, weights: str, models: dict, reference: list[dict],
                               trace: Path) -> None:
    for other in set(models) - {weights}:
        with pytest.raises(ModelMismatch, match=f"weights held '{weights}'.*holds them '{other}'"):
            store.open(name, models[other])
    with store.open(name, models[weights]) as s:
        list(s.generate(8, trace=trace, stop_at_eos=False))
    assert H.read_trace(trace) == reference
    with store.open(name) as s:  # no model given: loaded the session's way, from its record
        assert s.model.weights == weights


@pytest.mark.parametrize("weights", kvstore.WEIGHT_FORMATS)
def test_an_exported_session_keeps_how_its_model_held_the_weights(tmp_path, models, weights):
    path, reference = exported(tmp_path, models[weights])
    manifest, _ = parts(path)
    assert manifest["version"] == archive.VERSION == 5 and manifest["session"]["weights"] == weights
    other = kvstore.open_store(tmp_path / "other")
    for wrong in set(models) - {weights}:
        with pytest.raises(ModelMismatch, match=f"held '{weights}', this model holds them '{wrong}'"):
            other.import_(path, model=models[wrong])
        assert other.names() == [] and list(other.sessions_dir.iterdir()) == []
    assert other.import_(path) == "q"
    assert other.info("q").weights == weights
    continues_only_its_own_way(other, "q", weights, models, reference, tmp_path / "again.jsonl")
    assert other.import_(path, name="with-model", model=models[weights]) == "with-model"
    other.close()


def test_kvstore_import_of_a_stored_weights_session_opens_only_with_stored_weights(tmp_path, models):
    path, reference = exported(tmp_path, models["stored"])
    result = CliRunner().invoke(cli, ["import", str(path), "--as", "copy"])
    assert result.exit_code == 0, result.output
    store = kvstore.open_store()  # the CLI's home (conftest: a private one per test)
    assert store.info("copy").weights == "stored"
    continues_only_its_own_way(store, "copy", "stored", models, reference, tmp_path / "cli.jsonl")
    store.close()


def test_a_version_4_archive_is_a_dense_session(tmp_path, models):
    """The same session written as version 4 wrote it (no `weights`): imported as "dense", it continues
    with dense weights exactly as the dense original does, and a stored-weights model is refused."""
    path, reference = exported(tmp_path, models["dense"])
    manifest, payload = parts(path)
    del manifest["session"]["weights"]
    manifest["version"] = 4
    old = write(tmp_path / "v4.kvs", manifest, payload)
    other = kvstore.open_store(tmp_path / "other")
    with pytest.raises(ModelMismatch, match="held 'dense', this model holds them 'stored'"):
        other.import_(old, model=models["stored"])
    assert other.import_(old) == "q" and other.info("q").weights == "dense"
    continues_only_its_own_way(other, "q", "dense", models, reference, tmp_path / "v4.jsonl")
    other.close()
