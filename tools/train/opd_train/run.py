"""opd-train's pure entry point: run(config, inputs, stdout) -> exit code.

The loop: read the next step's batch lazily, cut it into micro-batches by token budget,
forward/backward each (losses are token sums over the whole step's token count, so any cut gives
the same gradient), clip, AdamW step, log one metrics line, checkpoint every --save-every steps
and at the end. Exactly --max-steps steps; --resume continues from `latest`. Whenever the input
runs dry mid-step, `reader.json` in the run directory says how many records were read and which
step waits for more (opd-rollout --follow samples again for a trainer starved by dynamic sampling).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import queue
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from opd_common import rundir
from opd_common.errors import ConfigError, OpdError
from opd_common.records import Where
from opd_common.streams import decode_line, encode, iter_inputs
from opd_common.timeline import timeline

from . import checkpoint as ckpt
from . import distributed
from .data import StepBatches, make_example, micro_batches

log = logging.getLogger("opd-train")

_END = object()

# options that may differ between a run and its --resume
NOT_COMPARED = {"resume", "overwrite", "quiet", "metrics_stdout", "device", "publish", "input_continues"}


class ShortInput(OpdError):
    """The input ended before --max-steps."""


class PublishFailed(OpdError):
    """--publish could not publish (and verify) a checkpoint."""


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


def prepare_run_dir(config, inputs: list[str]) -> Path:
    """Create (or check, with --resume) the run directory and its config.json."""
    from opd_common import __version__
    from opd_common.config import resolved

    run_dir = Path(config.out)
    record = {"tool": "opd-train", "version": __version__, "config": resolved(config), "inputs": inputs}
    existing = run_dir / rundir.CONFIG
    if config.resume:
        if not existing.exists():
            raise ConfigError(f"--resume: {run_dir} has no {rundir.CONFIG}; nothing to resume (drop --resume)")
        old = json.loads(existing.read_text())["config"]
        new = record["config"]
        differ = sorted(k for k in set(old) | set(new) if k not in NOT_COMPARED and old.get(k) != new.get(k))
        if differ:
            raise ConfigError(f"--resume: the options differ from the run's config.json ({', '.join(differ)}); "
                              "resume with the same options (the step budget included), or start a new --out")
        return run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        if not config.overwrite:
            raise ConfigError(f"--out {run_dir} is not empty; use --resume to continue its run or --overwrite to replace it")
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.atomic_write_text(existing, json.dumps(record, indent=1) + "\n")
    return run_dir


def _example_maker(config, tokenizer):
    render = None
    if config.self_teacher:
        from opd_common.models import render_chat
        from opd_common.prompts import load

        template = load(config.self_teacher)
        cache: dict[str, list[int]] = {}

        def render(rec: dict, where: Where) -> list[int]:
            if rec["prompt_id"] not in cache:
                message = template.render(rec["example"], str(where))
                cache[rec["prompt_id"]] = render_chat(tokenizer, message, config.self_teacher_thinking == "on")
            return cache[rec["prompt_id"]]

    return lambda rec, where: make_example(rec, where, config, render)


def set_group_advantages(examples) -> None:
    """grpo/dapo: every token of a response gets its group's normalized reward (losses.group_advantages)."""
    import numpy as np
    import torch

    from .losses import group_advantages

    groups: dict[str, list] = {}
    for ex in examples:
        groups.setdefault(ex.prompt_id, []).append(ex)
    for members in groups.values():
        adv_G = group_advantages(torch.tensor([ex.reward for ex in members], dtype=torch.float64))
        for ex, a in zip(members, adv_G.tolist(), strict=True):
            ex.tokens["advantage"] = np.full(len(ex.response_ids), a, np.float32)


