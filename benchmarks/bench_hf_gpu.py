"""The hf engine against plain `model.generate` on a Qwen3-1.7B-shaped model (random weights).

Same model, same batch (128 prompts x 256 new tokens by default), same sampling settings
(temperature 1, no top-k/top-p), in one process; each path is warmed up once, then timed.
Reports generated tokens/s of: plain generate (dynamic cache), generate with
cache_implementation="static" (optional, --static), the opd hf engine eager, and the opd hf
engine with its CUDA-graph decode step, and (--compile) with a torch.compile'd decode forward
inside the graph; and each path's ratio to plain generate (target >= 3).

    python benchmarks/bench_hf_gpu.py [--batch 128] [--new-tokens 256] [--prompt-len 128] [--json out.json]
    python benchmarks/bench_hf_gpu.py --tiny     # a CPU smoke run of the same code on a tiny shape
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from types import SimpleNamespace


class StubTokenizer:
    """Just what the engine needs from a tokenizer (ids are random; text is not measured)."""

    def __init__(self, eos: int, pad: int):
        self.eos_token_id, self.pad_token_id = eos, pad

    def decode(self, ids, skip_special_tokens=True) -> str:
        return ""


def qwen3_1_7b_config(tiny: bool):
    from transformers import Qwen3Config

    if tiny:
        return Qwen3Config(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096)
    return Qwen3Config(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       tie_word_embeddings=True, rope_theta=1000000.0, rms_norm_eps=1e-6)


def timed(fn, device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--static", action="store_true", help="also time generate(cache_implementation='static')")
    parser.add_argument("--compile", action="store_true", help="also time the engine with --compile")
    parser.add_argument("--tiny", action="store_true", help="tiny shape (CPU smoke run)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    import torch
    from transformers import Qwen3ForCausalLM

    from opd_common.engines import SampleRequest
    from opd_common.engines.hf import HfEngine

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    config = qwen3_1_7b_config(args.tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype).eval()
    eos = config.vocab_size - 1
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = 0
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(1, config.vocab_size - 1, (args.batch, args.prompt_len), generator=gen)
    B, S = args.batch, args.new_tokens
    figures: dict = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                     "torch": torch.__version__, "batch": B, "new_tokens": S, "prompt_len": args.prompt_len,
                     "params": sum(p.numel() for p in model.parameters())}

    def plain(static: bool):
        ids = prompts.to(device)
        kwargs = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=S, min_new_tokens=S,
                      attention_mask=torch.ones_like(ids), pad_token_id=0)
        if static:
            kwargs["cache_implementation"] = "static"
        with torch.inference_mode():
            model.generate(ids, **kwargs)

    def engine_run(graph: bool, compile: bool = False):
        cfg = SimpleNamespace(model="bench", revision=None, device=device, batch_size=B, max_tokens=S,
                              temperature=1.0, top_k=0, top_p=1.0, topk_logprobs=0, cuda_graph=graph,
                              compile=compile)
        engine = HfEngine(cfg, model=model, tokenizer=StubTokenizer(eos, 0))
        engine.stop_S = torch.tensor([-1], device=device)  # never stop: exactly S tokens, like min_new_tokens
        requests = [SampleRequest(prompts[i].tolist(), seed=i) for i in range(B)]
        return lambda: engine.generate(requests)

    paths = [("plain_generate", lambda: plain(False))]
    if args.static:
        paths.append(("static_generate", lambda: plain(True)))
    paths += [("opd_hf_eager", engine_run(False)), ("opd_hf_cuda_graph", engine_run(device == "cuda"))]
    if args.compile:
        paths.append(("opd_hf_compile_graph", engine_run(device == "cuda", compile=True)))
    for name, fn in paths:
        warm = timed(fn, device)
        seconds = min(timed(fn, device) for _ in range(2))
        figures[name] = {"tok_s": B * S / seconds, "seconds": seconds, "warmup_seconds": warm}
        print(f"{name:18s} {B * S / seconds:10.0f} tok/s  ({seconds:.2f} s; warm-up {warm:.1f} s)", file=sys.stderr)
    for name, _ in paths[1:]:
        figures[f"ratio_{name}_vs_plain"] = figures[name]["tok_s"] / figures["plain_generate"]["tok_s"]
    print(json.dumps(figures, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
