"""Where a stage's time goes: spans written as JSONL when the environment names a folder.

``OPD_TIMELINE=DIR opd-rollout ... | opd-score ... | opd-train ...`` makes each process append
``DIR/{tool}-{pid}.jsonl``, one line per span: ``{"tool", "name", "start", "end", ...fields}`` with
wall-clock seconds (``time.time()``, comparable between processes of one machine). The loop
benchmark (``benchmarks/bench_loop_gpu.py``) reads them to split a step into decoding, adapter
hand-over, scoring, training and waiting. Unset (the default), a span costs one attribute check.

Span names: opd-rollout ``wait`` (for the trainer, --follow), ``adapter`` (a new checkpoint reaching
the engine), ``decode`` (one batch, submit to last completion; overlapping under --max-lag >= 1
with vLLM), ``write`` (a batch's records going out, in the rollout's writer thread); opd-score
``read`` (waiting for input), ``score`` (one window), ``write`` (a window going out, in its writer
thread); opd-train ``read`` (waiting for the step's records), ``step`` (forward, backward,
optimizer), ``save`` (the snapshot taken in the step's thread), ``save_write`` (files, fsync and
rename, in the background).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

ENV = "OPD_TIMELINE"


class Timeline:
    def __init__(self, tool: str):
        self.tool = tool
        self._file = None
        self._lock = threading.Lock()
        folder = os.environ.get(ENV)
        if folder:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(folder) / f"{tool}-{os.getpid()}.jsonl", "a", buffering=1)

    def event(self, name: str, start: float, end: float, **fields) -> None:
        if self._file is None:
            return
        line = json.dumps({"tool": self.tool, "name": name, "start": round(start, 6), "end": round(end, 6), **fields})
        with self._lock:
            self._file.write(line + "\n")

    @contextlib.contextmanager
    def span(self, name: str, **fields):
        start = time.time()
        try:
            yield fields  # the body may add fields (e.g. tokens) before the span is written
        finally:
            self.event(name, start, time.time(), **fields)


_timelines: dict[str, Timeline] = {}


def timeline(tool: str) -> Timeline:
    """The process's timeline for `tool` (one file per tool and process)."""
    if tool not in _timelines:
        _timelines[tool] = Timeline(tool)
    return _timelines[tool]


def read(folder: str | Path) -> list[dict]:
    """Every span under `folder`, ordered by start time."""
    spans = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                spans.append(json.loads(line))
    return sorted(spans, key=lambda s: s["start"])
