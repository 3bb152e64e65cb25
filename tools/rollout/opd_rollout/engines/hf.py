"""The transformers engine: batched decoding with a KV cache and batch-independent sampling.

Prompts are left-padded into batches of ``--batch-size`` samples (sorted by prompt length, so
padding stays small). Each decode step takes the raw logits, records ``log_softmax`` of them
(the record's ``logprobs``/``topk_logprobs``, temperature 1) and samples with per-sample Gumbel
noise (``sampling.sample_tokens``), so a sample's tokens depend on its own seed only.
"""

from __future__ import annotations

import logging
import time

import numpy as np

from opd_common.errors import ConfigError
from opd_common.models import load_causal_lm, load_tokenizer, pick_device, pick_dtype

from ..sampling import hash32, sample_tokens
from .base import Completion, SampleRequest

log = logging.getLogger(__name__)


class HfEngine:
    name = "hf"

    def __init__(self, config):
        import torch

        self.config = config
        self.device = pick_device(config.device)
        self.dtype = pick_dtype(config.dtype, self.device, config.model)
        self.tokenizer = load_tokenizer(config.model, config.revision)
        self.model = load_causal_lm(config.model, config.revision, self.dtype, self.device, config.adapter)
        self.stop_ids = self._stop_ids()
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.token_hash_V = hash32(torch.arange(vocab, dtype=torch.int64, device=self.device))
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        self.tokens_generated = 0
        self.seconds = 0.0

    def _stop_ids(self) -> list[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None)
        if eos is not None:
            ids.update(int(e) for e in ([eos] if isinstance(eos, int) else eos))
        if not ids:
            raise ConfigError(f"--model {self.config.model}: the tokenizer defines no eos_token; cannot tell when to stop")
        return sorted(ids)

    def generate(self, requests: list[SampleRequest]) -> list[Completion]:
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        results: list[Completion | None] = [None] * len(requests)
        size = self.config.batch_size
        for start in range(0, len(order), size):
            idx = order[start:start + size]
            for i, completion in zip(idx, self._generate_batch([requests[i] for i in idx]), strict=True):
                results[i] = completion
        return results  # type: ignore[return-value]

    def _prefill(self, requests: list[SampleRequest]):
        import torch

        width = max(len(r.prompt_ids) for r in requests)
        ids_BP = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask_BP = torch.zeros((len(requests), width), dtype=torch.long)
        for row, req in enumerate(requests):
            n = len(req.prompt_ids)
            ids_BP[row, width - n:] = torch.tensor(req.prompt_ids, dtype=torch.long)
            mask_BP[row, width - n:] = 1
        return ids_BP.to(self.device), mask_BP.to(self.device)

    def _generate_batch(self, requests: list[SampleRequest]) -> list[Completion]:
        import torch
        from transformers import DynamicCache

        cfg = self.config
        t0 = time.perf_counter()
        ids_BP, mask_BL = self._prefill(requests)
        B = len(requests)
        seeds_B = torch.tensor([r.seed for r in requests], dtype=torch.int64, device=self.device)
        stop_S = torch.tensor(self.stop_ids, device=self.device)
        positions_BP = (mask_BL.cumsum(-1) - 1).clamp(min=0)
        cache = DynamicCache()
        done_B = torch.zeros(B, dtype=torch.bool, device=self.device)
        lengths_B = torch.zeros(B, dtype=torch.long, device=self.device)
        tokens, chosen, top_ids, top_lps = [], [], [], []
        with torch.inference_mode():
            out = self.model(input_ids=ids_BP, attention_mask=mask_BL, position_ids=positions_BP,
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
            next_pos_B = positions_BP[:, -1] + 1
            for step in range(cfg.max_tokens):
                logits_BV = out.logits[:, -1, :].float()
                logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
                tok_B = sample_tokens(logits_BV, seeds_B, step, self.token_hash_V, cfg.temperature, cfg.top_k, cfg.top_p)
                tok_B = torch.where(done_B, torch.full_like(tok_B, self.pad_id), tok_B)
                tokens.append(tok_B)
                chosen.append(logprobs_BV.gather(-1, tok_B[:, None])[:, 0])
                if cfg.topk_logprobs:
                    values, indices = torch.topk(logprobs_BV, cfg.topk_logprobs, dim=-1)
                    top_ids.append(indices)
                    top_lps.append(values)
                lengths_B += (~done_B).long()
                done_B |= torch.isin(tok_B, stop_S)
                if step + 1 == cfg.max_tokens or bool(done_B.all()):
                    break
                mask_BL = torch.cat([mask_BL, torch.ones((B, 1), dtype=mask_BL.dtype, device=self.device)], dim=1)
                out = self.model(input_ids=tok_B[:, None], attention_mask=mask_BL, position_ids=next_pos_B[:, None],
                                 past_key_values=cache, use_cache=True)
                next_pos_B = next_pos_B + 1
        completions = self._collect(tokens, chosen, top_ids, top_lps, lengths_B, done_B)
        self.seconds += time.perf_counter() - t0
        return completions

    def _collect(self, tokens, chosen, top_ids, top_lps, lengths_B, done_B) -> list[Completion]:
        import torch

        tokens_BS = torch.stack(tokens, dim=1).cpu().numpy().astype(np.int32)
        chosen_BS = torch.stack(chosen, dim=1).float().cpu().numpy()
        tids = torch.stack(top_ids, dim=1).cpu().numpy().astype(np.int32) if top_ids else None
        tlps = torch.stack(top_lps, dim=1).float().cpu().numpy() if top_lps else None
        lengths = lengths_B.cpu().tolist()
        done = done_B.cpu().tolist()
        out = []
        for row, (n, stopped) in enumerate(zip(lengths, done, strict=True)):
            ids = tokens_BS[row, :n].copy()
            self.tokens_generated += n
            out.append(Completion(
                response_ids=ids,
                logprobs=chosen_BS[row, :n].astype(np.float32),
                finish_reason="stop" if stopped else "length",
                text=self.tokenizer.decode(ids.tolist(), skip_special_tokens=True),
                topk_ids=None if tids is None else tids[row, :n].copy(),
                topk_logprobs=None if tlps is None else tlps[row, :n].astype(np.float32),
            ))
        return out

    def close(self) -> None:
        self.model = None
