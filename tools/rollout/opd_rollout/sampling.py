"""Per-sample seeds and batch-independent sampling (pure functions).

Every sample gets its own seed, derived from ``--seed``, the prompt id and the sample index, so a
sample never depends on which other prompts share its batch. The hf engine turns that seed into
Gumbel noise with a counter-based hash of (seed, step, token id): the same seed, step and logits
always pick the same token, on CPU or GPU, in any batch.
"""

from __future__ import annotations

import hashlib

MASK32 = 0xFFFFFFFF


def derive_seed(base_seed: int, prompt_id: str, sample: int) -> int:
    """A 31-bit seed for one sample: sha256 of (base seed, prompt id, sample index)."""
    digest = hashlib.sha256(f"{base_seed}\x1f{prompt_id}\x1f{sample}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


def hash32(x):
    """lowbias32 integer hash on int64 tensors holding values in [0, 2**32) (elementwise)."""
    x = x & MASK32
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def gumbel_noise(seeds_B, step: int, token_hash_V):
    """Gumbel(0, 1) noise [B, V] from per-row seeds, the decode step and hashed token ids."""
    import torch

    key_B = hash32(seeds_B ^ hash32(torch.full_like(seeds_B, step + 0x9E3779B9)))
    bits_BV = hash32(key_B[:, None] ^ token_hash_V[None, :])
    uniform = ((bits_BV >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -torch.log(-torch.log(uniform))


def mask_logits(logits_BV, top_k: int, top_p: float):
    """Apply top-k (0 or -1 = off) and top-p (1.0 = off) by setting dropped logits to -inf."""
    import torch

    if top_k and 0 < top_k < logits_BV.shape[-1]:
        kth = torch.topk(logits_BV, top_k, dim=-1).values[..., -1:]
        logits_BV = logits_BV.masked_fill(logits_BV < kth, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(logits_BV, dim=-1, descending=True)
        cum_BV = torch.softmax(sorted_BV, dim=-1).cumsum(dim=-1)
        drop_sorted = (cum_BV - torch.softmax(sorted_BV, dim=-1)) >= top_p  # keep the first past p
        drop_BV = torch.zeros_like(drop_sorted).scatter(-1, order_BV, drop_sorted)
        logits_BV = logits_BV.masked_fill(drop_BV, float("-inf"))
    return logits_BV


def sample_tokens(logits_BV, seeds_B, step: int, token_hash_V, temperature: float, top_k: int, top_p: float):
    """Pick one token per row: greedy at temperature 0, else Gumbel-max of masked logits / T."""
    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    scaled = mask_logits(logits_BV.float() / temperature, top_k, top_p)
    return (scaled + gumbel_noise(seeds_B, step, token_hash_V)).argmax(dim=-1)
