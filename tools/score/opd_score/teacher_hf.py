"""Teacher scoring with transformers: exact full-vocabulary log-probs at any ids.

One forward per batch of right-padded sequences (``context_ids + response_ids``); right padding
needs no attention mask (causal attention never looks ahead to the pads), so fused SDPA kernels
run. Only the hidden states that predict response tokens go through the LM head, in chunks of
``logit_chunk`` positions: logits are upcast to fp32 one chunk at a time, ``logsumexp`` gives the
full-vocabulary normalizer, and the requested log-probs are gathered. The fp32
[positions x vocab] tensor of a whole batch never exists.

With ``compile`` the decoder and the per-chunk head function go through ``torch.compile``
(inductor fuses the RMSNorm, rotary, SiLU-gate and upcast/logsumexp kernels that dominate the
non-matmul time); batch widths are padded to multiples of ``WIDTH_BUCKET`` and the positions to
whole chunks so only a few shapes are ever compiled.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from opd_common.batching import token_batches
from opd_common.errors import ConfigError
from opd_common.models import load_causal_lm, pick_device, pick_dtype, use_gqa_attention


@dataclass
class Sequence:
    """What a teacher scores: its own context, the student's response, optional ids to score at."""

    context_ids: np.ndarray  # int [P]
    response_ids: np.ndarray  # int [T]
    at_ids: np.ndarray | None = None  # int [T, k]: also return log-probs at these ids


@dataclass
class Scores:
    logprobs: np.ndarray  # float32 [T]: log p(response_ids[t])
    topk_ids: np.ndarray | None = None  # int32 [T, k]: the teacher's own top-k
    topk_logprobs: np.ndarray | None = None
    at_logprobs: np.ndarray | None = None  # float32 [T, k]: log p at Sequence.at_ids


WIDTH_BUCKET = 128  # with compile: batch widths rounded up to this


def _head_chunk(head, hidden_CH, targets_C, at_CK, topk: int):
    """One chunk of the LM head: fp32 logits, their logsumexp, and the log-probs asked for."""
    import torch

    logits_CV = head(hidden_CH).float()
    lse_C1 = torch.logsumexp(logits_CV, dim=-1, keepdim=True)
    chosen_C = (logits_CV.gather(-1, targets_C[:, None]) - lse_C1)[:, 0]
    top = at = None
    if topk:
        values, indices = torch.topk(logits_CV, topk, dim=-1)
        top = (indices, values - lse_C1)
    if at_CK is not None:
        at = logits_CV.gather(-1, at_CK) - lse_C1
    return chosen_C, top, at


