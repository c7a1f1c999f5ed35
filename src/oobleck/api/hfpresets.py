"""Built-in Hugging Face configs (config.json fields) and their sizes, without torch or transformers.

The API names the presets (model.transformers.preset), the runtime builds them (runtime/models/hf.py), and the
operator estimates a profile from their sizes before the workers measure one (operator/decide.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def _gpt3(layers: int, hidden: int, heads: int) -> dict[str, Any]:
    # Brown et al. 2020, table 2.1 (the sizes the Oobleck paper trains), as GPT-2 configs: context
    # 2048, the GPT-2 BPE vocabulary, tied embeddings, no dropout.
    return {
        "model_type": "gpt2",
        "n_layer": layers,
        "n_embd": hidden,
        "n_head": heads,
        "n_positions": 2048,
        "vocab_size": 50257,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }


PRESETS: dict[str, dict[str, Any]] = {
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    # Trains on a 2-core CPU in tens of milliseconds per step; grouped-query attention exercised.
    "llama-tiny": {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32,
        "tie_word_embeddings": False,
    },
}


@dataclass(frozen=True)
class Sizes:
    """What a size estimate needs from a config.json."""

    blocks: int
    hidden: int
    heads: int
    vocab: int
    positions: int


# config.json spells the same size differently per family (GPT-2: n_layer, ...; Llama: num_hidden_layers, ...)
_KEYS = {
    "blocks": ("num_hidden_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd"),
    "heads": ("num_attention_heads", "n_head"),
    "vocab": ("vocab_size",),
    "positions": ("max_position_embeddings", "n_positions"),
}
_DEFAULTS = {  # the config classes' defaults, for fields a config.json leaves out
    "gpt2": {"blocks": 12, "hidden": 768, "heads": 12, "vocab": 50257, "positions": 1024},
    "llama": {"blocks": 32, "hidden": 4096, "heads": 32, "vocab": 32000, "positions": 2048},
}


def sizes(fields: dict[str, Any], family: str) -> Sizes:
    """The sizes of a config (fields absent from it take the family's defaults)."""
    defaults = _DEFAULTS["gpt2" if family == "gpt2" else "llama"]
    found = {}
    for size, keys in _KEYS.items():
        value = next((fields[k] for k in keys if k in fields), defaults[size])
        found[size] = int(value)
    return Sizes(**found)
