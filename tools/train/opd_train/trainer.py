"""The Trainer: the student, AdamW and the schedule, one optimizer step (train_step) and its checkpoint (save).

Losses are token sums over the whole step's token count, so any cut into micro-batches (and ranks)
gives the same gradient; the objective's registry entry (objectives.py) says what else a step does
(group advantages before it, the adaptive beta after it).
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from opd_common.records import Where
from opd_common.streams import decode_line, encode
from opd_common.timeline import timeline

from . import checkpoint as ckpt
from . import distributed
from .data import micro_batches
from .objectives import objective

log = logging.getLogger("opd-train")

OnSave = Callable[[Path, int], None]  # (run_dir, step) once checkpoint `step` is on disk (cli.py: --publish)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """Multiplier of --lr for optimizer step `step` (0-based): linear warm-up, then the schedule."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant" or total <= warmup:
        return 1.0
    progress = (step - warmup) / (total - warmup)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def set_group_advantages(examples, aggregation: str = "token-mean") -> None:
    """grpo/dapo: every token of a response gets its group's normalized reward (losses.group_advantages); with
    aggregation response-mean also its response's weight over the whole step (losses.response_mean_weights)."""
    import numpy as np
    import torch

    from .losses import group_advantages, response_mean_weights

    if aggregation == "response-mean":
        weights = response_mean_weights([len(ex.response_ids) for ex in examples])
        for ex, w in zip(examples, weights, strict=True):
            ex.tokens["weight"] = np.full(len(ex.response_ids), w, np.float32)

    groups: dict[str, list] = {}
    for ex in examples:
        groups.setdefault(ex.prompt_id, []).append(ex)
    for members in groups.values():
        adv_G = group_advantages(torch.tensor([ex.reward for ex in members], dtype=torch.float64))
        for ex, a in zip(members, adv_G.tolist(), strict=True):
            ex.tokens["advantage"] = np.full(len(ex.response_ids), a, np.float32)


