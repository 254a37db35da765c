"""The library's defaults, named once (no imports: the CLI's --help, the store and the engine all
read them without loading anything else). Below the engine and the store, like `errors`."""

VERSION = "0.1.0"  # kvstore's own (pyproject.toml's `version`; tests/test_layers.py keeps them equal)
DEFAULT_MODEL = "smollm2"  # the alias `load_model` pulls when no model is named (`engine.pull.ALIASES`)
DTYPE_NAMES = ("bfloat16", "float32", "float16")  # the weights and KV dtypes a model loads in
DEFAULT_DTYPE = "bfloat16"
# how a model's weight matrices are held and multiplied (`load_model(weights=)`, the CLI's --weights):
# "stored": a GGUF file's block-quantized types as they are (Q4_0, Q4_1, Q8_0; others dequantized),
# "dense": every weight dequantized into the model's dtype, "q8_0": every matrix quantized to Q8_0 on load.
# The default (None) is "stored" wherever the native quantized kernels run, else "dense".
WEIGHT_FORMATS = ("stored", "dense", "q8_0")
DEFAULT_CHUNK = 512  # prefill chunk, in tokens: boundaries at its multiples in absolute positions
DEFAULT_MAX_NEW_TOKENS = 256  # tokens one generation call makes at most
DEFAULT_CHECKPOINT_EVERY = 16  # generated tokens between automatic checkpoints
