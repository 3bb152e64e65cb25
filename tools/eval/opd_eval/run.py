"""`opd-eval run`'s pure entry point: run(config) -> exit code (docs/eval.md).

Problems x n samples are drawn with opd_common's engines and prompt rendering, as opd-rollout draws them
(same template, chat template applied once, one derived seed per sample), in chunks: each chunk is graded by the
shared grader's worker pool and appended to the progress file before the next one starts. Then
the metrics are computed over all rows and the results file is written atomically.
"""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path
from typing import Any

import orjson

from opd_common import rundir
from opd_common.errors import ConfigError, RecordError
from opd_common.models import check_model_ref

from .benchmarks import Benchmark, Problem, load_benchmark
from .results import (
    SCHEMA,
    ProgressWriter,
    adapter_identity,
    check_resumable,
    iso_now,
    model_identity,
    prepare_output,
    read_progress,
    write_results,
)

log = logging.getLogger("opd-eval")


# ---------------------------------------------------------------------------------- adapters


def resolve_adapter(config) -> tuple[str | None, int | None]:
    """(adapter folder or None, training step or None) from --adapter or --run-dir/--checkpoint."""
    if config.adapter:
        return _check_adapter(Path(config.adapter), "--adapter"), _step_of(Path(config.adapter))
    if not config.run_dir:
        return None, 0  # the base model is step 0
    run_dir = Path(config.run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: no such directory")
    wanted = config.checkpoint or rundir.LATEST
    if wanted == rundir.LATEST:
        found = rundir.read_latest(run_dir)
        if found is None:
            raise ConfigError(f"--run-dir {run_dir}: no '{rundir.LATEST}' file yet (no checkpoint written); "
                              f"give --checkpoint N{_available(run_dir)}")
    else:
        found = _checkpoint_at(run_dir, wanted)
        if found is None:
            return None, 0
    return str(found.path), _step_of(found.path)


def _checkpoint_at(run_dir: Path, wanted: str) -> rundir.Checkpoint | None:
    """--checkpoint N: the finished checkpoint of step N (None: step 0 of a run without a checkpoint-000000)."""
    if not re.fullmatch(r"\d+", wanted):
        raise ConfigError(f"--checkpoint must be a step number or '{rundir.LATEST}', got {wanted!r}")
    found = rundir.find_checkpoint(run_dir, int(wanted))
    name = rundir.checkpoint_name(int(wanted))
    if found is None and int(wanted) == 0 and not (run_dir / name).exists():
        log.info("--checkpoint 0: %s has no %s, evaluating the base model (step 0)", run_dir, name)
        return None
    if found is None:
        raise ConfigError(f"--checkpoint {wanted}: {run_dir} has no {name}/{_available(run_dir)}")
    return found


def _available(run_dir: Path) -> str:
    steps = [c.step for c in rundir.list_checkpoints(run_dir)]
    return f" (checkpoints there: {', '.join(map(str, steps))})" if steps else " (it has no checkpoints)"


def _check_adapter(folder: Path, flag: str) -> str:
    if not (folder / rundir.ADAPTER_CONFIG).is_file():
        raise ConfigError(f"{flag}: {folder} has no {rundir.ADAPTER_CONFIG} (expected a peft LoRA folder)")
    return str(folder)


def _step_of(folder: Path) -> int | None:
    """The trainer step of an adapter: trainer_state.json's 'step', else a checkpoint-N name."""
    step = rundir.read_trainer_state(folder).get("step")
    return step if isinstance(step, int) else rundir.parse_checkpoint_name(folder.name)


# ------------------------------------------------------------------------------- evaluation


def run(config, engine=None) -> int:
    """Evaluate config.model (+ adapter) on the benchmark; write config.out. `engine`: an
    opd_common engine to use instead of building one (tests)."""
    t0 = time.perf_counter()
    bench = load_benchmark(config.bench, config.data, id_field=config.id_field, answer_field=config.answer_field,
                           limit=config.limit)
    adapter, step = resolve_adapter(config)
    check_model_ref(config.model)
    out = Path(config.out)
    progress_file = prepare_output(out, config.resume, config.overwrite)
    header = {"schema": SCHEMA, "model": model_identity(config.model, config.revision),
              "adapter": adapter_identity(adapter, step, config.run_dir),
              "benchmark": bench.describe(config.limit), "sampling": config.sampling()}
    rows: list[dict] = []
    if config.resume:
        old, rows = read_progress(progress_file)
        check_resumable(old, header, progress_file)
        log.info("resuming: %d of %d samples already graded", len(rows), len(bench.problems) * config.n)
    writer = ProgressWriter(progress_file, None if config.resume else header)
    done = {(r["prompt_id"], r["sample"]) for r in rows}
    todo = [(p, s) for p in bench.problems for s in range(config.n) if (p.prompt_id, s) not in done]
    engine_name = config.engine
    try:
        if todo:
            engine_name = _sample_and_grade(config, adapter, todo, writer, rows, engine)
    finally:
        writer.close()
    results = assemble(header, config, bench, rows, step, engine_name, time.perf_counter() - t0)
    write_results(out, results)
    progress_file.unlink()
    from .render import run_table

    print(run_table(results), file=sys.stderr)
    overall = {k: v for k, v in results["metrics"]["overall"].items() if k not in ("length", "reasons")}
    sys.stdout.write(orjson.dumps({"results": str(out), "benchmark": bench.name, "step": step, **overall}).decode()
                     + "\n")
    return 0


def _sample_and_grade(config, adapter: str | None, todo: list[tuple[Problem, int]], writer: ProgressWriter,
                      rows: list[dict], engine=None) -> str:
    """Generate, grade and save `todo` in chunks; returns the engine's name."""
    from opd_common.cli_util import progress
    from opd_common.engines import SampleRequest, derive_seed, make_engine
    from opd_common.grading import Grader
    from opd_common.models import load_tokenizer, render_messages
    from opd_common.prompts import Prompter, PromptRow

    tokenizer = load_tokenizer(config.model, config.revision)
    thinking = config.thinking == "on"
    prompter = Prompter(config.template, config.problem_field, "opd-eval")
    prompts: dict[str, list[int]] = {}
    for problem, _ in todo:
        if problem.prompt_id not in prompts:
            messages = prompter.messages(PromptRow(problem.prompt_id, problem.row, problem.where))
            prompts[problem.prompt_id] = render_messages(tokenizer, messages, thinking)
    with Grader(workers=config.grade_workers, timeout=config.grade_timeout) as grader:
        if config.grader == "integer":
            _check_integer_golds(grader, {p.prompt_id: p for p, _ in todo}.values())
        owns_engine = engine is None
        engine = engine or make_engine(config.engine_config(adapter=adapter))
        try:
            with progress(len(todo), "sample", config.quiet, "opd-eval") as bar:
                for start in range(0, len(todo), config.chunk):
                    chunk = todo[start:start + config.chunk]
                    seeds = [derive_seed(config.seed, p.prompt_id, s) for p, s in chunk]
                    requests = [SampleRequest(prompt_ids=prompts[p.prompt_id], seed=seed)
                                for (p, _), seed in zip(chunk, seeds, strict=True)]
                    completions = engine.generate(requests)
                    grades = grader.grade([(c.text, p.answer) for (p, _), c in zip(chunk, completions, strict=True)],
                                          config.grader)
                    new = [sample_row(p, s, seed, c, g, config.keep_text)
                           for (p, s), seed, c, g in zip(chunk, seeds, completions, grades, strict=True)]
                    writer.append_lines(new)
                    rows.extend(new)
                    bar.update(len(new))
        finally:
            if owns_engine:
                engine.close()
    return engine.name


def _check_integer_golds(grader, problems) -> None:
    """--grader integer needs integer golds: find a bad one before any sampling, naming its line."""
    for p in problems:
        try:
            grader.grade([(f"\\boxed{{{p.answer}}}", p.answer)], "integer")
        except RecordError as exc:
            raise RecordError(f"{p.where.at}: {exc}") from None


def sample_row(problem: Problem, sample: int, seed: int, completion, grade, keep_text: bool) -> dict[str, Any]:
    from opd_common.grading import extract_answer

    _, how = extract_answer(completion.text)
    row = {"prompt_id": problem.prompt_id, "sample": sample, "seed": seed,
           "finish_reason": completion.finish_reason, "length": int(len(completion.response_ids)),
           "answer_from": None if how == "none" else how, "extracted": grade.extracted,
           "correct": bool(grade.correct), "reason": grade.reason}
    if keep_text:
        row["response_text"] = completion.text
    return row


def assemble(header: dict, config, bench: Benchmark, rows: list[dict], step: int | None, engine: str,
             seconds: float) -> dict[str, Any]:
    """The results document (docs/eval.md, "Results file")."""
    from opd_common import __version__
    from opd_common.config import resolved

    from .metrics import summarize
    from .stats import RESAMPLES, bootstrap_ci

    order = {p.prompt_id: i for i, p in enumerate(bench.problems)}
    rows = sorted(rows, key=lambda r: (order[r["prompt_id"]], r["sample"]))
    metrics = summarize(rows, order=list(order))
    golds = {p.prompt_id: p.answer for p in bench.problems}
    for entry in metrics["per_problem"]:
        entry["answer"] = golds[entry["prompt_id"]]
    accuracies = [p["accuracy"] for p in metrics["per_problem"]]
    lo, hi = bootstrap_ci(accuracies, RESAMPLES, seed=0)
    metrics["overall"]["avg_ci"] = {"lo": lo, "hi": hi, "level": 0.95, "resamples": RESAMPLES, "seed": 0,
                                    "method": "percentile bootstrap over problems"}
    return {
        "schema": SCHEMA, "tool": {"name": "opd-eval", "version": __version__}, "created": iso_now(),
        "config": resolved(config), "model": header["model"], "adapter": header["adapter"], "step": step,
        "benchmark": header["benchmark"], "sampling": header["sampling"], "engine": engine,
        "metrics": metrics,
        "timing": {"seconds": round(seconds, 3), "response_tokens": sum(r["length"] for r in rows),
                   "resumed": bool(config.resume)},
        "samples": rows,
    }
