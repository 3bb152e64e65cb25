"""--follow RUN_DIR: teachers that are the current student, scored with the adapter that sampled each record.

In the on-policy loop ``opd-rollout --follow RUN | opd-score --follow RUN --teacher t=BASE | opd-train
--out RUN`` every record carries ``policy.version``, the trainer step of the checkpoint that sampled
it. Each ``--teacher`` (the student's base model) scores a record with the adapter of that version:
``RUN/policy/v-NNNNNN`` while opd-train --share-policy keeps it, else ``RUN/checkpoint-NNNNNN`` (version 0:
the base weights, adapter off). A window is split by version; the teacher
swaps its LoRA weights in place between the groups (the base model loads once) and the scores go
back to the records in input order. The version's checkpoint path goes into ``teachers.NAME.adapter``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from opd_common import rundir
from opd_common.errors import RecordError
from opd_common.records import Where


def adapters_for(run_dir: str, window: list[tuple[dict, Where]]) -> list[str | None]:
    """adapter_for of each record of a window (the run's finished checkpoints listed once, not per record)."""
    finished = {c.step: c for c in rundir.list_checkpoints(Path(run_dir))}
    return [adapter_for(run_dir, rec, where, finished) for rec, where in window]


def adapter_for(run_dir: str, rec: dict, where: Where, finished: dict[int, rundir.Checkpoint]) -> str | None:
    """The checkpoint folder that sampled `rec` (None for version 0), checked to be among the run's `finished`
    checkpoints (by step)."""
    policy = rec.get("policy") or {}
    version = policy.get("version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise RecordError(f"{where} (id {rec.get('id')}): policy.version is {version!r}, --follow {run_dir} needs "
                          "the trainer step that sampled it (records from opd-rollout --follow carry it)")
    expected = None if version == 0 else rundir.checkpoint_name(version)
    shared = None if version == 0 else rundir.policy_name(version)  # opd-train --share-policy's folder
    sampled = policy.get("adapter")
    if (None if sampled is None else Path(sampled).name) not in (expected, shared):
        raise RecordError(f"{where} (id {rec['id']}): policy.version {version} but policy.adapter is {sampled!r}; "
                          f"--follow {run_dir} scores version {version} with {expected or 'the base weights'}, "
                          "so these records were not sampled by opd-rollout --follow of this run")
    if version == 0:
        return None
    policy_path = Path(run_dir) / rundir.POLICY / shared
    if policy_path.is_dir():  # the same weights as checkpoint `version`, kept for the newest steps only
        return str(policy_path)
    path = Path(run_dir) / expected
    if version not in finished:
        raise RecordError(f"{where} (id {rec['id']}): policy.version {version} needs the checkpoint {path}, which "
                          "is missing (pruned, never written, or another run?); --follow scores each record with "
                          "the checkpoint that sampled it, so keep the run's checkpoints until they are scored")
    return str(path)


def by_adapter(adapters: list[str | None], current: str | None) -> Iterator[tuple[str | None, list[int]]]:
    """Indices grouped by adapter: the one already loaded first, then by version (fewest swaps)."""
    groups: dict[str | None, list[int]] = {}
    for i, adapter in enumerate(adapters):
        groups.setdefault(adapter, []).append(i)
    yield from sorted(groups.items(), key=lambda kv: (kv[0] != current, kv[0] or ""))
