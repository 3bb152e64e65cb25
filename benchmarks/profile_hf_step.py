"""Profile one CUDA-graph-free decode step of the hf engine on the 1.7B shape (top CUDA kernels)."""

import sys
from types import SimpleNamespace

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import Qwen3ForCausalLM

sys.path[:0] = ["benchmarks"]
from bench_hf_gpu import StubTokenizer, qwen3_1_7b_config  # noqa: E402

from opd_common.engines import SampleRequest  # noqa: E402
from opd_common.engines.hf import HfEngine  # noqa: E402

attn = sys.argv[1] if len(sys.argv) > 1 else "sdpa"
config = qwen3_1_7b_config(False)
config._attn_implementation = attn
with torch.device("cuda"):
    model = Qwen3ForCausalLM(config).to(torch.bfloat16).eval()
cfg = SimpleNamespace(model="b", revision=None, device="cuda", batch_size=128, max_tokens=256, temperature=1.0,
                      top_k=0, top_p=1.0, topk_logprobs=0, cuda_graph=False)
eng = HfEngine(cfg, model=model, tokenizer=StubTokenizer(151935, 0))
reqs = [SampleRequest(list(range(1, 129)), i) for i in range(128)]
buf = eng._buffers(128, 512)
with torch.inference_mode():
    logits, _ = eng._prefill(reqs, buf, 128, 512)
    eng._sample_and_record(logits, buf)
    for _ in range(3):
        eng._step(buf)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            eng._step(buf)
        torch.cuda.synchronize()
print(attn, prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
