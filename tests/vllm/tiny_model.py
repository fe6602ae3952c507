"""A tiny Qwen3 model directory for vLLM's real engine: a config, random weights.

No hub is reachable from the test machines, so the model is made here: two layers,
hidden 128, 4 heads, 2 KV heads, head_dim 64, vocabulary 1,024. vLLM loads it with
``load_format="dummy"`` (random weights, seeded) and ``skip_tokenizer_init=True``: the
tests send token ids and compare token ids, so no tokenizer is needed.

One KV block of 32 tokens (vLLM's CPU attention wants a multiple of 32) is
2 layers x (K, V) x 2 heads x 64 x 32 x 2 bytes = 32 KiB.
"""

from __future__ import annotations

import json
from pathlib import Path

BLOCK_TOKENS = 32
BLOCK_BYTES = 2 * 2 * 2 * 64 * BLOCK_TOKENS * 2
VOCAB = 1024

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def write_model(directory: Path) -> Path:
    """Write the model's config into ``directory`` (created) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(CONFIG, indent=2))
    return directory
