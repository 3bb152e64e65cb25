"""Model and tokenizer loading, and chat rendering: the one place prompts become token ids."""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import ConfigError, require


def check_model_ref(model: str, flag: str = "--model") -> None:
    """Fail early and clearly for a local model path that does not exist or is not a model."""
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ConfigError(f"{flag} {model}: the directory has no config.json (is it a transformers model folder?)")
    elif model.startswith(("/", ".", "~")):
        raise ConfigError(f"{flag} {model}: no such model directory")


def load_tokenizer(model: str, revision: str | None = None):
    require("transformers", "hf")
    from transformers import AutoTokenizer

    check_model_ref(model)
    try:
        return AutoTokenizer.from_pretrained(model, revision=revision)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model}: cannot load its tokenizer ({str(exc).splitlines()[0]})") from None


def pick_device(device: str) -> str:
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def pick_dtype(dtype: str, device: str, model: str | None = None):
    """'auto' = bfloat16 on GPU, the checkpoint's own dtype (float32 for tiny models) on CPU."""
    import torch

    if dtype != "auto":
        return getattr(torch, dtype)
    return torch.bfloat16 if device.startswith("cuda") else torch.float32


def load_causal_lm(model: str, revision: str | None, dtype, device: str, adapter: str | None = None):
    """AutoModelForCausalLM in eval mode on `device`, with a peft LoRA adapter applied if given."""
    require("transformers", "hf")
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not sys.stderr.isatty():  # no "Loading weights" bar in logs and pipes (STYLE.md: progress)
        hf_logging.disable_progress_bar()
    check_model_ref(model)
    try:
        lm = AutoModelForCausalLM.from_pretrained(model, revision=revision, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model}: cannot load it ({str(exc).splitlines()[0]})") from None
    if adapter:
        if not (Path(adapter) / "adapter_config.json").exists():
            raise ConfigError(f"--adapter {adapter}: no adapter_config.json there (expected a peft LoRA folder)")
        require("peft", "hf")
        from peft import PeftModel

        lm = PeftModel.from_pretrained(lm, adapter)
    return lm.to(device).eval()


def render_chat(tokenizer, user_message: str, thinking: bool) -> list[int]:
    """Apply the chat template once (one user turn + generation prompt) and tokenize."""
    return render_messages(tokenizer, [{"role": "user", "content": user_message}], thinking)


def render_messages(tokenizer, messages: list[dict[str, str]], thinking: bool) -> list[int]:
    """Apply the chat template once to a conversation (system turns kept) + generation prompt, and tokenize.

    ``thinking`` is passed as ``enable_thinking`` (Qwen3 templates honour it; others ignore it).
    The text is tokenized without adding special tokens again: the template already has them.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=thinking)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


GQA_ATTENTION = "opd_gqa_sdpa"


def gqa_sdpa_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """SDPA for grouped-query attention with an explicit mask, without copying K/V per head.

    transformers' sdpa path repeats K/V to every query head when a mask is given (a full copy of
    the KV cache per layer and step: most of a decode step's time at batch 128). Here the g query
    heads that share a KV head are folded into the query-length axis instead, which is exact:
    query head h uses KV head h // g (as repeat_kv does). Shapes: query [B, H, Q, D], key/value
    [B, Hkv, L, D], mask [B, 1, Q, L] (bool, True = visible) or None (causal) -> output [B, Q, H, D].
    """
    import torch
    import torch.nn.functional as F

    B, H, Q, D = query.shape
    if attention_mask is None:  # plain causal (right-padded or unpadded batches): fused kernels
        causal = Q > 1
        if torch.compiler.is_compiling():  # a symbolic Q makes `Q > 1` a SymBool, which breaks the graph at
            # every layer (each then recompiled on its own). Compiled callers without a mask (the trainer's and
            # scorer's forwards) have no KV cache: keys = queries, so causal is exact at any Q, 1 included.
            torch._check(key.shape[2] == Q, lambda: "a compiled forward without a mask must not use a KV cache")
            causal = True
        out = F.scaled_dot_product_attention(query, key, value, scale=scaling, is_causal=causal,
                                             enable_gqa=H != key.shape[1])
        return out.transpose(1, 2).contiguous(), None
    groups = H // key.shape[1]
    q = query.reshape(B, key.shape[1], groups * Q, D)
    mask = attention_mask.repeat(1, 1, groups, 1) if groups > 1 else attention_mask
    if groups * Q <= 16:
        out = _decode_attention(q, key, value, mask, scaling if scaling is not None else D ** -0.5)
    else:
        out = F.scaled_dot_product_attention(q, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(B, H, Q, D).transpose(1, 2).contiguous(), None


def _decode_attention(q, key, value, mask, scale: float):
    """Attention for a few query rows as two batched matmuls (bandwidth-bound: K and V read once).

    Fused SDPA kernels are tuned for long queries; at decode (a handful of rows per KV head)
    this plain form reads the cache once and was 3x faster on an H200 (benchmarks/bench_hf_gpu.py).
    """
    import torch

    scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(value.dtype), value)


def use_gqa_attention(model) -> None:
    """Switch a loaded transformers model to gqa_sdpa_attention (registered once)."""
    from transformers import AttentionInterface

    AttentionInterface.register(GQA_ATTENTION, gqa_sdpa_attention)
    model.set_attn_implementation(GQA_ATTENTION)