class HfTeacher:
    def __init__(self, model: str, revision: str | None, adapter: str | None, config):
        device = pick_device(config.device)
        dtype = pick_dtype(config.dtype, device, model)
        lm = load_causal_lm(model, revision, dtype, device, adapter)
        if adapter:
            lm = lm.merge_and_unload()  # a frozen teacher: fold the LoRA into the weights
        self._setup(lm, config, device)

    @classmethod
    def from_lm(cls, lm, config, device: str) -> HfTeacher:
        """Wrap a model already in memory (benchmarks, in-process use)."""
        self = cls.__new__(cls)
        self._setup(lm, config, device)
        return self

    def _setup(self, lm, config, device: str) -> None:
        self.config = config
        self.device = device
        use_gqa_attention(lm)
        self.decoder = lm.get_decoder()
        self.head = lm.get_output_embeddings()
        self.lm = lm
        self.pad_id = 0
        self.compiled = bool(getattr(config, "compile", False))
        self._head_chunk = _head_chunk
        self.peft = None  # --follow: the PeftModel around lm, once an adapter was loaded
        self.adapter: str | None = None  # --follow: the adapter scoring now (None: base weights)
        if self.compiled:
            import torch

            self.decoder = torch.compile(self.decoder)
            self._head_chunk = torch.compile(_head_chunk)

    def set_adapter(self, path: str | None) -> None:
        """--follow: score with this peft LoRA from now on (None: the base weights, adapter off).

        The first adapter wraps the model (peft injects LoRA layers into the decoder's modules in
        place); later ones overwrite the LoRA weights, so the base model never reloads. The LoRA
        stays unmerged, as in opd-rollout's hf engine and opd-train, so scores match the sampler's.
        """
        if path == self.adapter:
            return
        if path is not None:
            from peft import PeftModel, load_peft_weights, set_peft_model_state_dict

            if self.peft is None:
                self.peft = PeftModel.from_pretrained(self.lm, path).eval()
                self.head = self.lm.get_output_embeddings()  # a LoRA wrapper if the adapter targets it
                if self.compiled:  # the compiled graph was traced without the LoRA layers
                    import torch

                    self.decoder = torch.compile(self.lm.get_decoder())
            else:
                result = set_peft_model_state_dict(self.peft, load_peft_weights(path, device=self.device))
                if getattr(result, "unexpected_keys", None):
                    raise ConfigError(f"--follow: {path} does not fit the adapter loaded before it "
                                      f"({result.unexpected_keys[:3]} ...); were the run's LoRA settings changed?")
        self.adapter = path

    def _adapter_off(self):
        """The context to score in: the base weights while an adapter is loaded but None is asked."""
        if self.peft is not None and self.adapter is None:
            return self.peft.disable_adapter()
        return contextlib.nullcontext()

    def score(self, seqs: list[Sequence], topk: int = 0) -> list[Scores]:
        """Score sequences (any order); batches by token budget, longest first within the list."""
        order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].context_ids) + len(seqs[i].response_ids))
        lengths = [len(seqs[i].context_ids) + len(seqs[i].response_ids) for i in order]
        out: list[Scores | None] = [None] * len(seqs)
        for batch in token_batches(lengths, self.config.token_budget):
            idx = [order[j] for j in batch]
            for i, scores in zip(idx, self._score_batch([seqs[i] for i in idx], topk), strict=True):
                out[i] = scores
        return out  # type: ignore[return-value]

    def _score_batch(self, seqs: list[Sequence], topk: int) -> list[Scores]:
        import torch

        width = max(len(s.context_ids) + len(s.response_ids) for s in seqs)
        if self.compiled:
            width = -(-width // WIDTH_BUCKET) * WIDTH_BUCKET
        ids_BL = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        rows, cols = [], []
        for b, s in enumerate(seqs):
            seq = np.concatenate([s.context_ids, s.response_ids]).astype(np.int64)
            ids_BL[b, :len(seq)] = torch.from_numpy(seq)
            P, T = len(s.context_ids), len(s.response_ids)
            rows.append(np.full(T, b))
            cols.append(np.arange(P - 1, P - 1 + T))  # the hidden state at P-1+t predicts token t
        with torch.inference_mode(), self._adapter_off():
            hidden_BLH = self.decoder(input_ids=ids_BL.to(self.device), use_cache=False).last_hidden_state
            rows_N = torch.from_numpy(np.concatenate(rows)).to(self.device)
            cols_N = torch.from_numpy(np.concatenate(cols)).to(self.device)
            hidden_NH = hidden_BLH[rows_N, cols_N]
            targets_N = torch.from_numpy(
                np.concatenate([s.response_ids for s in seqs]).astype(np.int64)).to(self.device)
            at_NK = None
            if seqs[0].at_ids is not None:
                at_NK = torch.from_numpy(np.concatenate([s.at_ids for s in seqs]).astype(np.int64)).to(self.device)
            parts = self._head_logprobs(hidden_NH, targets_N, topk, at_NK)
        return self._split(seqs, parts)

    def _head_logprobs(self, hidden_NH, targets_N, topk: int, at_NK):
        """Chunked LM head: fp32 log-probs at targets, own top-k and given ids, never [N x V] at once."""
        import torch

        n, chunk = hidden_NH.shape[0], self.config.logit_chunk
        if self.compiled and n % chunk:  # whole chunks only: one compiled shape
            pad = chunk - n % chunk
            hidden_NH = torch.cat([hidden_NH, hidden_NH.new_zeros(pad, hidden_NH.shape[1])])
            targets_N = torch.cat([targets_N, targets_N.new_zeros(pad)])
            if at_NK is not None:
                at_NK = torch.cat([at_NK, at_NK.new_zeros(pad, at_NK.shape[1])])
        chosen, top_ids, top_lps, at_lps = [], [], [], []
        for start in range(0, hidden_NH.shape[0], chunk):
            sl = slice(start, start + chunk)
            c, top, at = self._head_chunk(self.head, hidden_NH[sl], targets_N[sl],
                                          None if at_NK is None else at_NK[sl], topk)
            chosen.append(c)
            if top is not None:
                top_ids.append(top[0])
                top_lps.append(top[1])
            if at is not None:
                at_lps.append(at)

        def cat(xs):
            return torch.cat(xs)[:n].cpu().numpy() if xs else None

        return cat(chosen), cat(top_ids), cat(top_lps), cat(at_lps)

    @staticmethod
    def _split(seqs: list[Sequence], parts) -> list[Scores]:
        chosen, top_ids, top_lps, at_lps = parts
        out, start = [], 0
        for s in seqs:
            end = start + len(s.response_ids)
            out.append(Scores(
                logprobs=chosen[start:end].astype(np.float32),
                topk_ids=None if top_ids is None else top_ids[start:end].astype(np.int32),
                topk_logprobs=None if top_lps is None else top_lps[start:end].astype(np.float32),
                at_logprobs=None if at_lps is None else at_lps[start:end].astype(np.float32),
            ))
            start = end
        return out

    def close(self) -> None:
        self.lm = self.decoder = self.head = self.peft = None
