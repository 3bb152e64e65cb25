"""opd-rollout's pure entry point: run(config, inputs, writer) -> exit code."""

from __future__ import annotations

import functools
import itertools
import logging
import time
from pathlib import Path
from typing import Any

from opd_common import rundir
from opd_common.batching import batches
from opd_common.cli_util import leave_quietly
from opd_common.engines import derive_seed
from opd_common.errors import OpdError
from opd_common.prompts import Prompter, PromptRow, iter_prompt_rows, resolve_prompt_specs
from opd_common.records import LOGPROBS_KIND, SCHEMA, make_id
from opd_common.streams import BackgroundWriter, InputSource, reader_gone
from opd_common.timeline import timeline

log = logging.getLogger("opd-rollout")


@functools.lru_cache(maxsize=8)
def adapter_version(adapter: str | None) -> int:
    """policy.version: the trainer step of an opd-train checkpoint (its trainer_state.json), else 0."""
    return int(rundir.read_trainer_state(Path(adapter)).get("step", 0)) if adapter else 0


_CONFIGURED = object()


def make_record(config, row: PromptRow, sample: int, seed: int, prompt_ids: list[int], completion,
                adapter: str | None = _CONFIGURED) -> dict[str, Any]:
    """One record; `adapter` (default config.adapter; None = the base weights) is the checkpoint that sampled it."""
    adapter = config.adapter if adapter is _CONFIGURED else adapter
    rec: dict[str, Any] = {
        "schema": SCHEMA,
        "id": make_id(row.prompt_id, sample),
        "prompt_id": row.prompt_id,
        "sample": sample,
        "group_size": config.n,
        "example": row.row,
        "policy": {"model": config.model, "revision": config.revision, "adapter": adapter,
                   "version": adapter_version(adapter)},
        "sampling": {
            "temperature": config.temperature, "top_p": config.top_p, "top_k": config.top_k,
            "max_tokens": config.max_tokens, "seed": seed, "engine": config.engine_name,
            "thinking": config.thinking == "on", "logprobs": LOGPROBS_KIND,
        },
        "prompt_ids": prompt_ids,
        "response_ids": completion.response_ids,
        "finish_reason": completion.finish_reason,
        "response_text": completion.text,
        "logprobs": completion.logprobs,
    }
    if completion.topk_ids is not None:
        rec["topk_ids"] = completion.topk_ids
        rec["topk_logprobs"] = completion.topk_logprobs
    return rec


def run(config, inputs: list[str], writer, engine=None, sources: list[InputSource] | None = None) -> int:
    """Sample config.n responses per prompt row of `inputs` and write one record per sample."""
    import numpy as np

    from opd_common.cli_util import progress
    from opd_common.engines import make_engine
    from opd_common.models import load_tokenizer, render_messages

    rows = iter_prompt_rows(resolve_prompt_specs(inputs), config.id_field, sources, config.limit)
    follower = Follower(config) if config.follow else None
    if follower is not None:
        rows = follower.skip_trained(rows)
    tokenizer = load_tokenizer(config.model, config.revision)
    owns_engine = engine is None
    engine = engine or make_engine(config)
    config.engine_name = engine.name
    if follower is not None and hasattr(engine, "prepare_adapter"):
        engine.prepare_adapter(follower.lora_shape())  # hf: versions then load in place (no recompile)
    thinking = config.thinking == "on"
    prompter = Prompter(config.template, config.prompt_field, "opd-rollout")

    def requests_of(batch):
        requests, keys = [], []
        for row in batch:
            prompt_ids = np.asarray(render_messages(tokenizer, prompter.messages(row), thinking), dtype=np.int32)
            for sample in range(config.n):
                seed = derive_seed(config.seed, row.prompt_id, sample)
                requests.append(_request(prompt_ids, seed))
                keys.append((row, sample, seed, prompt_ids))
        return requests, keys

    out = _Output(config, writer, follower)
    # on a failure the batches made before it still go out; a write's error is raised on the way out
    with out.background, progress(None, "sample", config.quiet, "opd-rollout") as bar:
        out.bar = bar
        if follower is not None and config.max_lag >= 1 and hasattr(engine, "submit"):
            _pipelined(config, batches(rows, config.batch_prompts), engine, follower, requests_of, out)
        else:
            tl = timeline("opd-rollout")
            for batch in batches(rows, config.batch_prompts):
                if follower is not None and not follower.before_batch(engine):
                    break
                out.background.check()  # a reader gone: stop before decoding a batch nobody reads
                requests, keys = requests_of(batch)
                with tl.span("decode", batch=out.batches, version=follower.version if follower else 0,
                             **_sizes(requests)) as span:
                    completions = engine.generate(requests)
                    span["tokens"] = sum(len(c.response_ids) for c in completions)
                out.write(keys, completions, config.adapter)
    seconds = time.perf_counter() - out.t0
    log.info("%d samples, %d response tokens in %.1f s (%.0f tok/s, engine %s)",
             out.samples, out.tokens, seconds, out.tokens / max(seconds, 1e-9), engine.name)
    if owns_engine:
        engine.close()
    return 0