class Trainer:
    def __init__(self, config, run_dir: Path):
        self.setup(config, run_dir)

    def setup(self, config, run_dir: Path | None, device: str | None = None, lm=None) -> None:
        """Student, optimizer and schedule; `device`/`lm` given = a model already in memory (benchmarks)."""
        import torch

        from opd_common.models import load_tokenizer, pick_device

        from .model import Student

        self.config = config
        self.run_dir = run_dir
        self.world, self.rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
        self.fsdp = None
        if device is None:
            device = pick_device(config.device)
            if self.world > 1:  # under accelerate launch (distributed.py)
                self.fsdp = distributed.fsdp_settings()
                device = distributed.init_process_group(device)
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
        so the next step trains while they go to disk; --publish waits for them and pushes."""
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
        if self.config.publish:
            self.writer.wait()
            self.publish()

    def flush(self) -> None:
        """Block until every checkpoint submitted is on disk (re-raises a failed write)."""
        self.writer.wait()

    def publish(self) -> None:
        """Push the checkpoint just saved (verified before it is indexed); a failure stops the run."""
        from opd_publish.publish import push
        from opd_publish.targets import parse_target

        try:
            results = push(self.run_dir, parse_target(self.config.publish, quiet=True), checkpoints=str(self.step))
        except OpdError as exc:
            raise PublishFailed(f"--publish {self.config.publish}: {rundir.checkpoint_name(self.step)} was saved "
                                f"locally but not published, so the run stops: {exc}; fix the target, then "
                                f"`opd-publish push {self.run_dir} --repo {self.config.publish}` and --resume") from None
        log.info("published %s: %s", rundir.checkpoint_name(self.step), results[0].get("status"))

    # ------------------------------------------------------------------ one step

    def train_step(self, examples) -> dict[str, Any]:
        import torch

        cfg = self.config
        t0 = time.perf_counter()
        num_tokens = sum(len(ex.response_ids) for ex in examples)  # the whole step, all ranks
        if cfg.loss in ("grpo", "dapo"):
            set_group_advantages(examples)
        local = sorted(examples[self.rank::self.world], key=lambda e: -e.length)
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        passes = [(mb, num_tokens) for mb in micro_batches(local, cfg.micro_batch_tokens)]
        if self.world > 1:  # passes of weight 0 (divided by inf) where FSDP or an idle rank needs them
            passes += [(mb, math.inf) for mb in distributed.padding(len(passes), examples, self.student.device, self.fsdp)]
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
        if cfg.loss == "shift":
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


def skip_read(items, consumed: int, last_id: str | None):
    """The input after the `consumed` records a resumed run has read, checking they are the same records."""
    count = 0
    for rec, where in items:
        count += 1
        if count < consumed:
            continue
        if count == consumed:
            if last_id is not None and rec.get("id") != last_id:
                raise ConfigError(f"--resume: {where} is {rec.get('id')!r}, but record {consumed} the run read was "
                                  f"{last_id!r}; pass the run's inputs again in the same order (new input after them)")
            continue
        yield rec, where
    if count < consumed:
        raise ConfigError(f"--resume: the inputs hold {count} records, but the run has already read {consumed}; "
                          "pass the run's inputs again in the same order (new input after them)")


def announce_waits(items, announce, wait: float = 0.05):
    """`items` through a reader thread; announce() each time the next one is not there within `wait` seconds
    (the input ran dry and the trainer blocks on it)."""
    import threading

    q: queue.Queue = queue.Queue(maxsize=8)
    stop = threading.Event()

    def put(item) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def reader() -> None:
        try:
            for item in items:
                if not put(item):
                    return
            put(_END)
        except BaseException as exc:  # raised in the trainer's thread
            put(exc)

    threading.Thread(target=reader, daemon=True, name="opd-train-reader").start()
    try:
        while True:
            try:
                item = q.get(timeout=wait)
            except queue.Empty:
                announce()
                item = q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def publish_reader(run_dir: Path, stream: StepBatches, trainer: Trainer | None = None) -> None:
    """RUN/reader.json: the step being filled and the records read so far, written when the input runs dry.
    The checkpoint being written is finished first, so a reader.json never names steps done that a rollout
    cannot find as checkpoints (it would take the trainer for one that does not save every step)."""
    if trainer is not None:
        trainer.flush()
    state = {"steps_done": stream.step, "filling": stream.step + 1, "records_read": stream.consumed,
             "pending": len(stream.pending), "groups_dropped": stream.groups_dropped, "time": time.time()}
    rundir.atomic_write_text(run_dir / rundir.READER, json.dumps(state) + "\n")


def run(config, inputs: list[str], stdout=None) -> int:
    """Train under the step budget; see the module docstring."""
    stdout = stdout or sys.stdout
    run_dir = Path(config.out)
    if int(os.environ.get("RANK", "0")) == 0:  # under accelerate launch, rank 0 owns the run directory
        prepare_run_dir(config, inputs)
    trainer = Trainer(config, run_dir)
    if trainer.world > 1:
        import torch.distributed as dist

        dist.barrier()
    start = rundir.read_latest(run_dir) if config.resume else None
    if start is not None:
        trainer.restore(start.path)
        if trainer.step >= config.max_steps:
            raise ConfigError(f"--resume: {run_dir} is complete ({start.name}, --max-steps {config.max_steps}); nothing to do")
        log.info("resuming from %s (step %d, %d records read)", start.name, trainer.step, trainer.consumed)
    if config.resume and trainer.rank == 0:
        ckpt.truncate_metrics(run_dir, trainer.step)
    items = iter_inputs(inputs, check=True)
    if not config.input_continues:
        items = skip_read(items, trainer.consumed, trainer.last_id)
    stream = StepBatches(items, config, _example_maker(config, trainer.tokenizer), trainer.consumed, trainer.pending)
    stream.last_id = trainer.last_id
    if trainer.rank == 0:
        stream.items = announce_waits(stream.items, functools.partial(publish_reader, run_dir, stream, trainer))
    if trainer.world > 1:  # rank 0 reads the input and sends each batch to the other ranks
        stream = distributed.SharedBatches(stream, trainer.rank)
    try:
        _loop(config, trainer, stream, run_dir, stdout)
    finally:
        trainer.flush()
    return _end(config, trainer)


def _loop(config, trainer: Trainer, stream, run_dir: Path, stdout) -> None:
    """The steps: read a batch, train, log a metrics line, checkpoint (see the module docstring)."""
    from opd_common.cli_util import progress

    tl = timeline("opd-train")
    metrics = None
    with open(run_dir / rundir.METRICS, "a") as metrics_file, \
            progress(config.max_steps, "step", config.quiet, "opd-train") as bar:
        bar.update(trainer.step)
        while trainer.step < config.max_steps:
            stream.step = trainer.step
            try:
                with tl.span("read", step=trainer.step + 1):
                    examples = stream.next_batch()
            except OpdError:  # e.g. dynamic sampling ran out of candidates: keep what was trained
                trainer.consumed, trainer.pending, trainer.last_id = stream.consumed, stream.pending, stream.last_id
                if trainer.step > trainer.last_saved:
                    trainer.save(metrics)
                raise
            trainer.consumed, trainer.pending, trainer.last_id = stream.consumed, stream.pending, stream.last_id
            if examples is None:
                break
            with tl.span("step", step=trainer.step + 1) as span:
                metrics = trainer.train_step(examples)
                span["tokens"] = metrics["tokens"]
            metrics.update(stream.last_stats)
            if trainer.rank == 0:
                line = json.dumps(metrics)
                metrics_file.write(line + "\n")
                metrics_file.flush()
                if config.metrics_stdout:
                    stdout.write(line + "\n")
                    stdout.flush()
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4g}", tok_s=f"{metrics['tokens_per_s']:.0f}")
            if config.save_every and trainer.step % config.save_every == 0 or trainer.step == config.max_steps:
                trainer.save(metrics)
    trainer.last_metrics = metrics


def _end(config, trainer: Trainer) -> int:
    """Exactly --max-steps, or a short run: saved, then an error unless --allow-short."""
    metrics = trainer.last_metrics
    if trainer.step < config.max_steps:
        if trainer.step > trainer.last_saved:
            trainer.save(metrics)
        where = f"{rundir.checkpoint_name(trainer.step)} saved" if trainer.step else "nothing saved"
        message = (f"the input ended after {trainer.step} of --max-steps {config.max_steps} steps "
                   f"({trainer.consumed} records read, {len(trainer.pending)} left in incomplete groups; {where})")
        trainer.flush()
        if not config.allow_short:
            raise ShortInput(message + "; give more input and --resume, or pass --allow-short to accept a short run")
        log.warning("%s (--allow-short)", message)
    return 0

