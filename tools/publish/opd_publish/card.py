"""README.md model card from the run's config.json, metrics.jsonl and the checkpoint index."""

from __future__ import annotations

import json
from typing import Any

from .layout import INDEX, RunDir, data_hashes

RECIPE_KEYS = ("loss", "self_teacher", "loss_temperature", "lr", "batch_groups", "batch_size", "micro_batch_tokens",
               "lora_r", "lora_alpha", "lora_dropout", "beta", "seed")
SHOWN_METRICS = ("loss", "reverse_kl", "fkl", "k3", "grad_norm", "lr", "tokens", "records_read")


def _fmt(v: Any) -> str:
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _peft_line(repo: str, path: str) -> str:
    if repo.startswith("file://"):
        return f"model = PeftModel.from_pretrained(base, {repo[len('file://'):].rstrip('/') + '/' + path!r})"
    repo_id = repo[len("hf://"):] if repo.startswith("hf://") else repo
    return f"model = PeftModel.from_pretrained(base, {repo_id.split('@')[0]!r}, subfolder={path!r})"


def render_card(run: RunDir, index: dict[str, Any]) -> str:
    cfg = run.config.get("config", {})
    entries = index["checkpoints"]
    base, revision = cfg.get("model"), cfg.get("revision") or "(default branch)"
    last = entries[-1] if entries else None
    path = last["path"] if last else "checkpoint-NNNNNN"
    tags = ["peft", "lora", "on-policy-distillation", "opd"]
    lines = ["---", f"base_model: {base}", "library_name: peft", "tags:", *[f"- {t}" for t in tags], "---", "",
             f"# LoRA adapter: on-policy distillation of {base}", "",
             f"Trained by {run.config.get('tool', 'opd-train')} {run.config.get('version', '')} and published by "
             f"opd-publish. Only the checkpoints listed in `{INDEX}` are complete; each folder carries "
             "`sha256sums.txt`, and `opd-publish verify` checks every file against it.", "",
             "## Base model", "", f"- model: `{base}`", f"- revision: `{revision}`", "",
             "## Data", "", "| input | sha256 |", "|---|---|"]
    for d in data_hashes(run.config.get("inputs", []), run.path):
        lines.append(f"| `{d['input']}` | "
                     f"{('`' + d['sha256'] + '`') if d['sha256'] else 'not available at publish time'} |")
    lines += ["", "## Recipe", "", "| option | value |", "|---|---|"]
    lines += [f"| {k} | {_fmt(cfg[k])} |" for k in RECIPE_KEYS if cfg.get(k) is not None]
    lines += ["", "## Budget", "", f"- max_steps: {cfg.get('max_steps')}"]
    if last:
        lines.append(f"- latest published step: {last['step']} "
                     f"(records read: {last['metrics'].get('records_read', 'n/a')})")
    lines += ["", "## Checkpoints", ""]
    shown = [k for k in SHOWN_METRICS if any(k in e["metrics"] for e in entries)]
    lines += ["| step | " + " | ".join(shown) + " | commit | completed |",
              "|---" * (len(shown) + 3) + "|"]
    for e in entries:
        vals = " | ".join(_fmt(e["metrics"].get(k, "")) for k in shown)
        lines.append(f"| {e['step']} | {vals} | `{e['commit'][:12]}` | {e['completed_at']} |")
    resume = index.get("latest_resume")
    if resume:
        lines += ["", f"Resume state (optimizer, scheduler, RNG) of step {resume['step']} is under `latest-resume/`."]
    stopped_early = last and cfg.get("max_steps") and last["step"] < cfg["max_steps"]
    lines += ["", "## Caveats", "",
              "- A LoRA adapter only: load it on the exact base model and revision above.",
              f"- Metrics are training-time figures from `metrics.jsonl` (no held-out evaluation); "
              f"{'the run stopped before its budget' if stopped_early else 'see opd-eval for accuracy'}.",
              "- Files under a `checkpoint-*/` folder that is not in the index are an unfinished upload: "
              "do not use them.",
              "", "## How to load", "", "```python", "from peft import PeftModel",
              "from transformers import AutoModelForCausalLM", "",
              f"base = AutoModelForCausalLM.from_pretrained({base!r}, revision={cfg.get('revision')!r})",
              _peft_line(index.get("repo", ""), path), "```", "",
              "```python", "from vllm import LLM", "from vllm.lora.request import LoRARequest", "",
              f"llm = LLM({base!r}, enable_lora=True, max_lora_rank={cfg.get('lora_r', 64)})",
              f"lora = LoRARequest('opd', 1, 'pulled/{path}')  "
              f"# opd-publish pull REPO --checkpoint {last['step'] if last else 'N'} pulled/{path}",
              "outputs = llm.generate(prompts, lora_request=lora)", "```", "",
              "## Training config", "", "```json", json.dumps(run.config, indent=1, default=str), "```", ""]
    return "\n".join(lines)
