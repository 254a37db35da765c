"""The tiny trained model (`kvstore.train`): it trains through the engine's own forward, its loss
falls, it writes text, it is the same model in kvstore and in transformers, the same seed gives the
same bytes, and its folder never loads half-written.

Most tests use the session's `trained` fixture (conftest.py: the tests' size, seed 0, seconds);
the determinism tests train at a smaller size still.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

import kvstore
from kvstore.engine.models import llama
from kvstore.engine.weights import HF, source_name
from kvstore.train import Settings, corpus, folder as folder_mod, quality, train_folder
from kvstore.train.__main__ import main as train_main

pytestmark = pytest.mark.usefixtures("one_thread")
SMALLEST = Settings(vocab_size=300, hidden_size=32, n_layers=2, n_heads=4, n_kv_heads=2, intermediate_size=64,
                    context=32, steps=3, batch=1)
SMALLEST_FLAGS = ["--vocab-size", "300", "--hidden-size", "32", "--layers", "2", "--ffn-size", "64", "--context", "32",
                  "--steps", "3", "--batch", "1"]


def test_the_loss_falls(trained):
    first, last = trained.result.loss_ends()
    print(f"loss: {first:.3f} in the first 10 % of {len(trained.result.losses)} steps, {last:.3f} in the last")
    assert last < first - 1.0


def test_the_model_writes_text_the_untrained_one_does_not(trained):
    model = kvstore.load_model(trained.folder, dtype="float32")
    ours = quality.text_likeness(model, trained.docs)
    baseline = quality.text_likeness(quality.untrained(model, trained.result.initial), trained.docs)
    print(f"text-likeness: trained {ours}, {ours.n_distinct} distinct; untrained {baseline}")
    assert ours.n_words >= 100 and baseline.n_words >= 40
    assert ours.share >= max(0.3, 3 * baseline.share)  # here: 47 % against 9 %
    assert ours.n_distinct >= 30  # not one word said over and over


def test_kvstore_and_transformers_give_the_same_logits(trained):
    from transformers import AutoModelForCausalLM

    ours = kvstore.load_model(trained.folder, dtype="float32")
    hf = AutoModelForCausalLM.from_pretrained(trained.folder, dtype=torch.float32).eval()
    assert hf.config.num_key_value_heads < hf.config.num_attention_heads
    ids = ours.tokenizer.encode(corpus.document(2000))[:ours.config.max_context]
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0].float()
    assert_close(ours.logits(ids), reference)


def test_the_file_holds_the_trained_tensors_under_the_engines_names(trained):
    from safetensors.torch import load_file

    stored = load_file(trained.folder / "model.safetensors")
    cfg = kvstore.load_model(trained.folder, dtype="float32").config
    assert cfg == trained.result.config
    assert set(stored) == {source_name(llama, ours, HF) for ours in llama.shapes(cfg)}
    for ours, tensor in trained.result.weights.items():
        assert torch.equal(stored[source_name(llama, ours, HF)], tensor), ours


def test_training_runs_the_engines_forward_whose_gradients_are_transformers(tiny):
    """No training twin: the loss and the gradient of every weight, computed through
    `llama.Llama(cfg, leaves).forward` as the loop does, equal transformers' on the same weights."""
    m = tiny("llama-gqa")
    cfg = kvstore.load_model(m.folder, dtype="float32").config
    hf_params = dict(m.hf.named_parameters())
    leaves = {ours: hf_params[source_name(llama, ours, HF)].detach().clone().requires_grad_()
              for ours in llama.shapes(cfg)}
    ids = torch.tensor(m.ids(65))
    loss = F.cross_entropy(llama.Llama(cfg, leaves).forward(ids[:-1], 0, None, last_only=False), ids[1:])
    loss.backward()
    m.hf.zero_grad()
    reference = F.cross_entropy(m.hf(ids[None, :-1]).logits[0], ids[1:])
    reference.backward()
    assert_close(loss, reference)
    for ours, leaf in leaves.items():
        assert_close(leaf.grad, hf_params[source_name(llama, ours, HF)].grad, msg=ours)
    m.hf.zero_grad()


def test_the_same_seed_gives_the_same_bytes_in_another_process_another_seed_others(tmp_path):
    train_folder(tmp_path / "a", SMALLEST)
    done = subprocess.run([sys.executable, "-m", "kvstore.train", "--out", str(tmp_path / "b"), "--quiet",
                           *SMALLEST_FLAGS], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    train_folder(tmp_path / "c", Settings(**{**vars(SMALLEST), "seed": 1}))
    weights = {name: (tmp_path / name / "model.safetensors").read_bytes() for name in "abc"}
    assert weights["a"] == weights["b"] != weights["c"]
    for f in folder_mod.FILES:
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes(), f


def test_the_folder_is_a_chat_model_with_two_ends_of_sequence(trained):
    from transformers import AutoTokenizer

    model = kvstore.load_model(trained.folder)
    tok = model.tokenizer
    ids = {t: tok.backend.token_to_id(t) for t in corpus.SPECIAL_TOKENS}
    assert list(ids.values()) == [0, 1, 2] and tok.eos_ids == {ids["<|im_end|>"], ids["<|endoftext|>"]}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "heapq.merge"}]
    text = tok.render_chat(messages)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nheapq.merge<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    assert tok.encode(text).count(ids["<|im_start|>"]) == 3
    hf = AutoTokenizer.from_pretrained(trained.folder)
    assert hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == text
    sample = corpus.document(3000)
    assert hf.encode(sample, add_special_tokens=False) == tok.encode(sample)
    assert tok.decode(tok.encode(sample)) == sample


