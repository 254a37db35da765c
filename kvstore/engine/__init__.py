"""The engine: text -> token ids -> model -> KV cache -> logits -> sampled ids, all in memory.

    tokenizer.py, chat.py    text <-> ids, the chat template and a new turn's ids
    config.py, weights.py    a model's shape and its tensors read from GGUF or safetensors files
    models/                  one module per architecture (llama.py, gpt2.py): config readers,
                             weight-name tables, forward / feed / head
    attention.py, ops.py,    the forward's pieces: attention over the cache, row-wise ops and the
    native/                  native bfloat16 kernels behind them
    cache.py, buffers.py     KVCache (one write path) and the memory it reuses
    sampling.py              the draw as a function of (seed, position)
    sequence.py              Sequence: prefill in chunks fixed by position, decode, generate
    model.py, pull.py,       load_model: files (pulled once per user) -> a Model with its
    weight_cache.py,         fingerprint; converted weights cached per user
    fingerprint.py
    trace.py                 one JSON line per generated token (the proof of byte-identity)

The engine knows nothing of the store: it imports only `kvstore.errors` and `kvstore.fileio`
(checked by import-linter, see pyproject.toml).
"""
