"""Tiny causal LMs built offline: a random Qwen3 plus a small trained byte-level BPE tokenizer.

``build_tiny(out_dir, seed=0)`` writes a folder that ``AutoModelForCausalLM``, ``AutoTokenizer``
and ``vllm.LLM`` all load: Qwen3 architecture (head_dim 32, which vLLM's CPU attention needs),
float32 weights, a byte-level BPE tokenizer trained on bundled MATH text, and a Qwen3-style chat
template that honours ``enable_thinking`` (False appends an empty ``<think>\\n\\n</think>\\n\\n``
block to the generation prompt, as Qwen3 does).

Random weights never stop on their own, so the builder gives EOS (``<|im_end|>``) a calibrated
"bias": residual-stream dimension 0 is a constant carried by every embedding and written by no
layer, and the EOS row of the untied LM head reads it. ``eos_prob`` sets the mean per-step
probability of EOS (default 1/24, responses of a few dozen tokens). Everything is deterministic
in ``seed``: the same call writes byte-identical weights.
"""

from __future__ import annotations

import json
from pathlib import Path

from .datasets import data_path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def _corpus(max_rows: int) -> list[str]:
    texts = []
    with open(data_path("train_math_full.jsonl"), "rb") as f:
        import orjson

        for i, line in enumerate(f):
            if i >= max_rows:
                break
            row = orjson.loads(line)
            texts.append(row["problem"])
            texts.append(row["solution"])
    texts.append("Problem: Please reason step by step, and put your final answer within \\boxed{}.")
    return texts


def build_tokenizer(vocab_size: int = 2048, corpus_rows: int = 1500, split_digits: bool = False):
    """Train a byte-level BPE on bundled MATH text; returns a PreTrainedTokenizerFast.

    ``split_digits`` makes every digit its own token (as Qwen's tokenizers do), for arithmetic.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    if split_digits:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(corpus_rows), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, chat_template=CHAT_TEMPLATE,
        additional_special_tokens=["<|im_start|>", "<think>", "</think>"],
    )


def _calibrate_eos(model, eos_id: int, eos_prob: float, seed: int) -> None:
    """Set lm_head[eos, 0] so that the mean per-step EOS probability is about eos_prob."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=gen)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # [B, L, H], after the final norm
        weight = model.lm_head.weight
        weight[eos_id].zero_()
        logits = hidden @ weight.T
        logits[..., eos_id] = float("-inf")
        rest = torch.logsumexp(logits, dim=-1)  # log-sum of all other tokens
        h0 = hidden[..., 0]
        lo, hi = -50.0, 50.0
        for _ in range(60):  # bisection on the mean EOS probability, monotone in b
            b = (lo + hi) / 2
            eos_logit = b * h0
            p = torch.sigmoid(eos_logit - rest).mean().item()
            lo, hi = (b, hi) if p < eos_prob else (lo, b)
        weight[eos_id, 0] = (lo + hi) / 2


def build_model(tokenizer, seed: int = 0, hidden_size: int = 64, layers: int = 2, heads: int = 2,
                kv_heads: int = 1, intermediate_size: int = 128, init_std: float = 0.3,
                eos_prob: float = 1 / 24, max_positions: int = 4096):
    """A random float32 Qwen3ForCausalLM with the EOS bias described in the module docstring."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    config = Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=32,
        max_position_embeddings=max_positions, tie_word_embeddings=False, rms_norm_eps=1e-6,
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.02, rope_theta=10000.0,
    )
    config.dtype = "float32"
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                continue
            param.copy_(torch.randn(param.shape, generator=gen)
                        * (init_std if "embed" in name or "lm_head" in name else 0.05))
        model.model.embed_tokens.weight[:, 0] = 1.0  # the constant dimension 0
        model.lm_head.weight[:, 0] = 0.0
        for layer in model.model.layers:  # no layer writes dimension 0
            layer.self_attn.o_proj.weight[0].zero_()
            layer.mlp.down_proj.weight[0].zero_()
    _calibrate_eos(model, eos_id, eos_prob, seed)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.do_sample = True
    return model


def build_tiny(out_dir: str | Path, seed: int = 0, split_digits: bool = False, **model_kwargs) -> Path:
    """Build and save a tiny model + tokenizer folder; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(split_digits=split_digits)
    model = build_model(tokenizer, seed=seed, **model_kwargs)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    recipe = {"seed": seed, **({"split_digits": True} if split_digits else {}), **model_kwargs}
    (out / "opd_tiny.json").write_text(json.dumps(recipe, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    """python -m opd_common.tiny OUT_DIR [--seed N]: build a tiny model folder."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m opd_common.tiny", description=main.__doc__)
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny(args.out_dir, seed=args.seed)
    import sys

    print(f"tiny model written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
