"""From scored records to training examples, optimizer-step batches and micro-batches.

A step's batch is ``--batch-size`` records or ``--batch-groups`` complete groups (all
``group_size`` samples of one ``prompt_id``), taken from the stream lazily in arrival order.
Records of a group that is not complete yet wait in ``pending``; a checkpoint stores how many
records were read and the pending ones, so a resumed run continues from exactly there.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from opd_common.errors import RecordError
from opd_common.records import Where


@dataclass
class Example:
    """One record as the trainer needs it. Per-token arrays are aligned to response tokens."""

    id: str
    prompt_id: str
    prompt_ids: np.ndarray  # int [P]: the student's context
    response_ids: np.ndarray  # int [T]
    tokens: dict[str, np.ndarray] = field(default_factory=dict)  # name -> [T] or [T, k]
    teacher_context: np.ndarray | None = None  # int [P']: self-teacher prompt
    reward: float | None = None  # grpo/dapo: reward.total

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def teacher_length(self) -> int:
        return len(self.teacher_context) + len(self.response_ids)


def make_example(rec: dict, where: Where, config, teacher_render=None) -> Example:
    """Check that the record carries what --loss needs and pull it out (errors name the record and field):
    the objective's registry entry (objectives.py) builds the per-token arrays."""
    from .objectives import objective

    ex = Example(id=rec["id"], prompt_id=rec["prompt_id"], prompt_ids=np.asarray(rec["prompt_ids"], np.int64),
                 response_ids=np.asarray(rec["response_ids"], np.int64))
    T = len(ex.response_ids)
    if T == 0:
        raise RecordError(f"{where}: response_ids is empty; nothing to train on (drop such records upstream)")
    objective(config).tokens(ex, rec, where, config, teacher_render)
    for key, arr in ex.tokens.items():
        if len(arr) != T:
            raise RecordError(f"{where}: {key} has {len(arr)} positions but response_ids has {T}")
    return ex


class StepBatches:
    """Cut the example stream into optimizer-step batches (records or complete groups)."""

    def __init__(self, items: Iterator[tuple[dict, Where]], config, to_example, consumed: int = 0,
                 pending: list[tuple[dict, Where]] | None = None):
        self.items = items
        self.config = config
        self.to_example = to_example
        self.consumed = consumed  # records read from the input so far
        self.last_id: str | None = None  # id of the last one (checked again by --resume)
        self.groups_dropped = 0  # dynamic sampling: groups dropped while filling the current batch
        self.last_stats: dict[str, int] = {}  # of the batch last returned
        self.step = 0  # the trainer's step (policy version) the next batch trains; set by the trainer
        self.stale = 0  # records dropped by --max-staleness while filling the current batch
        self.pending: list[tuple[dict, Where]] = list(pending or [])  # read, not yet in a batch

    def next_batch(self) -> list[Example] | None:
        """The next full batch, or None when the input ends first (pending records stay)."""
        cfg = self.config
        while True:
            batch = self._take_full()
            if batch is not None:
                self.last_stats = {"records_stale": self.stale} if cfg.max_staleness is not None else {}
                self.stale = 0
                if getattr(cfg, "dynamic_sampling", False):
                    self.last_stats |= {"groups_read": self.groups_dropped + cfg.batch_groups,
                                       "groups_dropped": self.groups_dropped}
                    self.groups_dropped = 0
                return [self.to_example(rec, where) for rec, where in batch]
            limit = cfg.max_candidate_batches * (cfg.batch_groups or 0)
            if getattr(cfg, "dynamic_sampling", False) and self.groups_dropped >= limit:
                raise RecordError(f"dynamic sampling dropped {self.groups_dropped} complete groups (all correct or all "
                                  f"wrong) without filling this step's {cfg.batch_groups} (--max-candidate-batches "
                                  f"{cfg.max_candidate_batches}); the step is not trained. Sample prompts of mixed "
                                  "difficulty or more samples per group, or raise the bound, then --resume")
            item = next(self.items, None)
            if item is None:
                return None
            self.consumed += 1
            self.last_id = item[0].get("id")
            if cfg.batch_size is not None and self._is_stale(item[0]):
                self.stale += 1
                continue
            self.pending.append(item)

    def _take_full(self) -> list[tuple[dict, Where]] | None:
        cfg = self.config
        if cfg.batch_size is not None:
            if len(self.pending) < cfg.batch_size:
                return None
            batch, self.pending = self.pending[:cfg.batch_size], self.pending[cfg.batch_size:]
            return batch
        groups: dict[str, list[int]] = {}
        for i, (rec, _) in enumerate(self.pending):
            groups.setdefault(rec["prompt_id"], []).append(i)
        complete = [ids for ids in groups.values() if len(ids) >= _group_size(self.pending[ids[0]])]
        if cfg.max_staleness is not None:
            complete = self._drop(complete, lambda ids: any(self._is_stale(self.pending[i][0]) for i in ids), "stale")
        if getattr(cfg, "dynamic_sampling", False):
            complete = self._drop_uniform(complete)
        if len(complete) < cfg.batch_groups:
            return None
        chosen = sorted(i for ids in complete[:cfg.batch_groups] for i in ids[:_group_size(self.pending[ids[0]])])
        taken = set(chosen)
        batch = [self.pending[i] for i in chosen]
        self.pending = [item for i, item in enumerate(self.pending) if i not in taken]
        return batch


    def _is_stale(self, rec: dict) -> bool:
        version = (rec.get("policy") or {}).get("version") or 0
        return self.config.max_staleness is not None and version < self.step - self.config.max_staleness

    def _drop_uniform(self, complete: list[list[int]]) -> list[list[int]]:
        """Drop complete groups whose correctness is all equal (counted); return the kept ones."""
        from .losses import dynamic_sampling_keep

        return self._drop(complete, lambda ids: not dynamic_sampling_keep([_correct(self.pending[i]) for i in ids]),
                          "uniform")

    def _drop(self, complete: list[list[int]], bad, why: str) -> list[list[int]]:
        """Remove the complete groups for which bad(ids) holds from pending (counted); return the others."""
        kept, drop = [], set()
        for ids in complete:
            ids = ids[:_group_size(self.pending[ids[0]])]
            if not bad(ids):
                kept.append(ids)
                continue
            if why == "stale":
                self.stale += len(ids)
            else:
                self.groups_dropped += 1
            drop.update(ids)
        if drop:
            kept_idx = {i for ids in kept for i in ids}
            order = {old: new for new, old in enumerate(i for i in range(len(self.pending)) if i not in drop)}
            self.pending = [item for i, item in enumerate(self.pending) if i not in drop]
            kept = [[order[i] for i in ids] for ids in kept if set(ids) <= kept_idx]
        return kept