class Trainer:
    """One run's student, optimizer, schedule and position in the input.

    Trainer(config, run_dir) loads --model on --device (joining the process group under accelerate
    launch). With `device` (and `lm`, a model already on it) given, it takes them as they are: no
    process group, and no tokenizer when `lm` is given (tests and benchmarks). `on_save(run_dir, step)`
    runs after each checkpoint is on disk, on rank 0, in this thread (cli.py passes --publish's);
    an exception from it stops the run.
    """

    def __init__(self, config, run_dir: Path | None = None, *, device: str | None = None, lm=None,
                 on_save: OnSave | None = None):
        import torch

        from opd_common.models import load_tokenizer

        from .model import Student

        self.config = config
        self.run_dir = run_dir
        self.on_save = on_save
        self.objective = objective(config)
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        self.fsdp = None
        if device is None:
            device = self._join(config)
        self.tokenizer = load_tokenizer(config.model, config.revision) if lm is None else None
        self.student = Student(config, device, lm)
        if self.fsdp is not None:
            distributed.shard_base(self.student, self.fsdp)
        self.optimizer = torch.optim.AdamW(self.student.params, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, config.warmup_steps, config.max_steps, config.lr_schedule))
        self.step = 0
        self.beta = config.beta_init
        self.consumed = 0
        self.last_id: str | None = None
        self.pending: list[tuple[dict, Where]] = []
        self.last_saved = 0
        self.last_metrics: dict | None = None
        self.writer = ckpt.BackgroundWriter(on_done=lambda path: log.info("saved %s", path))
        self.sharer = ckpt.PolicySharer(run_dir) if config.share_policy and run_dir and self.rank == 0 else None

    def _join(self, config) -> str:
        """--device, or this rank's under accelerate launch (distributed.py: the process group, FSDP)."""
        from opd_common.models import pick_device

        device = pick_device(config.device)
        if self.world > 1:
            self.fsdp = distributed.fsdp_settings()
            device = distributed.init_process_group(device)
        return device

    # ------------------------------------------------------------------ state

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "beta": self.beta, "consumed": self.consumed, "last_id": self.last_id,
                "pending": [(encode(rec), where.source, where.number) for rec, where in self.pending],
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "rng": ckpt.rng_state()}

    def restore(self, path: Path) -> None:
        state = ckpt.load(path, self.student)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        ckpt.set_rng_state(state["rng"])
        self.step, self.beta, self.consumed = state["step"], state["beta"], state["consumed"]
        self.last_id = state.get("last_id")
        self.pending = [(decode_line(line, f"record {n} of {src}"), Where(src, n)) for line, src, n in state["pending"]]
        self.last_saved = self.step
        from opd_common.records import normalize

        self.pending = [(normalize(rec, where), where) for rec, where in self.pending]

    def save(self, metrics: dict | None) -> None:
        """Checkpoint this step: a CPU snapshot here, the files written in the background (BackgroundWriter),
        so the next step trains while they go to disk; with on_save (--publish) it waits for them and calls it."""
        self.last_saved = self.step
        if self.rank != 0:
            return
        summary = {"step": self.step, "max_steps": self.config.max_steps, "records_read": self.consumed,
                   "complete": self.step >= self.config.max_steps, "beta": self.beta, "metrics": metrics,
                   "world_size": self.world, "fsdp": self.fsdp is not None}
        tl, step = timeline("opd-train"), self.step
        with tl.span("save", step=step):
            snap = ckpt.snapshot(self.student, self.state())

        def write():
            with tl.span("save_write", step=step):
                return ckpt.write(self.run_dir, step, snap, self.tokenizer, summary)

        self.writer.submit(write)
        if self.on_save is not None:
            self.writer.wait()
            self.on_save(self.run_dir, self.step)

    def share_policy(self) -> None:
        """--share-policy: this step's adapter to RUN/policy/ for the loop's followers (PolicySharer)."""
        if self.sharer is None:
            return
        summary = {"step": self.step, "max_steps": self.config.max_steps, "records_read": self.consumed,
                   "policy": True}
        with timeline("opd-train").span("share", step=self.step):
            self.sharer.share(self.student, self.step, summary)

    def flush(self) -> None:
        """Block until every checkpoint (and shared policy) submitted is written (re-raises a failed write)."""
        self.writer.wait()
        if self.sharer is not None:
            self.sharer.wait()

    # ------------------------------------------------------------------ one step

    def train_step(self, examples) -> dict[str, Any]:
        import torch

        cfg = self.config
        t0 = time.perf_counter()
        num_tokens = sum(len(ex.response_ids) for ex in examples)  # the whole step, all ranks
        if self.objective.group_advantages:
            set_group_advantages(examples, cfg.aggregation)
        local = sorted(examples[self.rank::self.world], key=lambda e: -e.length)
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        passes = [(mb, num_tokens) for mb in micro_batches(local, cfg.micro_batch_tokens)]
        if self.world > 1:  # passes of weight 0 (divided by inf) where FSDP or an idle rank needs them
            padding = distributed.padding(len(passes), examples, self.student.device, self.fsdp)
            passes += [(mb, math.inf) for mb in padding]
        for mb, tokens in passes:
            for key, value in self.student.micro_step(mb, tokens, self.beta).items():
                totals[key] = totals.get(key, 0.0) + value
        if self.world > 1:
            totals = self._all_reduce(totals)
        norm = torch.nn.utils.clip_grad_norm_(self.student.params, cfg.max_grad_norm or float("inf"))
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.step += 1
        metrics: dict[str, Any] = {"step": self.step, **{k: round(v, 8) for k, v in sorted(totals.items())},
                                   "grad_norm": round(float(norm), 8), "lr": lr, "tokens": num_tokens,
                                   "records": len(examples), "records_read": self.consumed}
        if self.objective.adaptive_beta:
            from .losses import update_beta

            metrics["beta"] = self.beta
            self.beta = update_beta(self.beta, totals.get("weighted_shift", 0.0), eps=cfg.beta_eps)
        seconds = time.perf_counter() - t0
        metrics.update(step_time=round(seconds, 4), tokens_per_s=round(num_tokens / max(seconds, 1e-9), 1))
        return metrics

    def _all_reduce(self, totals: dict[str, float]) -> dict[str, float]:
        """Sum gradients and metric contributions over ranks (each is a share of a global token mean)."""
        import torch
        import torch.distributed as dist

        for p in self.student.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)
        keys = sorted(totals)
        vec = torch.tensor([totals[k] for k in keys], dtype=torch.float64, device=self.student.device)
        dist.all_reduce(vec)
        return dict(zip(keys, vec.tolist(), strict=True))
