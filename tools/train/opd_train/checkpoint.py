"""Checkpoints on the training side: snapshot, atomic write, background writer, RNG states, load, metrics cut.

The run directory's names, the `latest` pointer and what counts as a finished checkpoint are in
opd_common.rundir (docs/architecture.md, "run-dir handshake"). A checkpoint is written into a hidden
temporary folder, every file fsynced, then renamed into place; only then is ``latest`` replaced (write a
temp file, rename). A crash at any moment leaves the previous checkpoint and ``latest`` valid.

checkpoint-NNNNNN/
  adapter_model.safetensors, adapter_config.json   peft LoRA (PeftModel.from_pretrained, vLLM LoRARequest)
  tokenizer files                                   the student's tokenizer
  trainer_state.json                                step, max_steps, records read, beta, last metrics (for people)
  trainer_state.pt                                  optimizer, scheduler, RNG states, pending records (for --resume)
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from opd_common import rundir
from opd_common.errors import ConfigError


def rng_state() -> dict[str, Any]:
    import torch

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def snapshot(student, state: dict[str, Any]) -> dict[str, Any]:
    """A CPU copy of what a checkpoint holds (adapter weights, LoRA config, trainer state), taken in the
    training thread so that the files can be written while the next step changes the live tensors."""
    from peft import get_peft_model_state_dict

    weights = get_peft_model_state_dict(student.peft, save_embedding_layers=False)  # the vocabulary never changes
    return {"weights": {k: _cpu(v).contiguous() for k, v in weights.items()}, "lora": snapshot_lora(student),
            "state": _cpu(state)}


def _cpu(obj):
    """obj with every tensor copied to the CPU (a copy also for CPU tensors: the originals keep changing)."""
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cpu(v) for v in obj)
    return obj


def write(run_dir: Path, step: int, snap: dict[str, Any], tokenizer, summary: dict[str, Any]) -> Path:
    """Write checkpoint-NNNNNN from a snapshot atomically, then point `latest` at it."""
    import torch
    from safetensors.torch import save_file

    final = run_dir / rundir.checkpoint_name(step)
    tmp = run_dir / f".{final.name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_file(snap["weights"], str(tmp / rundir.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    snap["lora"].save_pretrained(str(tmp))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp))
    torch.save(snap["state"], tmp / rundir.RESUME_STATE)
    (tmp / rundir.TRAINER_STATE).write_text(json.dumps(summary, indent=1) + "\n")
    rundir.fsync_tree(tmp)
    if final.exists():  # left by a crash after its rename but before `latest` moved: not trusted
        shutil.rmtree(final)
    os.replace(tmp, final)
    rundir.atomic_write_text(run_dir / rundir.LATEST, final.name + "\n")
    return final


def save(run_dir: Path, step: int, student, tokenizer, state: dict[str, Any], summary: dict[str, Any]) -> Path:
    """Write checkpoint-NNNNNN atomically, then point `latest` at it (in this thread)."""
    return write(run_dir, step, snapshot(student, state), tokenizer, summary)


class BackgroundWriter:
    """Writes checkpoints in a thread, one at a time and in order, while training goes on.

    submit() waits for the previous write first, so at most one is in flight and `latest` only ever
    moves forward; wait() blocks until the last one is on disk and re-raises its error, if any.
    A crash during a write leaves the previous checkpoint and `latest` valid (write() is atomic).
    """

    def __init__(self, on_done=None):
        self._thread = None
        self._error: BaseException | None = None
        self._on_done = on_done

    def submit(self, fn) -> None:
        import threading

        self.wait()

        def body() -> None:
            try:
                result = fn()
                if self._on_done is not None:
                    self._on_done(result)
            except BaseException as exc:  # re-raised in the training thread by wait()
                self._error = exc

        self._thread = threading.Thread(target=body, name="opd-train-checkpoint", daemon=False)
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class PolicySharer:
    """--share-policy: after every step, the adapter for followers (opd-rollout / opd-score --follow) in
    RUN/policy/v-NNNNNN/ and policy/latest (opd_common.rundir), without the optimizer state and without fsync:
    a hand-over through the page cache, not a checkpoint (a crash loses nothing that --resume needs).

    share() copies the LoRA weights into CPU buffers allocated once (pinned on CUDA: one device-to-host copy
    per tensor, no allocation) and writes the files in a thread; the pointer moves after the folder is in
    place, and the oldest folders beyond rundir.POLICY_KEEP go. The next share() waits for the previous write
    first (the buffers are reused)."""

    def __init__(self, run_dir: Path):
        self.root = Path(run_dir) / rundir.POLICY  # a previous trainer's is gone (opd_train.run.prepare_run_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.writer = BackgroundWriter()
        self.buffers: dict[str, Any] = {}
        self.lora = None

    def share(self, student, step: int, summary: dict[str, Any]) -> None:
        import torch
        from peft import get_peft_model_state_dict

        self.writer.wait()
        weights = get_peft_model_state_dict(student.peft, save_embedding_layers=False)
        on_cuda = any(v.is_cuda for v in weights.values())
        if not self.buffers:
            self.buffers = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=on_cuda) for k, v in weights.items()}
            self.lora = snapshot_lora(student)
        for key, value in weights.items():
            self.buffers[key].copy_(value.detach(), non_blocking=True)
        if on_cuda:
            torch.cuda.current_stream().synchronize()
        self.writer.submit(lambda: write_policy(self.root, step, self.buffers, self.lora, summary))

    def wait(self) -> None:
        self.writer.wait()


def snapshot_lora(student):
    """The LoRA config as peft's save_pretrained writes it (inference mode)."""
    import copy

    lora = copy.deepcopy(student.peft.peft_config["default"])
    lora.inference_mode = True
    return lora