def _correct(item: tuple[dict, Where]) -> float:
    rec, where = item
    reward = rec.get("reward")
    if not isinstance(reward, dict) or reward.get("correct") is None:
        raise RecordError(f"{where}: no reward.correct, which dynamic sampling reads; "
                          "score with opd-score --reward math")
    return reward["correct"]


def _group_size(item: tuple[dict, Where]) -> int:
    rec, where = item
    size = rec.get("group_size")
    if not isinstance(size, int) or size < 1:
        raise RecordError(f"{where}: group_size is {size!r}; --batch-groups needs it (use --batch-size instead)")
    return size


def micro_batches(examples: list[Example], budget: int) -> list[list[Example]]:
    """Consecutive micro-batches with count x longest <= budget (a longer example goes alone)."""
    from opd_common.batching import token_batches

    return [[examples[i] for i in idx] for idx in token_batches([ex.length for ex in examples], budget)]


def collate(examples: list[Example], context: str = "prompt", bucket: int = 1) -> dict[str, Any]:
    """Right-padded input ids [B, L] and the flat (row, col) of each response token's predicting position.

    The hidden state at position P - 1 + t predicts response token t (P = context length).
    The width is rounded up to a multiple of `bucket` (right padding: causal attention never
    looks at it).
    Per-token fields are concatenated in the same flat order.
    """
    import torch

    ctxs = [ex.prompt_ids if context == "prompt" else ex.teacher_context for ex in examples]
    width = max(len(c) + len(ex.response_ids) for c, ex in zip(ctxs, examples, strict=True))
    width = -(-width // bucket) * bucket  # compiled models: few distinct shapes
    ids_BL = torch.zeros((len(examples), width), dtype=torch.long)
    rows, cols = [], []
    for b, (ctx, ex) in enumerate(zip(ctxs, examples, strict=True)):
        seq = np.concatenate([ctx, ex.response_ids])
        ids_BL[b, :len(seq)] = torch.from_numpy(seq)
        P, T = len(ctx), len(ex.response_ids)
        rows.append(np.full(T, b))
        cols.append(np.arange(P - 1, P - 1 + T))
    batch = {"ids_BL": ids_BL, "rows_N": torch.from_numpy(np.concatenate(rows)),
             "cols_N": torch.from_numpy(np.concatenate(cols)),
             "targets_N": torch.from_numpy(np.concatenate([ex.response_ids for ex in examples]))}
    for key in examples[0].tokens:
        batch[key] = torch.from_numpy(np.concatenate([ex.tokens[key] for ex in examples]))
    return batch
