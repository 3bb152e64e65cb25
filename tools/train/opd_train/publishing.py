"""--publish TARGET: push each checkpoint as it is saved, by running the `opd-publish push` command.

cli.py gives `PublishOnSave(config.publish)` to run() as the Trainer's on_save callback. Trainer.save
calls it on rank 0, in the training thread, once the checkpoint's files are on disk, so the next step
waits for the push and its verification. It runs `python -m opd_publish.cli push RUN_DIR --repo TARGET
--checkpoints STEP` in a subprocess (opd-train imports only opd_common, not another tool); the
command's log lines go on to stderr as they come, its records (stdout) are read for the status, and
its error ("Error: ...") stops the run as PublishFailed, naming the checkpoint and how to finish by hand.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

from opd_common import rundir
from opd_common.errors import OpdError

log = logging.getLogger("opd-train")


class PublishFailed(OpdError):
    """--publish could not publish (and verify) a checkpoint."""


class PublishOnSave:
    """on_save(run_dir, step): `opd-publish push` of checkpoint `step` to `target`; PublishFailed if it fails."""

    def __init__(self, target: str, quiet: bool = False):
        self.target = target
        self.quiet = quiet  # opd-publish --quiet: only its warnings and errors

    def command(self, run_dir: Path, step: int) -> list[str]:
        return [sys.executable, "-m", "opd_publish.cli", "push", str(run_dir), "--repo", self.target,
                "--checkpoints", str(step), *(["--quiet"] if self.quiet else [])]

    def __call__(self, run_dir: Path, step: int) -> None:
        name = rundir.checkpoint_name(step)
        code, records, error = _run(self.command(run_dir, step))
        if code != 0:
            raise PublishFailed(f"--publish {self.target}: {name} was saved locally but not published, so the run "
                                f"stops: {error}; fix the target, then `opd-publish push {run_dir} --repo "
                                f"{self.target}` and --resume") from None
        log.info("published %s: %s", name, records[0].get("status") if records else None)


def _run(cmd: list[str]) -> tuple[int, list[dict], str]:
    """Run cmd, passing its stderr on line by line except a closing "Error: ..." (click's one clear line):
    (exit status, its stdout's JSON records, that error's text, else its last stderr line)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    error: list[str] = []
    last = ""
    for line in proc.stderr:  # (its stdout is a few short lines: read after, no deadlock)
        if error or line.startswith("Error: "):
            error.append(line)
            continue
        sys.stderr.write(line)
        sys.stderr.flush()
        last = line.strip() or last
    out = proc.stdout.read()
    code = proc.wait()
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    if error:
        return code, records, "".join(error)[len("Error: "):].rstrip("\n")
    return code, records, f"`opd-publish push` exited with status {code}" + (f": {last}" if last else "")
