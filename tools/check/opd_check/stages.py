"""The real stages, run as a user runs them: opd-rollout samples the prompts, opd-train takes one step. Each gets
its options as a --config YAML file (the flags opd-check was given, under the stage's own names)."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

from opd_common.engines.config import EngineConfig
from opd_common.errors import OpdError


class StageFailed(OpdError):
    """A stage opd-check ran exited non-zero (its last stderr line says why)."""


def engine_options(config) -> dict:
    """The EngineConfig fields of `config` that differ from their defaults (opd-rollout's sampling flags)."""
    out = {}
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        if value != default:
            out[f.name] = value
    return out


def run_stage(tool: str, options: dict, inputs: list[str], work: Path, stdout: Path | None = None) -> None:
    """Run `python -m opd_TOOL.cli --config work/TOOL.yaml INPUTS` (stdout to `stdout`); raise StageFailed."""
    import yaml

    cfg = work / f"{tool}.yaml"
    cfg.write_text(yaml.safe_dump(options, sort_keys=True))
    cmd = [sys.executable, "-m", f"opd_{tool}.cli", "--config", str(cfg), *inputs]
    err = work / f"{tool}.stderr"
    with open(err, "wb") as e, open(stdout or work / f"{tool}.stdout", "wb") as out:
        code = subprocess.run(cmd, stdout=out, stderr=e).returncode
    if code != 0:
        lines = [ln for ln in err.read_text(errors="replace").splitlines() if ln.strip()]
        raise StageFailed(f"opd-{tool} exited with {code}: {lines[-1] if lines else 'no message'} "
                          f"(the whole log: {err})")


def sample(config, inputs: list[str], work: Path) -> list[dict]:
    """opd-rollout on the first --limit prompts with the run's sampling flags; the records (arrays unpacked)."""
    from opd_common.streams import iter_inputs

    options = engine_options(config) | {"limit": config.limit, "quiet": True, "prompt_field": config.prompt_field,
                                        "id_field": config.id_field}
    if config.loss == "shift":
        options["topk_logprobs"] = max(config.shift_k, 1)
    out = work / "samples.jsonl"
    run_stage("rollout", options, inputs, work, stdout=out)
    return [rec for rec, _ in iter_inputs([str(out)])]


def train_one_step(config, records_path: Path, work: Path, options: dict) -> dict:
    """opd-train --max-steps 1 over the records (lr 0: the run's weights do not move); its metrics. `options`
    hold the objective's flags and the batch (--batch-size or --batch-groups)."""
    import orjson

    run = work / "train-run"
    base = {"model": config.model, "revision": config.revision, "out": str(run), "overwrite": True,
            "max_steps": 1, "lr": 0.0, "quiet": True,
            "dtype": config.dtype if config.dtype != "float16" else "auto", "device": config.device,
            "loss": config.loss}
    run_stage("train", base | options, [str(records_path)], work)
    lines = (run / "metrics.jsonl").read_bytes().splitlines()
    return orjson.loads(lines[-1])
