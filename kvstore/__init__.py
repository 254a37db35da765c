"""kvstore: persistent, resumable LLM generation sessions.

Public surface: `load_model`, `pull`, `open_store`, the `errors` module, and the engine pieces
(`Sequence`, `SamplerSettings`, `KVCache`) for those who drive generation themselves.
"""

from . import errors
from .cache import KVCache
from .generate import Sequence, TokenEvent
from .model import Model, load_model
from .pull import pull
from .sampling import SamplerSettings
from .store import Store, open_store

__all__ = ["errors", "KVCache", "Sequence", "TokenEvent", "Model", "load_model", "pull", "SamplerSettings", "Store", "open_store"]
__version__ = "0.1.0"
