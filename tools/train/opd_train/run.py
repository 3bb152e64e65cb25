"""opd-train's pure entry point: run(config, inputs, stdout, on_save) -> exit code.

run() is four named steps: open_run (a new, --overwrite or --resume run: the run directory and the
Trainer of trainer.py), open_input (the step batches), train_loop and end_of_input (the ending when
the input runs out before --max-steps). The loop: read the next step's batch lazily, cut it into
micro-batches by token budget, forward/backward each (losses are token sums over the whole step's
token count, so any cut gives the same gradient), clip, AdamW step, log one metrics line, checkpoint
every --save-every steps and at the end. Exactly --max-steps steps; --resume continues from
`latest`. Whenever the input runs dry mid-step, `reader.json` in the run directory says how many
records were read and which step waits for more (opd-rollout --follow samples again for a trainer
starved by dynamic sampling).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import queue
import shutil
import sys
import time
from pathlib import Path

from opd_common import rundir
from opd_common.errors import ConfigError, OpdError
from opd_common.records import Where
from opd_common.streams import iter_inputs
from opd_common.timeline import timeline

from . import checkpoint as ckpt
from . import distributed
from .data import StepBatches, make_example
from .trainer import OnSave, Trainer

log = logging.getLogger("opd-train")

_END = object()

# options that may differ between a run and its --resume
NOT_COMPARED = {"resume", "overwrite", "quiet", "metrics_stdout", "device", "publish", "input_continues",
                "share_policy"}


class ShortInput(OpdError):
    """The input ended before --max-steps."""


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
        shutil.rmtree(run_dir / rundir.POLICY, ignore_errors=True)  # the killed trainer's steps past `latest`
        return run_dir
    if run_dir.exists() and any(run_dir.iterdir()):
        if not config.overwrite:
            raise ConfigError(f"--out {run_dir} is not empty; use --resume to continue its run "
                              "or --overwrite to replace it")
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
    The checkpoint (and shared policy) being written is finished first, so a reader.json never names steps done
    that a rollout cannot find (it would take the trainer for one that does not save every step)."""
    if trainer is not None:
        trainer.flush()
    state = {"steps_done": stream.step, "filling": stream.step + 1, "records_read": stream.consumed,
             "pending": len(stream.pending), "groups_dropped": stream.groups_dropped, "time": time.time()}
    rundir.atomic_write_text(run_dir / rundir.READER, json.dumps(state) + "\n")


def run(config, inputs: list[str], stdout=None, on_save: OnSave | None = None) -> int:
    """Train under the step budget (see the module docstring): open the run, open the input, the steps, and
    the ending when the input ran out first. on_save(run_dir, step) runs after each checkpoint is on disk
    (cli.py: --publish's, publishing.py)."""
    stdout = stdout or sys.stdout
    trainer = open_run(config, inputs, on_save)
    stream = open_input(config, inputs, trainer)
    try:
        train_loop(config, trainer, stream, stdout)
    finally:
        trainer.flush()
    return end_of_input(config, trainer)


def open_run(config, inputs: list[str], on_save: OnSave | None = None) -> Trainer:
    """A new run (--overwrite: replacing one) or --resume's: the run directory (rank 0), the trainer,
    and with --resume its state at `latest`."""
    run_dir = Path(config.out)
    if int(os.environ.get("RANK", "0")) == 0:  # under accelerate launch, rank 0 owns the run directory
        prepare_run_dir(config, inputs)
    trainer = Trainer(config, run_dir, on_save=on_save)
    if trainer.world > 1:
        import torch.distributed as dist

        dist.barrier()
    if config.resume:
        resume(trainer, run_dir)
    return trainer


def resume(trainer: Trainer, run_dir: Path) -> None:
    """--resume: the trainer's state from `latest` (none yet: from the start), metrics.jsonl cut back to it."""
    config = trainer.config
    start = rundir.read_latest(run_dir)
    if start is not None:
        trainer.restore(start.path)
        if trainer.step >= config.max_steps:
            raise ConfigError(f"--resume: {run_dir} is complete ({start.name}, --max-steps {config.max_steps}); "
                              "nothing to do")
        log.info("resuming from %s (step %d, %d records read)", start.name, trainer.step, trainer.consumed)
    if trainer.rank == 0:
        ckpt.truncate_metrics(run_dir, trainer.step)


def open_input(config, inputs: list[str], trainer: Trainer):
    """The step batches: the inputs after what the run has read, through a reader thread on rank 0 that
    writes reader.json whenever the input runs dry; under several ranks rank 0 reads for all of them."""
    items = iter_inputs(inputs, check=True)
    if not config.input_continues:
        items = skip_read(items, trainer.consumed, trainer.last_id)
    stream = StepBatches(items, config, _example_maker(config, trainer.tokenizer), trainer.consumed, trainer.pending)
    stream.last_id = trainer.last_id
    if trainer.rank == 0:
        stream.items = announce_waits(stream.items, functools.partial(publish_reader, trainer.run_dir, stream, trainer))
    if trainer.world > 1:  # rank 0 reads the input and sends each batch to the other ranks
        stream = distributed.SharedBatches(stream, trainer.rank)
    return stream


def train_loop(config, trainer: Trainer, stream, stdout) -> None:
    """The steps: read a batch, train, log a metrics line, checkpoint (see the module docstring)."""
    from opd_common.cli_util import progress

    tl = timeline("opd-train")
    metrics = None
    with open(trainer.run_dir / rundir.METRICS, "a") as metrics_file, \
            progress(config.max_steps, "step", config.quiet, "opd-train") as bar:
        bar.update(trainer.step)
        while trainer.step < config.max_steps:
            examples = read_batch(trainer, stream, metrics)
            if examples is None:
                break
            with tl.span("step", step=trainer.step + 1) as span:
                metrics = trainer.train_step(examples)
                span["tokens"] = metrics["tokens"]
            metrics.update(stream.last_stats)
            if trainer.rank == 0:
                log_metrics(metrics, metrics_file, stdout if config.metrics_stdout else None)
            bar.update(1)
            bar.set_postfix(loss=f"{metrics['loss']:.4g}", tok_s=f"{metrics['tokens_per_s']:.0f}")
            trainer.share_policy()
            if config.save_every and trainer.step % config.save_every == 0 or trainer.step == config.max_steps:
                trainer.save(metrics)
    trainer.last_metrics = metrics


def read_batch(trainer: Trainer, stream, metrics: dict | None):
    """The next step's examples (None: the input ended), the reader's position kept in the trainer. When
    reading fails (e.g. dynamic sampling ran out of candidates), what was trained is saved first."""
    stream.step = trainer.step
    try:
        with timeline("opd-train").span("read", step=trainer.step + 1):
            examples = stream.next_batch()
    except OpdError:
        trainer.consumed, trainer.pending, trainer.last_id = stream.consumed, stream.pending, stream.last_id
        if trainer.step > trainer.last_saved:
            trainer.save(metrics)
        raise
    trainer.consumed, trainer.pending, trainer.last_id = stream.consumed, stream.pending, stream.last_id
    return examples


def log_metrics(metrics: dict, metrics_file, stdout=None) -> None:
    """One line of metrics.jsonl (and of stdout with --metrics-stdout), flushed."""
    line = json.dumps(metrics)
    metrics_file.write(line + "\n")
    metrics_file.flush()
    if stdout is not None:
        stdout.write(line + "\n")
        stdout.flush()


def end_of_input(config, trainer: Trainer) -> int:
    """Exactly --max-steps, or a short run (the input ran out first): saved, then an error unless --allow-short."""
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
