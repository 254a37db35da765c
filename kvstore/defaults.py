"""The library's defaults, named once (no imports: the CLI's --help, the store and the engine all
read them without loading anything else). Below the engine and the store, like `errors`."""

VERSION = "0.1.0"  # kvstore's own (pyproject.toml's `version`; tests/test_layers.py keeps them equal)
DEFAULT_MODEL = "smollm2"  # the alias `load_model` pulls when no model is named (`engine.pull.ALIASES`)
DTYPE_NAMES = ("bfloat16", "float32", "float16")  # the weights and KV dtypes a model loads in
DEFAULT_DTYPE = "bfloat16"
DEFAULT_CHUNK = 512  # prefill chunk, in tokens: boundaries at its multiples in absolute positions
DEFAULT_MAX_NEW_TOKENS = 256  # tokens one generation call makes at most
DEFAULT_CHECKPOINT_EVERY = 16  # generated tokens between automatic checkpoints
