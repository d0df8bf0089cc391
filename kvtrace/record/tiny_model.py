"""A tiny random-weight Llama for recording real vLLM traces without downloads.

``ensure_tiny_model()`` builds the model once with transformers' ``save_pretrained``
(safetensors) into ``$KVTRACE_CACHE`` or ``~/.cache/kvtrace/tiny-llama`` and returns
the directory. The weights are seeded, so every build is identical. There is no
tokenizer: run vLLM with ``skip_tokenizer_init=True`` and give prompts as token ids.
"""

from __future__ import annotations

import os
from pathlib import Path

CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    intermediate_size=128,
    vocab_size=512,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    tie_word_embeddings=False,
)
SEED = 0
_MARKER = "kvtrace-tiny-llama.done"


def default_dir() -> Path:
    env = os.environ.get("KVTRACE_CACHE")
    if env:
        return Path(env)
    return Path.home() / ".cache" / "kvtrace" / "tiny-llama"


def ensure_tiny_model(path: str | os.PathLike | None = None) -> str:
    """Build the tiny Llama in ``path`` (default: ``default_dir()``) unless it is
    already there; return the directory as a string."""
    out = Path(path) if path is not None else default_dir()
    if (out / _MARKER).exists() and (out / "config.json").exists():
        return str(out)
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    cfg = LlamaConfig(**CONFIG)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / _MARKER).write_text("ok\n")
    return str(out)


if __name__ == "__main__":  # pragma: no cover
    print(ensure_tiny_model())
