"""The transformers engine: static-cache decoding, one capturable step, batch-independent sampling.

A batch of samples is left-padded, prefilled into a ``StaticCache`` (eagerly), then decoded by
one *step* function that does everything on the device with fixed shapes and no host sync:
forward of the last token, ``log_softmax`` of the raw logits (the record's log-probs,
temperature 1), optional top-k, sampling with per-sample counter-based randomness
(``sampling.sample_tokens``), stop detection, and writes into history buffers. On CUDA that step
is captured once per set of buffers (below) as a CUDA graph and replayed (``--cuda-graph``);
on CPU the same function runs eagerly (``--cuda-graph`` on CPU runs the capture's warm-up steps and
replays the step eagerly: the graphed path's logic, testable without a GPU). The capture's warm-up
steps write past the last sampled position, so graphed buffers keep ``CAPTURE_STEPS`` spare columns.
The host checks "all done?" only every 16 steps. The engine holds one set of buffers, its cache as long
as the longest batch so far needed: a batch that fits decodes in it (the positions past its own length
stay masked), a longer one (or, decoding eagerly, another batch size) replaces it, the old memory handed
back to the device first when the new buffers are larger. One cache per length seen added up past the
trainer's share of a shared GPU (an H100, the OPSD loop at lag 2). The masked positions add exact zeros,
but the attention's reductions run over the cache's length, so log-probs can differ in the last bits with
it; the length already depended on the batch's longest prompt.

In the on-policy loop (``--follow``) the model is wrapped once, before the first batch, in a peft
LoRA of the trainer's shape (its run's config.json) whose B matrices are zero, i.e. exactly the
base model; each new checkpoint's weights are then copied into the same tensors, so neither the
compiled forward nor a captured graph is rebuilt for a new version.

The attention mask is our own 4-D boolean mask (transformers uses a 4-D mask as given): a key is
visible when it is a real prompt token or an already generated one; every query also sees itself,
so left-pad positions never form an all-masked row (which would put NaNs into the cache).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np

from opd_common.errors import ConfigError
from opd_common.models import load_causal_lm, load_tokenizer, pick_device, pick_dtype, use_gqa_attention

from .base import Completion, SampleRequest
from .sampling import sample_tokens

log = logging.getLogger(__name__)
LENGTH_BUCKET = 128
CHECK_EVERY = 16
CAPTURE_STEPS = 3  # steps _capture runs (2 warm-up + 1 recorded) after a prefill


class _EagerReplay:
    """A captured step on a device without CUDA graphs: replay() runs it eagerly."""

    def __init__(self, step):
        self.replay = step


@dataclass
class _Buffers:
    """Static device tensors one decode step reads and writes (their addresses never change)."""

    B: int  # batch size
    L: int  # cache length (prompt + response + spare, in LENGTH_BUCKET steps)
    cache: object
    tok_B: object  # last sampled token
    pos_B: object  # position id of tok_B
    cache_pos_1: object  # cache slot of tok_B
    step_1: object  # index of the token the step samples
    seeds_B: object
    visible_BL: object  # bool: key j is visible to the next query
    done_B: object
    lengths_B: object
    tokens_BS: object
    chosen_BS: object
    top_ids_BSK: object | None
    top_lps_BSK: object | None
    graph: object = None


class HfEngine:
    name = "hf"

    def __init__(self, config, model=None, tokenizer=None):
        import torch

        self.config = config
        self.device = pick_device(config.device)
        self.tokenizer = tokenizer or load_tokenizer(config.model, config.revision)
        if model is None:
            dtype = pick_dtype(config.dtype, self.device, config.model)
            model = load_causal_lm(config.model, config.revision, dtype, self.device, config.adapter)
        use_gqa_attention(model)
        self._bucket: _Buffers | None = None  # the decode buffers held (the longest cache needed so far)
        self._use_model(model)
        self.stop_ids = self._stop_ids()
        self.stop_S = torch.tensor(self.stop_ids, device=self.device)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.stop_ids[0]
        graph = getattr(config, "cuda_graph", None)
        self.use_graph = self.device.startswith("cuda") if graph is None else bool(graph)
        self.tokens_generated = 0
        self.seconds = 0.0
        self.captures = 0  # graphs captured (one per longer cache; a new adapter version adds none)

    def _use_model(self, model) -> None:
        """Decode with `model` from now on: its forward optionally compiled (fuses the many small elementwise
        kernels); graphs captured for another model are dropped."""
        import torch

        self.model = model
        self._bucket = None
        self._decode_forward = torch.compile(model, dynamic=False) if getattr(self.config, "compile", False) else model

    @property
    def _spare(self) -> int:
        """Positions past the last sampled one that the capture's steps write (0 without graphs)."""
        return CAPTURE_STEPS if self.use_graph else 0

    def _stop_ids(self) -> list[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        eos = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        if eos is not None:
            ids.update(int(e) for e in ([eos] if isinstance(eos, int) else eos))
        if not ids:
            raise ConfigError(f"--model {self.config.model}: the tokenizer defines no eos_token; "
                              "cannot tell when to stop")
        return sorted(ids)

    # ------------------------------------------------------------------ public

    def generate(self, requests: list[SampleRequest]) -> list[Completion]:
        order = sorted(range(len(requests)), key=lambda i: len(requests[i].prompt_ids))
        results: list[Completion | None] = [None] * len(requests)
        size = self.config.batch_size
        for start in range(0, len(order), size):
            idx = order[start:start + size]
            for i, completion in zip(idx, self._generate_batch([requests[i] for i in idx]), strict=True):
                results[i] = completion
        return results  # type: ignore[return-value]

    def prepare_adapter(self, lora: dict) -> None:
        """--follow: wrap the model in a zero LoRA of the trainer's shape (`lora`: r, alpha, targets) before the
        first batch, so that every checkpoint later loads into the same tensors (nothing recompiles)."""
        from peft import LoraConfig, get_peft_model

        targets = lora["targets"]
        targets = "all-linear" if targets == "all-linear" else [t.strip() for t in targets.split(",")]
        config = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], target_modules=targets, task_type="CAUSAL_LM",
                            init_lora_weights=True)  # B = 0: the wrapped model computes exactly the base model
        self._use_model(get_peft_model(self.model, config).eval())

    def set_adapter(self, path: str | None, version: int) -> None:
        """--follow: load this checkpoint's LoRA weights into the model in place (peft)."""
        import torch
        from peft import PeftModel, load_peft_weights, set_peft_model_state_dict

        if path is None:
            return
        if not isinstance(self.model, PeftModel):  # no prepare_adapter: wrap (captured graphs are rebuilt once)
            self._use_model(PeftModel.from_pretrained(self.model, path).eval())
            return
        before = {n: p.data_ptr() for n, p in self.model.named_parameters() if "lora_" in n}
        with torch.no_grad():
            result = set_peft_model_state_dict(self.model, load_peft_weights(path, device=self.device))
        unexpected = getattr(result, "unexpected_keys", [])
        moved = [n for n, p in self.model.named_parameters() if "lora_" in n and before.get(n) != p.data_ptr()]
        if unexpected or moved:
            raise ConfigError(f"--follow: {path} does not fit the LoRA the engine prepared from the run's config.json "
                              f"({(unexpected or moved)[:2]} ...); was the run dir's config.json changed?")

    def close(self) -> None:
        self._bucket = None
        self.model = None

    # ------------------------------------------------------------------ buffers

    def _buffers(self, B: int, L: int) -> _Buffers:
        """Buffers for B samples whose cache needs L positions: the ones held when they are for B samples and
        their cache is long enough, else new ones, as long as L or the held ones, that replace them."""
        import torch
        from transformers import StaticCache

        held = self._bucket
        if held is not None and held.B == B and held.L >= L:
            return held
        if held is not None:
            grows = B * max(L, held.L) > held.B * held.L
            L = max(L, held.L)  # never shorter than the longest so far (eager decoding: another batch size)
            held.graph = None  # (an eager replay refers back to its buffers: no cycle left for the collector)
            self._bucket = held = None
            if grows and self.device.startswith("cuda"):
                torch.cuda.empty_cache()  # the old cache's memory back to the device (a trainer may share it)
        k, dev = self.config.topk_logprobs, self.device
        S = self.config.max_tokens + self._spare  # room for the capture's steps
        lp_dtype = torch.float32
        self._bucket = _Buffers(
            B=B,
            L=L,
            cache=StaticCache(config=self.model.config, max_cache_len=L),
            tok_B=torch.zeros(B, dtype=torch.long, device=dev),
            pos_B=torch.zeros(B, dtype=torch.long, device=dev),
            cache_pos_1=torch.zeros(1, dtype=torch.long, device=dev),
            step_1=torch.zeros(1, dtype=torch.long, device=dev),
            seeds_B=torch.zeros(B, dtype=torch.int64, device=dev),
            visible_BL=torch.zeros(B, L, dtype=torch.bool, device=dev),
            done_B=torch.zeros(B, dtype=torch.bool, device=dev),
            lengths_B=torch.zeros(B, dtype=torch.long, device=dev),
            tokens_BS=torch.zeros(B, S, dtype=torch.long, device=dev),
            chosen_BS=torch.zeros(B, S, dtype=lp_dtype, device=dev),
            top_ids_BSK=torch.zeros(B, S, k, dtype=torch.long, device=dev) if k else None,
            top_lps_BSK=torch.zeros(B, S, k, dtype=lp_dtype, device=dev) if k else None,
        )
        return self._bucket

    # ------------------------------------------------------------------ the two phases

    def _prefill(self, requests: list[SampleRequest], buf: _Buffers, B: int, L: int):
        """Left-pad, run the prompt through the model into the static cache, return last logits."""
        import torch

        P = max(len(r.prompt_ids) for r in requests)
        ids = torch.full((B, P), self.pad_id, dtype=torch.long)
        valid = torch.zeros((B, P), dtype=torch.bool)
        seeds = torch.zeros(B, dtype=torch.int64)
        for row, req in enumerate(requests):
            n = len(req.prompt_ids)
            ids[row, P - n:] = torch.tensor(req.prompt_ids, dtype=torch.long)
            valid[row, P - n:] = True
            seeds[row] = req.seed
        ids, valid = ids.to(self.device), valid.to(self.device)
        buf.cache.reset()
        buf.visible_BL.zero_()
        buf.visible_BL[:, :P] = valid
        causal_PP = torch.tril(torch.ones(P, P, dtype=torch.bool, device=self.device))
        mask = (causal_PP[None] & valid[:, None, :]) | torch.eye(P, dtype=torch.bool, device=self.device)[None]
        mask_B1PL = torch.zeros(B, 1, P, L, dtype=torch.bool, device=self.device)
        mask_B1PL[:, 0, :, :P] = mask
        positions = (valid.long().cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask_B1PL, position_ids=positions,
                         cache_position=torch.arange(P, device=self.device), past_key_values=buf.cache,
                         use_cache=True, logits_to_keep=1)
        buf.seeds_B.copy_(seeds)
        buf.pos_B.copy_(positions[:, -1])
        buf.cache_pos_1.fill_(P - 1)
        buf.step_1.zero_()
        buf.done_B.zero_()
        buf.lengths_B.zero_()
        buf.tokens_BS.fill_(self.pad_id)
        return out.logits[:, -1, :], P

    def _sample_and_record(self, logits_BV, buf: _Buffers) -> None:
        """Sample from raw logits, record log-probs, update done/lengths (device-only, fixed shapes)."""
        import torch

        cfg = self.config
        logits_BV = logits_BV.float()
        logprobs_BV = torch.log_softmax(logits_BV, dim=-1)
        tok_B = sample_tokens(logits_BV, buf.seeds_B, buf.step_1, cfg.temperature, cfg.top_k, cfg.top_p)
        tok_B = torch.where(buf.done_B, torch.full_like(tok_B, self.pad_id), tok_B)
        col_B1 = buf.step_1.expand(tok_B.shape[0]).unsqueeze(1)
        buf.tokens_BS.scatter_(1, col_B1, tok_B[:, None])
        buf.chosen_BS.scatter_(1, col_B1, logprobs_BV.gather(-1, tok_B[:, None]))
        if buf.top_ids_BSK is not None:
            values, indices = torch.topk(logprobs_BV, cfg.topk_logprobs, dim=-1)
            col_B1K = col_B1[:, :, None].expand(-1, 1, cfg.topk_logprobs)
            buf.top_ids_BSK.scatter_(1, col_B1K, indices[:, None, :])
            buf.top_lps_BSK.scatter_(1, col_B1K, values[:, None, :])
        buf.lengths_B.add_((~buf.done_B).long())
        buf.done_B.logical_or_(torch.isin(tok_B, self.stop_S))
        buf.tok_B.copy_(tok_B)
        buf.step_1.add_(1)

    def _step(self, buf: _Buffers) -> None:
        """One decode step: feed tok_B, then sample the next token. Capturable as a CUDA graph."""
        buf.pos_B.add_(1)
        buf.cache_pos_1.add_(1)
        buf.visible_BL.index_fill_(1, buf.cache_pos_1, True)
        out = self._decode_forward(input_ids=buf.tok_B[:, None], attention_mask=buf.visible_BL[:, None, None, :],
                         position_ids=buf.pos_B[:, None], cache_position=buf.cache_pos_1,
                         past_key_values=buf.cache, use_cache=True)
        self._sample_and_record(out.logits[:, -1, :], buf)

    def _capture(self, buf: _Buffers) -> None:
        """Record _step as a CUDA graph (after warm-up on a side stream); eager on failure. Off CUDA: the same
        warm-up steps, then an eager replay (the graphed path's logic, run on CPU by the tests)."""
        import torch

        self.captures += 1
        if not self.device.startswith("cuda"):
            for _ in range(CAPTURE_STEPS):
                self._step(buf)
            buf.graph = _EagerReplay(lambda: self._step(buf))
            return
        try:
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(CAPTURE_STEPS - 1):
                    self._step(buf)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self._step(buf)
            buf.graph = graph
        except Exception as exc:  # pragma: no cover - depends on the model's kernels
            log.warning("CUDA graph capture failed (%s); decoding eagerly", str(exc).splitlines()[0])
            self.use_graph = False

    def _generate_batch(self, requests: list[SampleRequest]) -> list[Completion]:
        import torch

        t0 = time.perf_counter()
        B = self.config.batch_size if self.use_graph else len(requests)
        padded = list(requests) + [requests[-1]] * (B - len(requests))  # fixed batch for the graph
        P = max(len(r.prompt_ids) for r in requests)
        L = -(-(P + self.config.max_tokens + self._spare) // LENGTH_BUCKET) * LENGTH_BUCKET
        buf = self._buffers(B, L)
        L = buf.L
        steps = self.config.max_tokens
        with torch.inference_mode():
            if self.use_graph and buf.graph is None:
                self._prefill(padded, buf, B, L)
                self._capture(buf)
            logits, _ = self._prefill(padded, buf, B, L)
            self._sample_and_record(logits, buf)
            for step in range(1, steps):
                if buf.graph is not None:
                    buf.graph.replay()
                else:
                    self._step(buf)
                if (step + 1) % CHECK_EVERY == 0 and bool(buf.done_B.all()):
                    break
        completions = self._collect(buf, len(requests))
        self.seconds += time.perf_counter() - t0
        return completions

    def _collect(self, buf: _Buffers, n: int) -> list[Completion]:
        tokens = buf.tokens_BS[:n].cpu().numpy().astype(np.int32)
        chosen = buf.chosen_BS[:n].float().cpu().numpy()
        tids = buf.top_ids_BSK[:n].cpu().numpy().astype(np.int32) if buf.top_ids_BSK is not None else None
        tlps = buf.top_lps_BSK[:n].float().cpu().numpy() if buf.top_lps_BSK is not None else None
        lengths = buf.lengths_B[:n].cpu().tolist()
        done = buf.done_B[:n].cpu().tolist()
        out = []
        for row, (length, stopped) in enumerate(zip(lengths, done, strict=True)):
            ids = tokens[row, :length].copy()
            self.tokens_generated += length
            out.append(Completion(
                response_ids=ids,
                logprobs=chosen[row, :length].astype(np.float32),
                finish_reason="stop" if stopped else "length",
                text=self.tokenizer.decode(ids.tolist(), skip_special_tokens=True),
                topk_ids=None if tids is None else tids[row, :length].copy(),
                topk_logprobs=None if tlps is None else tlps[row, :length].astype(np.float32),
            ))
        return out
