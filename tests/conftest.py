"""Shared fixtures: a private kvstore home per test, tiny random models, the tiny trained model, the
real SmolLM2 GGUF, a PostgreSQL server for the index tests on that database.

Tiny models are built once per test session, on first use (see `engine_models.py`). The per-user
models folder ($KVSTORE_MODELS: pulled models, converted weights, file hashes) is one temporary
folder for the whole session. The real model is pulled once into $KVSTORE_TEST_MODELS when that
names a folder (scripts/test.sh points it at the user's own models folder, so a machine downloads
it once), else into the session's folder; transformers' reference of it is loaded once per session.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

import engine_models  # noqa: E402
import kvstore  # noqa: E402
import pg_server  # noqa: E402

TEST_MODELS_ENV = "KVSTORE_TEST_MODELS"  # where the real model is pulled (and found again)
SESSION_MODELS = Path(tempfile.mkdtemp(prefix="kvstore-test-models-"))  # $KVSTORE_MODELS of every test


def pytest_configure(config):
    os.environ["KVSTORE_MODELS"] = str(SESSION_MODELS)


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_MODELS, ignore_errors=True)


def pytest_report_header(config):
    """Which kernels run bfloat16 models here (builds the native ones first, outside any test's time)."""
    from kvstore.engine import native

    return f"kvstore bfloat16 kernels: {native.status()}"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _private_home(tmp_path, monkeypatch):
    """Nothing a test does lands in the user's kvstore home or index database."""
    monkeypatch.setenv("KVSTORE_HOME", str(tmp_path / "kvstore-home"))
    monkeypatch.setenv("KVSTORE_MODELS", str(SESSION_MODELS))
    monkeypatch.delenv("KVSTORE_INDEX", raising=False)


@pytest.fixture(scope="session")
def postgres():
    """A PostgreSQL server for this test session (tests/pg_server.py); skips with the reason if none."""
    reason = pg_server.unavailable()
    if reason:
        pytest.skip(f"PostgreSQL: {reason}")
    server = pg_server.Server()
    server.start()
    yield server
    server.stop()


@pytest.fixture
def pg_url(postgres) -> str:
    """The URL of a new, empty PostgreSQL database."""
    return postgres.new_database()


@contextmanager
def threads(n: int):
    """Torch on n CPU threads inside the block."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def single_thread():
    """Torch on one CPU thread: float32 with two threads flips between a fast and a several times
    slower mode on these machines, worse when cores are shared; one thread is steady. Only for work
    compared inside one process (the thread count changes bf16 bits)."""
    return threads(1)


@pytest.fixture
def one_thread():
    with single_thread():
        yield


# -- tiny random models --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model_path(tiny) -> str:
    """The tiny Llama with grouped-query attention that the store tests run on (a Hugging Face folder)."""
    return str(tiny("llama-gqa").folder)


@pytest.fixture(scope="module")
def model(model_path):
    """That model, loaded (once per test module)."""
    return kvstore.load_model(model_path)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return engine_models.build_tokenizer()


@pytest.fixture(scope="session")
def tiny(tmp_path_factory, tiny_tokenizer):
    """`tiny(name)` -> engine_models.TinyModel, built once per session (names: engine_models.SPECS)."""
    built: dict[str, engine_models.TinyModel] = {}
    workdir = tmp_path_factory.mktemp("tiny-models")

    def get(name: str) -> engine_models.TinyModel:
        if name not in built:
            built[name] = engine_models.build_tiny_model(name, workdir, tiny_tokenizer)
        return built[name]

    return get


# -- the tiny trained model ----------------------------------------------------------------------
@dataclass
class Trained:
    folder: Path  # the Hugging Face folder
    result: object  # kvstore.train.Result: settings, weights (trained and initial), losses
    docs: list  # the documents it was trained on (kvstore.train.Document)


# the tests' size: the default's kind (GQA, rotary, RMSNorm, SwiGLU), 2 layers instead of 4, half the
# context: about 10 s on one thread here
TRAINED_FOR_TESTS = dict(vocab_size=400, hidden_size=64, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=128,
                         context=128, steps=600, batch=4, lr=4e-3, short_steps=0.8, seed=0)


@pytest.fixture(scope="session")
def trained(tmp_path_factory) -> Trained:
    """The tiny model trained here (`kvstore.train`) at the tests' size on the standard library's
    docstrings, once per session (one thread, seed 0)."""
    from kvstore.train import Settings, train_folder

    folder = tmp_path_factory.mktemp("trained") / "model"
    result, docs = train_folder(folder, Settings(**TRAINED_FOR_TESTS))
    return Trained(folder, result, docs)


# -- the real model ------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real model's GGUF: pulled into $KVSTORE_TEST_MODELS when set (found there next time), else
    into the session's models folder."""
    shared = os.environ.get(TEST_MODELS_ENV)
    if not shared:
        return kvstore.pull("smollm2", quiet=True)
    before = os.environ["KVSTORE_MODELS"]
    os.environ["KVSTORE_MODELS"] = shared
    try:
        return kvstore.pull("smollm2", quiet=True)
    finally:
        os.environ["KVSTORE_MODELS"] = before


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """Our SmolLM2, float32, its weights dequantized (the reference comparisons need it: transformers
    reads the GGUF dequantized)."""
    import kvstore

    return kvstore.load_model(smollm2_path, dtype="float32", weights="dense")


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """transformers' SmolLM2 from the same GGUF (dequantized), float32, eval mode."""
    from transformers import AutoModelForCausalLM

    with single_thread():
        model = AutoModelForCausalLM.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name,
                                                     dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def kit(tmp_path_factory, tiny):
    """The crash-torture kit (tests/faults_kit.py) on the tiny GQA Llama, on one torch thread
    (deterministic and fast for its many short runs); one per test module."""
    from faults_kit import Kit

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Kit(tmp_path_factory, str(tiny("llama-gqa").folder))
    torch.set_num_threads(before)