def write_policy(root: Path, step: int, weights: dict[str, Any], lora, summary: dict[str, Any]) -> Path:
    """policy/v-NNNNNN: filled in a hidden folder, renamed into place, then named by policy/latest (renamed
    too, so a reader sees the old name or the new one whole); the folders before the newest POLICY_KEEP go."""
    from safetensors.torch import save_file

    final = root / rundir.policy_name(step)
    tmp = root / f".{final.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file(weights, str(tmp / rundir.ADAPTER_WEIGHTS), metadata={"format": "pt"})
    lora.save_pretrained(str(tmp))
    (tmp / rundir.TRAINER_STATE).write_text(json.dumps(summary) + "\n")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = root / f".{rundir.LATEST}.tmp"
    pointer.write_text(final.name + "\n")
    os.replace(pointer, root / rundir.LATEST)
    shared = sorted(p.name for p in root.iterdir() if rundir.POLICY_RE.fullmatch(p.name))  # v-NNNNNN: by step
    for old in shared[:-rundir.POLICY_KEEP]:
        shutil.rmtree(root / old, ignore_errors=True)
    return final


def load(path: Path, student) -> dict[str, Any]:
    """Load the adapter weights into `student` and return the trainer state."""
    import torch
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    if not (path / rundir.RESUME_STATE).is_file():
        raise ConfigError(f"{path} has no {rundir.RESUME_STATE} (the optimizer, scheduler and RNG states that "
                          "--resume needs); the run directory was edited by hand?")
    weights = load_file(str(path / rundir.ADAPTER_WEIGHTS), device=str(student.device))
    result = set_peft_model_state_dict(student.peft, weights)
    unexpected = getattr(result, "unexpected_keys", [])
    if unexpected:
        raise ConfigError(f"{path}: adapter weights do not fit this model ({unexpected[:3]} ...)")
    return torch.load(path / rundir.RESUME_STATE, weights_only=False)


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metric lines of steps after `step` (done before a crash, not in any checkpoint)."""
    path = run_dir / rundir.METRICS
    if not path.exists():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError):
            break  # a torn last line
    rundir.atomic_write_text(path, "".join(line + "\n" for line in keep))