def test_a_killed_write_leaves_a_folder_that_does_not_load(trained, tmp_path, monkeypatch):
    out = tmp_path / "model"
    folder_mod.write(out, trained.result, "0" * 64)
    assert kvstore.load_model(out).config.n_layers == trained.result.config.n_layers
    written = []

    def dies_on_the_weights(path, data):
        if path.name == "model.safetensors":
            raise KeyboardInterrupt  # as a kill would, after the tokenizer files
        written.append(path.name)
        real_write(path, data)

    real_write = folder_mod._write
    monkeypatch.setattr(folder_mod, "_write", dies_on_the_weights)
    with pytest.raises(KeyboardInterrupt):
        folder_mod.write(out, trained.result, "1" * 64)
    assert "tokenizer.json" in written and not (out / "config.json").exists()
    with pytest.raises(kvstore.errors.ModelError, match="no config.json"):
        kvstore.load_model(out)
    monkeypatch.undo()
    folder_mod.write(out, trained.result, "1" * 64)  # the next run writes it whole
    assert json.loads((out / "training.json").read_text())["text_sha256"] == "1" * 64
    kvstore.load_model(out)


def test_a_folder_with_other_files_is_refused(trained, tmp_path):
    (tmp_path / "other.safetensors").write_bytes(b"")
    with pytest.raises(kvstore.errors.InvalidArgument, match="did not write"):
        folder_mod.write(tmp_path, trained.result, "0" * 64)
    assert not (tmp_path / "config.json").exists()


def test_the_command_shows_the_loss_and_reports(tmp_path):
    env = {**os.environ, "COLUMNS": "100"}
    done = subprocess.run([sys.executable, "-m", "kvstore.train", "--out", str(tmp_path / "m"), *SMALLEST_FLAGS],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert "training" in done.stderr and "3/3" in done.stderr and "loss" in done.stderr  # the progress bar
    assert "loss" in done.stdout and "in the last 10 %" in done.stdout and "text-likeness" in done.stdout
    assert kvstore.load_model(tmp_path / "m").config.n_kv_heads == 2


@pytest.mark.parametrize("flags, message", [(["--kv-heads", "3"], "group evenly"), (["--steps", "0"], "positive"),
                                            (["--context", "10000000"], "longer one")])
def test_the_command_refuses_bad_settings_in_one_line(tmp_path, capsys, flags, message):
    assert train_main(["--out", str(tmp_path / "m"), "-q", *SMALLEST_FLAGS, *flags]) == 1
    err = capsys.readouterr().err
    assert err.startswith("Error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "m" / "config.json").exists()


def test_a_text_file_trains_too(tmp_path):
    text = "\n\n".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog, again and again." * 3
                       for i in range(60))
    (tmp_path / "fox.txt").write_text(text)
    assert train_main(["--text", str(tmp_path / "fox.txt"), "--out", str(tmp_path / "fox"), "-q", *SMALLEST_FLAGS]) == 0
    training = json.loads((tmp_path / "fox" / "training.json").read_text())
    assert training["text_sha256"] == folder_mod.sha256(text) and len(training["losses"]) == 3


def test_texts_are_cut_into_documents_at_headings_else_at_blank_lines():
    sections = corpus.document(5000)
    docs = corpus.documents(sections)
    assert docs[0].title == "heapq" and docs[0].body.startswith("Heap queue algorithm")
    assert [d.raw() for d in docs[:3]] == [d.raw() for d in list(corpus.stdlib_documents())[:3]]
    assert corpus.documents("one\ntwo\n\n\nthree\n") == [corpus.Document("", "one\ntwo"), corpus.Document("", "three")]
    assert corpus.documents("intro\n\nTitle\n-----\nbody\n") == [corpus.Document("", "intro"),
                                                                  corpus.Document("Title", "body")]
    chat = docs[0].chat()
    assert chat.startswith("<|im_start|>user\nheapq<|im_end|>\n<|im_start|>assistant\nHeap queue")
    assert chat.endswith("<|im_end|>\n")


def test_examples_stdlib_text_is_the_trainers_text():
    sys.path.insert(0, str(folder_mod.Path(__file__).resolve().parent.parent / "examples"))
    import stdlib_text

    assert stdlib_text.document(20_000) == corpus.document(20_000)
