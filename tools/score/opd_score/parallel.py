"""Data-parallel scoring: one worker process per device, windows back in input order.

The parent reads the stream and cuts it into windows exactly as a single process does; windows go
to a shared task queue that N spawned workers (each with its own teachers on its own GPU, or a
share of the CPU cores) drain. Results come back tagged with their window number and the parent
yields them in order, so the output is the same records in the same order as one process, and
``--out``/``--resume`` work unchanged (only the parent writes). At most 2 x N windows are in flight.
A feeder thread reads the input, so a scored window goes out while the input pauses.
"""

from __future__ import annotations

import functools
import itertools
import os
import pickle
import queue
import traceback
from collections.abc import Iterator

from opd_common.cli_util import stopped_on_leaving
from opd_common.errors import ConfigError

_STOP = None
_COUNTS = "counts"  # a worker's last message: its alignment counts per teacher (cross.AlignCounts), or its error


def worker_devices(config, n: int) -> list[dict]:
    """Per worker: environment and torch device. GPUs: one each (CUDA_VISIBLE_DEVICES); CPU: threads."""
    import torch

    if config.device not in ("auto", "cuda") and not config.device.startswith("cuda"):
        threads = max(1, (os.cpu_count() or 1) // n)
        return [{"env": {"OMP_NUM_THREADS": str(threads)}, "device": config.device, "threads": threads}] * n
    if not torch.cuda.is_available():
        if config.device == "auto":
            threads = max(1, (os.cpu_count() or 1) // n)
            return [{"env": {"OMP_NUM_THREADS": str(threads)}, "device": "cpu", "threads": threads}] * n
        raise ConfigError(f"--device {config.device}: CUDA is not available here")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(torch.cuda.device_count())]
    if n > len(ids):
        raise ConfigError(f"--data-parallel {n}: only {len(ids)} GPU(s) visible ({','.join(ids)}); "
                          f"use --data-parallel {len(ids)} or make more GPUs visible")
    return [{"env": {"CUDA_VISIBLE_DEVICES": ids[r]}, "device": "cuda", "threads": None} for r in range(n)]


def _worker(rank: int, config, setup: dict, tasks, results) -> None:
    os.environ.update(setup["env"])
    try:
        import torch

        if setup["threads"]:
            torch.set_num_threads(setup["threads"])
        from .scorer import Scorer

        config.device = setup["device"]
        scorer = Scorer(config)
        try:
            while (task := tasks.get()) is not _STOP:
                number, window = task
                if not scorer.opened:
                    scorer.open(window[0][0])
                scorer.score(window)
                results.put((number, rank, window))
        finally:
            scorer.close(report=False)
        # the last message, once the teachers are released: the parent logs the sum over workers
        results.put((_COUNTS, rank, scorer.align_counts))
    except BaseException as exc:  # the parent re-raises it (this worker's last message, in place of the counts)
        results.put((None, rank, _picklable(exc)))


def _picklable(exc: BaseException) -> BaseException:
    """`exc`, or its traceback as a RuntimeError when it cannot cross to the parent (mp.Queue pickles in a
    background thread, so an unpicklable exception would be dropped without a word)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return RuntimeError("".join(traceback.format_exception(exc)).rstrip())


def score_in_workers(config, windows: Iterator[list], n: int) -> Iterator[list]:
    """Yield scored windows in input order, scored by `n` worker processes."""
    import multiprocessing as mp

    setups = worker_devices(config, n)
    ctx = mp.get_context("spawn")
    tasks, results = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, config, setups[r], tasks, results), daemon=False,
                         name=f"opd-score-worker-{r}") for r in range(n)]
    for p in procs:
        p.start()
    with stopped_on_leaving(functools.partial(_stop, procs)):  # a reader gone ends this process with os._exit
        yield from _in_order(windows, procs, tasks, results, n)


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()


def _in_order(windows: Iterator[list], procs: list, tasks, results, n: int) -> Iterator[list]:
    """score_in_workers' parent side: feed the windows, yield the results in input order, then stop the workers
    and log their alignment counts; any worker still alive at the end (an error) is terminated."""
    import threading

    # A feeder thread hands windows out as they arrive, so a scored window goes out while the input
    # pauses (the on-policy loop: the rollout waits for the trainer, which waits for these records).
    slots = threading.Semaphore(2 * n)
    fed: dict = {"total": None, "error": None}

    def feed() -> None:
        submitted = 0
        try:
            while slots.acquire() and (window := next(windows, None)) is not None:
                tasks.put((submitted, window))
                submitted += 1
        except BaseException as exc:  # raised by the consumer below
            fed["error"] = exc
        fed["total"] = submitted

    threading.Thread(target=feed, daemon=True, name="opd-score-feeder").start()
    done: dict[int, list] = {}
    emitted = 0
    stopped = threading.Event()  # set once the workers were told to stop: a worker may end then
    messages = _messages(results, procs, stopped)
    try:
        while fed["total"] is None or emitted < fed["total"]:
            if (message := next(messages)) is None:
                continue  # nothing yet: the input may have ended meanwhile
            number, payload = message
            done[number] = payload
            while emitted in done:
                yield done.pop(emitted)
                emitted += 1
                slots.release()
        if fed["error"] is not None:
            raise fed["error"]
        for _ in procs:
            tasks.put(_STOP)
        stopped.set()
        # each worker's last message: its alignment counts, logged once per teacher as one process logs them
        parts = [m[1] for m in itertools.islice(filter(None, messages), len(procs))]
        if any(parts):
            from .cross import log_counts, merge_counts

            log_counts(merge_counts(parts))
        for p in procs:
            p.join(timeout=60)
    finally:
        _stop(procs)


def _messages(results, procs, stopped) -> Iterator[tuple | None]:
    """(window number or _COUNTS, payload) as workers send them, None after 0.2 s without one. A worker's
    exception is raised here. A worker gone before `stopped` is set (the parent sent _STOP), or gone with a
    failing exit code (killed, out of memory), is named, and so is the end of every worker after _STOP: each
    only after a second empty read, since a message sent just before a worker ended is in the pipe by then."""
    strikes = 0
    while True:
        try:
            number, _rank, payload = results.get(timeout=0.2)
        except queue.Empty:
            dead = [p for p in procs if not p.is_alive() and (p.exitcode != 0 or not stopped.is_set())]
            ended = stopped.is_set() and not any(p.is_alive() for p in procs)
            strikes = strikes + 1 if dead or ended else 0
            if strikes == 2 and dead:
                raise RuntimeError(f"scoring worker {dead[0].name} died (exit code {dead[0].exitcode}); "
                                   "see its messages above") from None
            if strikes == 2:
                raise RuntimeError("every scoring worker exited before sending its alignment counts; "
                                   "see their messages above") from None
            yield None
            continue
        strikes = 0
        if isinstance(payload, BaseException):
            raise payload
        yield number, payload