class _Output:
    """Counts a finished batch's records and hands them to a writer thread (BackgroundWriter: written in order,
    flushed per batch so pipes overlap), so that the engine loop goes on while the next stage has not read them:
    under --follow the trainer reads a step's records only after the step before, and a batch blocked in the
    pipe would otherwise hold back the next batch and the next adapter. At most --max-lag + 1 batches wait
    besides the one being written (the lag bounds how far the rollout runs ahead anyway); 1 without --follow."""

    def __init__(self, config, writer, follower):
        self.config, self.follower = config, follower
        depth = config.max_lag + 1 if follower is not None else 1
        self.background = BackgroundWriter(writer, depth, tool="opd-rollout", on_broken_pipe=leave_quietly)
        self.t0, self.tokens, self.samples, self.batches = time.perf_counter(), 0, 0, 0
        self.bar = None

    def write(self, keys, completions, adapter: str | None) -> None:
        records = [make_record(self.config, row, sample, seed, prompt_ids, completion, adapter)
                   for (row, sample, seed, prompt_ids), completion in zip(keys, completions, strict=True)]
        self.background.put(records, batch=self.batches)
        self.tokens += sum(len(c.response_ids) for c in completions)
        if self.follower is not None:
            self.follower.emitted += len(keys)
        self.samples += len(keys)
        self.batches += 1
        self.bar.update(len(keys))
        self.bar.set_postfix_str(f"{self.tokens / max(time.perf_counter() - self.t0, 1e-9):.0f} tok/s")


def _pipelined(config, source, engine, follower, requests_of, out: _Output) -> None:
    """--follow --max-lag L >= 1 on an engine that takes batches without waiting (vLLM): a batch starts as soon
    as the lag allows, while earlier ones still decode (each with the checkpoint it started with); batches are
    written in the order they started. The lag rule is the Follower's, unchanged: batch b starts only once the
    trainer has done b - L steps."""
    tl = timeline("opd-rollout")
    inflight: list[tuple] = []  # (tag, keys, adapter, start, version, sizes)
    finished: dict[int, list] = {}
    exhausted = stopped = False
    next_look, waiting_since = 0.0, None
    deadline = time.monotonic() + config.follow_timeout
    while True:
        if not (exhausted or stopped) and time.monotonic() >= next_look:
            verdict = follower.ready(busy=bool(inflight))
            next_look = time.monotonic() + 0.02
            if verdict is False:
                stopped = True
                engine.abort()
                inflight.clear()
            elif verdict:
                batch = next(source, None)
                if batch is None:
                    exhausted = True
                else:
                    if waiting_since is not None:
                        tl.event("wait", waiting_since, time.time(), batch=out.batches + len(inflight))
                        waiting_since = None
                    out.background.check()  # a reader gone: stop before decoding a batch nobody reads
                    follower.advance(engine)
                    requests, keys = requests_of(batch)
                    tag = out.batches + len(inflight)
                    engine.submit(tag, requests)
                    inflight.append((tag, keys, config.adapter, time.time(), follower.version, _sizes(requests)))
                    deadline = time.monotonic() + config.follow_timeout
                    continue
        if inflight:
            for tag, completions in engine.poll():
                finished[tag] = completions
            while inflight and inflight[0][0] in finished:
                tag, keys, adapter, start, version, sizes = inflight.pop(0)
                completions = finished.pop(tag)
                tl.event("decode", start, time.time(), batch=tag, version=version,
                         tokens=sum(len(c.response_ids) for c in completions), **sizes)
                out.write(keys, completions, adapter)
            continue
        if exhausted or stopped:
            return
        if waiting_since is None:
            waiting_since = time.time()
        if time.monotonic() > deadline:
            raise follower.timeout_error()
        follower.check_downstream()
        time.sleep(0.02)


