"""run(config, inputs): sample a few prompts through the real engine, then run each check (checks.py,
checks_train.py) and print one line per check; 1 when any check fails."""

from __future__ import annotations

import logging
import shutil
import sys
import tempfile
from pathlib import Path

from opd_common.errors import OpdError

from .report import Result, as_json, text

log = logging.getLogger("opd-check")


class NoSamples(OpdError):
    """opd-rollout gave no samples: the checks that read them are skipped."""


class Context:
    """What the checks share, each piece made once when first asked for: tokenizers, the samples, forwards."""

    def __init__(self, config, inputs: list[str], work: Path):
        self.config, self.inputs, self.work = config, inputs, work
        self._tokenizers: dict = {}
        self._same: dict[str, bool] = {}  # teacher label -> same vocabulary as the student
        self._samples: list[dict] | None = None
        self.sample_error: str | None = None  # why opd-rollout gave no samples
        self._forwards: dict = {}
        self._logits: dict = {}  # (forward, record id) -> log-probs of the sampled tokens

    # ------------------------------------------------------------------ tokenizers and prompts

    def tokenizer(self, model: str, revision: str | None = None):
        from opd_common.models import load_tokenizer

        if (model, revision) not in self._tokenizers:
            self._tokenizers[model, revision] = load_tokenizer(model, revision)
        return self._tokenizers[model, revision]

    def student_tokenizer(self):
        return self.tokenizer(self.config.model, self.config.revision)

    def teacher_sides(self) -> list[tuple[str, str, str | None, str | None]]:
        """(label, model, revision, adapter) of every --teacher and --shift side."""
        cfg = self.config
        sides = [(f"--teacher {t.name}={t.model}", t.model, t.revision, t.adapter) for t in cfg.teachers]
        if cfg.shift_pair:
            sides += [(f"--shift {side}={m}", m, None, None) for side, m in zip(("post", "pre"), cfg.shift_pair,
                                                                               strict=True)]
        return sides

    def same_vocab(self, label: str) -> bool:
        """Whether a teacher's vocabulary is the student's, as opd-score decides it (the whole id map; once per
        teacher: a real vocabulary's map is 150k entries)."""
        if label.startswith("--self-teacher"):
            return True
        if label not in self._same:
            side = next(s for s in self.teacher_sides() if s[0] == label)
            self._same[label] = self.student_tokenizer().get_vocab() == self.tokenizer(side[1], side[2]).get_vocab()
        return self._same[label]

    def over_text(self, label: str) -> bool:
        """Whether opd-score scores this teacher over the response text (another tokenizer with --align auto,
        or --align text) rather than at the student's token ids."""
        cfg = self.config
        if cfg.align == "ids" or label.startswith(("--shift", "--self-teacher")):
            return False
        return cfg.align == "text" or not self.same_vocab(label)

    def teacher_contexts(self, rec: dict):
        """(label, context ids, tokenizer, thinking) of each teacher for one record, built as opd-score
        (--teacher-prompt) and opd-train (--self-teacher) build them."""
        from opd_common.models import render_chat
        from opd_common.prompts import AS_IS, load
        from opd_common.xtok import teacher_prompt_ids

        cfg = self.config
        for label, model, revision, _ in self.teacher_sides():
            tokenizer = self.tokenizer(model, revision)
            if cfg.teacher_prompt == AS_IS and not self.same_vocab(label):  # the student's prompt as text
                yield label, teacher_prompt_ids(rec, self.student_tokenizer(), tokenizer), tokenizer, cfg.thinking
            elif cfg.teacher_prompt == AS_IS:
                yield label, rec["prompt_ids"], tokenizer, cfg.thinking
            else:
                message = load(cfg.teacher_prompt).render(rec["example"], rec["id"])
                yield label, render_chat(tokenizer, message, cfg.teacher_thinking == "on"), tokenizer, \
                    cfg.teacher_thinking
        if cfg.self_teacher:
            message = load(cfg.self_teacher).render(rec["example"], rec["id"])
            yield (f"--self-teacher {cfg.self_teacher}", render_chat(self.student_tokenizer(), message,
                   cfg.self_teacher_thinking == "on"), self.student_tokenizer(), cfg.self_teacher_thinking)

    def default_template(self) -> str:
        from opd_common.prompts import DEFAULT_TEMPLATE

        return DEFAULT_TEMPLATE

    # ------------------------------------------------------------------ samples

    def samples(self) -> list[dict]:
        """The records opd-rollout sampled (run once; a failure is remembered: NoSamples, once as a FAIL)."""
        from .stages import sample

        if self._samples is None and self.sample_error is None:
            log.info("sampling %d prompts x %d with the %s engine", self.config.limit, self.config.n,
                     self.config.engine)
            try:
                self._samples = sample(self.config, self.inputs, self.work)
                if not self._samples:
                    raise OpdError("opd-rollout wrote no sample: are the inputs empty?")
            except OpdError as exc:
                self.sample_error = str(exc)
                raise NoSamples(self.sample_error) from None
        if self._samples is None:
            raise NoSamples(self.sample_error)
        return self._samples

    def engine_name(self) -> str:
        return self.samples()[0]["sampling"]["engine"]

    def dtype_name(self) -> str:
        from opd_common.models import pick_device, pick_dtype

        dtype = pick_dtype(self.config.dtype, pick_device(self.config.device), self.config.model)
        return str(dtype).removeprefix("torch.")

    # ------------------------------------------------------------------ forwards

    def _forward(self, key: str, model: str, revision: str | None, adapter: str | None, merge: bool = False):
        from .forward import Forward

        if key not in self._forwards:
            self._forwards[key] = Forward(model, revision, adapter, self.config.dtype, self.config.device, merge)
        return self._forwards[key]

    def trainer_logits(self, rec: dict):
        """The fp32 logits [T, V] opd-train's student computes for the record: base + --adapter, unmerged.
        Logits are not kept (a few GB on a real vocabulary): each check asks once per record."""
        cfg = self.config
        return self._forward("trainer", cfg.model, cfg.revision, cfg.adapter).logits(rec["prompt_ids"],
                                                                                     rec["response_ids"]).cpu()

    def base_logits(self, rec: dict):
        if not self.config.adapter:
            return self.trainer_logits(rec)
        fwd = self._forward("base", self.config.model, self.config.revision, None)
        return fwd.logits(rec["prompt_ids"], rec["response_ids"]).cpu()

    def teacher_logits(self, spec, rec: dict):
        label = f"--teacher {spec.name}={spec.model}"
        context = next(c for lbl, c, _, _ in self.teacher_contexts(rec) if lbl == label)
        fwd = self._forward(label, spec.model, spec.revision, spec.adapter, merge=True)
        return fwd.logits(context, rec["response_ids"]).cpu()

    def trainer_logprobs(self, rec: dict):
        """log p(sampled token) under the trainer's forward, float32 [T] (kept: several checks read it)."""
        if ("trainer", rec["id"]) not in self._logits:
            self._logits["trainer", rec["id"]] = _chosen(self.trainer_logits(rec), rec["response_ids"])
        return self._logits["trainer", rec["id"]]

    def base_logprobs(self, rec: dict):
        if not self.config.adapter:
            return self.trainer_logprobs(rec)
        if ("base", rec["id"]) not in self._logits:
            self._logits["base", rec["id"]] = _chosen(self.base_logits(rec), rec["response_ids"])
        return self._logits["base", rec["id"]]


