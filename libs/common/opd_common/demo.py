"""The demo world: a toy task with checkable answers, tiny models and SFT data, built offline.

``python -m opd_common.demo OUT`` writes everything the README's main job (``make demo``,
``scripts/demo.sh``) needs into OUT, deterministically in ``--seed``:

- ``base/``: a random tiny Qwen3 (see ``opd_common.tiny``) whose tokenizer splits numbers into
  single digits (as Qwen's does), so that column arithmetic is learnable.
- ``train.jsonl`` / ``test.jsonl``: addition problems ``{"id", "problem": "47+385", "answer": "432"}``
  (operands of 1 to ``--digits`` digits), disjoint by problem; ``test`` is the held-out benchmark.
- ``sft.jsonl``: opd/1 records of the gold solutions (response ``\\boxed{432}`` + EOS) rendered
  with the chat template exactly as ``opd-rollout --template '{problem}' --thinking off`` renders
  the prompt, for ``opd-train --loss sft``. The data is its own behaviour policy: ``logprobs``
  are 0 (probability 1) and ``policy.model`` says ``gold``.

``python -m opd_common.demo merge BASE ADAPTER OUT`` folds a peft LoRA adapter into its base
weights and writes a plain model folder (the demo's teacher and student are such folders).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

TEMPLATE = "{problem}"
# Larger than opd_common.tiny's default (hidden 64, 2 layers), which learns 2-digit addition too slowly:
# with these, `opd-train --loss sft` reaches about 98% greedy accuracy on test.jsonl in 600 steps.
MODEL = {"hidden_size": 128, "layers": 4, "heads": 4, "kv_heads": 2, "intermediate_size": 512}


def problems(seed: int, digits: int, n_train: int, n_test: int) -> tuple[list[dict], list[dict]]:
    """Distinct a+b problems, split into train and test (no problem in both)."""
    rng = random.Random(seed)
    top = 10 ** digits
    seen: set[tuple[int, int]] = set()
    rows = []
    while len(rows) < n_train + n_test:
        a, b = rng.randrange(top), rng.randrange(top)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        rows.append({"problem": f"{a}+{b}", "answer": str(a + b)})
    train = [{"id": f"train-{i}", **r} for i, r in enumerate(rows[:n_train])]
    test = [{"id": f"test-{i}", **r} for i, r in enumerate(rows[n_train:])]
    return train, test


def sft_record(tokenizer, row: dict) -> dict:
    """An opd/1 record whose response is the gold answer in \\boxed{} followed by EOS."""
    from .models import render_chat
    from .records import SCHEMA, make_id

    prompt_ids = render_chat(tokenizer, TEMPLATE.format(**row), thinking=False)
    text = f"\\boxed{{{row['answer']}}}"
    response_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]
    return {
        "schema": SCHEMA, "id": make_id(row["id"], 0), "prompt_id": row["id"], "sample": 0, "group_size": 1,
        "example": row, "policy": {"model": "gold", "revision": None, "adapter": None, "version": 0},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_tokens": len(response_ids), "seed": 0,
                     "engine": "gold", "logprobs": "raw", "thinking": False},
        "prompt_ids": prompt_ids, "response_ids": response_ids, "finish_reason": "stop",
        "response_text": text, "logprobs": [0.0] * len(response_ids),
    }


def _quiet_transformers() -> None:
    """No 'Loading weights' / 'Writing model shards' bars: the demo prints its own steps."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def build_world(out_dir: str | Path, seed: int = 0, digits: int = 2, n_train: int = 4000, n_test: int = 200,
                **model_kwargs) -> Path:
    """Write base/, train.jsonl, test.jsonl and sft.jsonl into out_dir (see the module docstring)."""
    from transformers import AutoTokenizer

    from .rundir import atomic_write_bytes
    from .streams import encode
    from .tiny import build_tiny

    _quiet_transformers()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    base = out / "base"
    if not (base / "opd_tiny.json").exists():  # written last
        build_tiny(base, seed=seed, split_digits=True, **{**MODEL, **model_kwargs})
    tokenizer = AutoTokenizer.from_pretrained(base)
    train, test = problems(seed, digits, n_train, n_test)
    for name, rows in (("train", train), ("test", test)):
        atomic_write_bytes(out / f"{name}.jsonl", b"".join(json.dumps(r).encode() + b"\n" for r in rows))
    atomic_write_bytes(out / "sft.jsonl", b"".join(encode(sft_record(tokenizer, r), "json") for r in train))
    return out


def merge(base: str | Path, adapter: str | Path, out_dir: str | Path) -> Path:
    """Fold a peft LoRA adapter into its base model; write model + tokenizer to out_dir (atomically)."""
    import shutil

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _quiet_transformers()
    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    merged.save_pretrained(tmp, safe_serialization=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["merge"]:
        parser = argparse.ArgumentParser(prog="python -m opd_common.demo merge", description=merge.__doc__)
        parser.add_argument("base")
        parser.add_argument("adapter")
        parser.add_argument("out_dir")
        args = parser.parse_args(argv[1:])
        print(f"merged model written to {merge(args.base, args.adapter, args.out_dir)}", file=sys.stderr)
        return 0
    parser = argparse.ArgumentParser(prog="python -m opd_common.demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--digits", type=int, default=2, help="operands have 1 to DIGITS digits")
    parser.add_argument("--train", type=int, default=4000, help="training problems")
    parser.add_argument("--test", type=int, default=200, help="held-out problems")
    args = parser.parse_args(argv)
    path = build_world(args.out_dir, seed=args.seed, digits=args.digits, n_train=args.train, n_test=args.test)
    print(f"demo world written to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
