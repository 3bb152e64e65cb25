"""opd-rollout's pure entry point: run(config, inputs, writer) -> exit code."""

from __future__ import annotations

import functools
import itertools
import json
import logging
import time
from pathlib import Path
from typing import Any

from opd_common.batching import batches
from opd_common.errors import OpdError
from opd_common.records import LOGPROBS_KIND, SCHEMA, make_id
from opd_common.streams import InputSource

from .prompts import PromptRow, iter_prompt_rows, render_message, resolve_prompt_specs
from .sampling import derive_seed

log = logging.getLogger("opd-rollout")
READER = "reader.json"  # opd-train's input reader state in its run dir (opd_train.run.READER)


@functools.lru_cache(maxsize=8)
def adapter_version(adapter: str | None) -> int:
    """policy.version: the trainer step of an opd-train checkpoint (its trainer_state.json), else 0."""
    state = Path(adapter) / "trainer_state.json" if adapter else None
    if state is None or not state.is_file():
        return 0
    return int(json.loads(state.read_text()).get("step", 0))


def make_record(config, row: PromptRow, sample: int, seed: int, prompt_ids: list[int], completion) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "schema": SCHEMA,
        "id": make_id(row.prompt_id, sample),
        "prompt_id": row.prompt_id,
        "sample": sample,
        "group_size": config.n,
        "example": row.row,
        "policy": {"model": config.model, "revision": config.revision, "adapter": config.adapter,
                   "version": adapter_version(config.adapter)},
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
    from opd_common.models import load_tokenizer, render_chat

    from .engines import make_engine

    rows = iter_prompt_rows(resolve_prompt_specs(inputs), config.id_field, sources, config.limit)
    follower = Follower(config) if config.follow else None
    if follower is not None:
        rows = follower.skip_trained(rows)
    tokenizer = load_tokenizer(config.model, config.revision)
    owns_engine = engine is None
    engine = engine or make_engine(config)
    config.engine_name = engine.name
    thinking = config.thinking == "on"
    t0, tokens, samples = time.perf_counter(), 0, 0
    with progress(None, "sample", config.quiet, "opd-rollout") as bar:
        for batch in batches(rows, config.batch_prompts):
            if follower is not None and not follower.before_batch(engine):
                break
            requests, keys = [], []
            for row in batch:
                message = render_message(config.template, row.row, config.prompt_field, row.where)
                prompt_ids = np.asarray(render_chat(tokenizer, message, thinking), dtype=np.int32)
                for sample in range(config.n):
                    seed = derive_seed(config.seed, row.prompt_id, sample)
                    requests.append(_request(prompt_ids, seed))
                    keys.append((row, sample, seed, prompt_ids))
            for (row, sample, seed, prompt_ids), completion in zip(keys, engine.generate(requests), strict=True):
                writer.write(make_record(config, row, sample, seed, prompt_ids, completion))
                tokens += len(completion.response_ids)
            writer.flush()
            if follower is not None:
                follower.emitted += len(requests)
            samples += len(requests)
            bar.update(len(requests))
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
    seconds = time.perf_counter() - t0
    log.info("%d samples, %d response tokens in %.1f s (%.0f tok/s, engine %s)",
             samples, tokens, seconds, tokens / max(seconds, 1e-9), engine.name)
    if owns_engine:
        engine.close()
    return 0


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
        self.batch = 0
        self.version = 0
        self.emitted = 0  # records written, counted as the trainer counts records_read (from the run's start)
        self.before = self.reader_text()  # a reader.json already there is a previous (killed) trainer's
        self.warned = False

    def reader_text(self) -> str | None:
        try:
            return (self.run_dir / READER).read_text()
        except OSError:
            return None

    def run_config(self) -> dict:
        config_file = self.run_dir / "config.json"
        return json.loads(config_file.read_text())["config"] if config_file.exists() else {}

    def trainer_state(self) -> tuple[int, int | None, Path | None]:
        """(steps done, the run's --max-steps, newest checkpoint) as the run dir says now."""
        max_steps = self.run_config().get("max_steps")
        latest = self.run_dir / "latest"
        if not latest.exists():
            return 0, max_steps, None
        path = self.run_dir / latest.read_text().strip()
        return adapter_version(str(path)), max_steps, path

    def reader(self) -> dict:
        """The trainer's RUN/reader.json, written each time its input runs dry ({} when absent or older)."""
        text = self.reader_text()
        if text is None or text == self.before:
            return {}
        try:
            state = json.loads(text)
        except ValueError:
            return {}
        return state if isinstance(state, dict) else {}

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
            every = self.run_config().get("save_every")
            saves = f"--save-every {every}" if every else "no --save-every (it saves only at the end)"
            raise OpdError(f"--follow {self.run_dir}: the trainer has done {done} steps and waits for records, but its "
                           f"newest checkpoint is step {step} ({saves}), so this rollout cannot sample the next batch "
                           f"with --max-lag {self.config.max_lag}: run opd-train with --save-every 1 in a --follow loop")

    def skip_trained(self, rows):
        """A restarted loop: skip the prompts whose groups the run's newest checkpoint has trained on."""
        step, _, path = self.trainer_state()
        if path is None:
            return rows
        read = json.loads((path / "trainer_state.json").read_text()).get("records_read", 0)
        skip = read // self.config.n
        self.batch = step
        self.emitted = read  # the resumed trainer counts on from here
        log.info("--follow: %s has trained %d steps on %d records; skipping the first %d prompts", path.name, step,
                 read, skip)
        return itertools.islice(rows, skip, None)

    def before_batch(self, engine) -> bool:
        """Wait for the trainer; load its newest checkpoint; False when the trainer is done."""
        deadline = time.monotonic() + self.config.follow_timeout
        while True:
            step, max_steps, path = self.trainer_state()
            if max_steps is not None and step >= max_steps:
                log.info("the trainer in %s finished its %d steps; stopping", self.run_dir, max_steps)
                return False
            extra = step < self.batch - self.config.max_lag
            if not extra:
                break
            state = self.reader()
            if state.get("steps_done") == step and state.get("records_read", -1) >= self.emitted:
                break  # starved: it has read every record emitted so far and waits for more
            self.check_checkpoints(state, step)
            if time.monotonic() > deadline:
                read = state.get("records_read")
                reading = "" if read is None else f"; it has read {read} of the {self.emitted} records sampled"
                raise OpdError(f"--follow {self.run_dir}: the trainer is at step {step}, batch {self.batch} needs step "
                               f">= {self.batch - self.config.max_lag}, and nothing changed for --follow-timeout "
                               f"{self.config.follow_timeout:g} s{reading} (is opd-train running with --save-every 1?)")
            time.sleep(0.2)
        if path is not None and step != self.version:
            adapter_version.cache_clear()
            engine.set_adapter(str(path), step)
            self.config.adapter = str(path)  # stamped into the records with its version
            self.version = step
            log.info("batch %d: sampling with %s (version %d)", self.batch, path.name, step)
        if extra:
            self.extra_batch(step)
        else:
            self.batch += 1
        return True

    def extra_batch(self, step: int) -> None:
        log.info("the trainer read all %d records and needs more for step %d (it dropped groups: "
                 "dynamic sampling or --max-staleness); "
                 "sampling another batch with version %d", self.emitted, step + 1, step)
        if self.config.max_lag == 0 and self.run_config().get("max_staleness") != 0 and not self.warned:
            self.warned = True
            log.warning("--max-lag 0: groups left over from an extra batch are trained a step later unless "
                        "opd-train has --max-staleness 0 (it drops them), as the strictly on-policy loop needs")


def _request(prompt_ids, seed):
    from .engines import SampleRequest

    return SampleRequest(prompt_ids=prompt_ids.tolist(), seed=seed)
