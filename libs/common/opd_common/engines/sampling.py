"""Per-sample seeds and batch-independent sampling (pure functions).

Every sample gets its own seed, derived from ``--seed``, the prompt id and the sample index, so a
sample never depends on which other prompts share its batch. The hf engine turns (seed, step) into
one uniform number with a counter-based hash and samples by inverse CDF: the same seed, step
and logits always pick the same token, on CPU or GPU, in any batch, with no RNG state.
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


def uniform_per_row(seeds_B, step):
    """One uniform in (0, 1) per row from (seed, step); `step` may be an int or a 1-element tensor."""
    import torch

    key_B = hash32(seeds_B ^ hash32(seeds_B * 0 + step + 0x9E3779B9))
    return ((hash32(key_B ^ 0x5BD1E995) >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


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


def sample_tokens(logits_BV, seeds_B, step, temperature: float, top_k: int, top_p: float):
    """Pick one token per row: greedy at temperature 0, else inverse-CDF sampling of
    softmax(masked logits / T) with the row's own uniform (uniform_per_row).

    Batch-independent and deterministic: a row's token depends only on its logits, seed and step.
    Zero-probability tokens (masked by top-k/top-p) are never chosen.
    """
    import torch

    if temperature <= 0:
        return logits_BV.argmax(dim=-1)
    scaled = mask_logits(logits_BV.float() / temperature, top_k, top_p)
    cdf_BV = torch.softmax(scaled, dim=-1).cumsum(dim=-1)
    u_B1 = (uniform_per_row(seeds_B, step) * cdf_BV[:, -1])[:, None]
    return torch.searchsorted(cdf_BV, u_B1, right=True)[:, 0].clamp(max=logits_BV.shape[-1] - 1)