class Follower:
    """--follow RUN_DIR: before batch b, wait until the trainer has done b - L steps, then sample with its
    newest checkpoint (policy.version = that step). Stops once the trainer has finished its budget.

    A trainer that drops records (dynamic sampling, --max-staleness) may need more than one batch for a
    step. When it has read every record emitted so far and waits for more (its RUN/reader.json), the
    rollout samples an extra batch with the newest checkpoint instead of waiting: that batch's version is
    the step before the one it fills, so --max-lag 0 stays strictly on-policy.
    """

    def __init__(self, config):
        self.config = config
        self.run_dir = Path(config.follow)
        self.run = rundir.RunReader(self.run_dir)  # config.json, latest and reader.json as the trainer writes them
        self.batch = 0
        self.version = 0
        self.emitted = 0  # records handed to the writer (written or queued), counted as records_read
        self.warned = False

    def lora_shape(self) -> dict:
        """The trainer's LoRA (r, alpha, targets) from the run's config.json, waiting for opd-train to write it."""
        deadline = time.monotonic() + self.config.follow_timeout
        while True:
            config = self.run.config()
            if "lora_r" in config:
                return {"r": config["lora_r"], "alpha": config["lora_alpha"], "targets": config["lora_targets"]}
            if time.monotonic() > deadline:
                raise OpdError(f"--follow {self.run_dir}: opd-train wrote no config.json there within --follow-timeout "
                               f"{self.config.follow_timeout:g} s (is it running with --out {self.run_dir}?)")
            self.check_downstream()
            time.sleep(0.1)

    def trainer_state(self) -> tuple[int, int | None, Path | None]:
        """(steps done, the run's --max-steps, newest adapter: the shared policy or the checkpoint) as the run dir
        says now."""
        max_steps = self.run.config().get("max_steps")
        newest = self.run.newest()
        return (0, max_steps, None) if newest is None else (newest.step, max_steps, newest.path)

    def check_checkpoints(self, state: dict, step: int) -> None:
        """Fail at once, not after --follow-timeout, when the trainer (its reader.json `state`) has read every
        record and waits for more that this rollout would only sample from a checkpoint the trainer is not
        going to write (it saves every N > 1 steps, or only at the end). `step` is the newest checkpoint's,
        read before `state`; the trainer saves a step before it reads for the next, so a checkpoint read
        after `state` is the one to trust."""
        done = state.get("steps_done", -1)
        if state.get("records_read", -1) < self.emitted or done <= step:
            return
        step = self.trainer_state()[0]
        if done > step:
            every = self.run.config().get("save_every")
            saves = f"--save-every {every}" if every else "no --save-every (it saves only at the end)"
            raise OpdError(f"--follow {self.run_dir}: the trainer has done {done} steps and waits for records, but its "
                           f"newest checkpoint is step {step} ({saves}), so this rollout cannot sample the next batch "
                           f"with --max-lag {self.config.max_lag}: run opd-train with --share-policy (or "
                           "--save-every 1) in a --follow loop")

    def skip_trained(self, rows):
        """A restarted loop: skip the prompts whose groups the run's newest checkpoint has trained on."""
        latest = self.run.latest()  # the checkpoint a restarted trainer resumes from (policy/ is cleared then)
        if latest is None:
            return rows
        step, path = latest.step, latest.path
        read = rundir.read_trainer_state(path).get("records_read", 0)
        skip = read // self.config.n
        self.batch = step
        self.emitted = read  # the resumed trainer counts on from here
        log.info("--follow: %s has trained %d steps on %d records; skipping the first %d prompts", path.name, step,
                 read, skip)
        return itertools.islice(rows, skip, None)

    def before_batch(self, engine) -> bool:
        """Wait for the trainer; load its newest checkpoint; False when the trainer is done."""
        deadline = time.monotonic() + self.config.follow_timeout
        with timeline("opd-rollout").span("wait", batch=self.batch):
            while True:
                verdict = self.ready()
                if verdict is not None:
                    break
                if time.monotonic() > deadline:
                    raise self.timeout_error()
                self.check_downstream()
                time.sleep(0.2)
        if verdict:
            self.advance(engine)
        return verdict

    def ready(self, busy: bool = False) -> bool | None:
        """One look at the run dir: True = the next batch may start (advance() first), False = the trainer has
        finished, None = wait. `busy`: a batch of this rollout is still decoding, so a trainer that has read
        every record written is not starved (it is waiting for that batch)."""
        step, max_steps, path = self.trainer_state()
        if max_steps is not None and step >= max_steps:
            log.info("the trainer in %s finished its %d steps; stopping", self.run_dir, max_steps)
            return False
        extra = step < self.batch - self.config.max_lag
        if extra:
            if busy:
                return None
            state = self.run.reader()
            if not (state.get("steps_done") == step and state.get("records_read", -1) >= self.emitted):
                self.check_checkpoints(state, step)
                return None  # not starved: it has records to train on, or has not read them yet
        self._next = (step, path, extra)
        return True

    def advance(self, engine) -> None:
        """Start the batch ready() allowed: switch the engine to the newest checkpoint if it changed."""
        step, path, extra = self._next
        if path is not None and step != self.version:
            adapter_version.cache_clear()
            with timeline("opd-rollout").span("adapter", version=step):
                engine.set_adapter(str(path), step)
            self.config.adapter = str(path)  # stamped into the records with its version
            self.version = step
            log.info("batch %d: sampling with %s (version %d)", self.batch, path.name, step)
        if extra:
            self.extra_batch(step)
        else:
            self.batch += 1

    def check_downstream(self) -> None:
        """While waiting for the trainer: a closed stdout (the scorer or trainer downstream has gone, e.g. opd-train
        refused its --out) ends the rollout now, as a write would, rather than after --follow-timeout."""
        if not getattr(self.config, "out", None) and reader_gone():
            raise BrokenPipeError("the rollout's stdout was closed by the rest of the pipeline")

    def timeout_error(self) -> OpdError:
        step = self.trainer_state()[0]
        read = self.run.reader().get("records_read")
        reading = "" if read is None else f"; it has read {read} of the {self.emitted} records sampled"
        return OpdError(f"--follow {self.run_dir}: the trainer is at step {step}, batch {self.batch} needs step "
                        f">= {self.batch - self.config.max_lag}, and nothing changed for --follow-timeout "
                        f"{self.config.follow_timeout:g} s{reading} "
                        "(is opd-train running with --share-policy or --save-every 1?)")

    def extra_batch(self, step: int) -> None:
        log.info("the trainer read all %d records and needs more for step %d (it dropped groups: "
                 "dynamic sampling or --max-staleness); "
                 "sampling another batch with version %d", self.emitted, step + 1, step)
        if self.config.max_lag == 0 and self.run.config().get("max_staleness") != 0 and not self.warned:
            self.warned = True
            log.warning("--max-lag 0: groups left over from an extra batch are trained a step later unless "
                        "opd-train has --max-staleness 0 (it drops them), as the strictly on-policy loop needs")


def _sizes(requests) -> dict:
    """A batch's size for its timeline span (the loop benchmark's roofline)."""
    return {"samples": len(requests), "prompt_tokens": sum(len(r.prompt_ids) for r in requests)}


def _request(prompt_ids, seed):
    from opd_common.engines import SampleRequest

    return SampleRequest(prompt_ids=prompt_ids.tolist(), seed=seed)