def _chosen(logits_TV, response_ids):
    import numpy as np
    import torch

    idx = torch.from_numpy(np.asarray(response_ids, np.int64))
    return torch.log_softmax(logits_TV, -1).gather(-1, idx[:, None])[:, 0].numpy()


def checks():
    from .checks import check_adapter, check_logprobs, check_rendering, check_tokenizers
    from .checks_train import check_self, check_stops, check_topk

    return [("tokenizers", check_tokenizers), ("rendering", check_rendering), ("logprobs", check_logprobs),
            ("adapter", check_adapter), ("self", check_self), ("topk", check_topk), ("stops", check_stops)]


def run_checks(ctx) -> list[Result]:
    """Each check's result; a check that cannot run is a FAIL naming why, never a traceback that hides the rest."""
    results: list[Result] = []
    for name, check in checks():
        log.info("check %s", name)
        try:
            results.append(check(ctx))
        except NoSamples as exc:
            if not any(r.check == "rollout" for r in results):
                results.append(Result("rollout", "FAIL", str(exc), "run the same opd-rollout command alone"))
            results.append(Result(name, "SKIP", "no samples (opd-rollout failed)"))
        except OpdError as exc:
            results.append(Result(name, "FAIL", str(exc)))
        except Exception as exc:  # a bug of the check itself: say so, and go on with the others
            log.exception("check %s", name)
            results.append(Result(name, "FAIL", f"the check crashed: {type(exc).__name__}: {exc}",
                                  "a bug in opd-check: please report it with the traceback above (stderr)"))
    return results


def run(config, inputs: list[str]) -> int:
    """Run every check; print them (stdout); 1 if any failed. The work folder (samples, the stages' logs) goes
    unless --keep or a check failed."""
    from opd_common.prompts import resolve_prompt_specs

    inputs = resolve_prompt_specs(inputs)
    work = Path(config.keep) if config.keep else Path(tempfile.mkdtemp(prefix="opd-check-"))
    work.mkdir(parents=True, exist_ok=True)
    results = run_checks(Context(config, inputs, work))
    failed = any(r.status == "FAIL" for r in results)
    if failed and not config.keep:
        log.warning("the samples and the stages' logs are kept in %s", work)
    elif not config.keep:
        shutil.rmtree(work, ignore_errors=True)
    if config.json:
        import orjson

        sys.stdout.buffer.write(orjson.dumps(as_json(results), option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
    else:
        sys.stdout.write(text(results) + "\n")
    sys.stdout.flush()
    return 1 if failed else 0
