"""opd-score's pure entry point: run(config, inputs, writer) -> exit code.

Records stream in, are gathered into windows (``--window``; less when a pipe pauses), scored
window by window (teachers sort by length inside and batch by ``--token-budget``) and written in
input order, by a writer thread (the next window is scored while the last one waits for its
reader). Teachers score ``response_ids`` verbatim; nothing else in a record changes.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator

from opd_common.batching import batches
from opd_common.cli_util import leave_quietly
from opd_common.streams import BackgroundWriter, InputSource, iter_inputs

from .scorer import Scorer

log = logging.getLogger("opd-score")


def score_here(config, windows) -> Iterator[list]:
    """Score windows in this process (teachers load on the first window)."""
    from opd_common.timeline import timeline

    tl = timeline("opd-score")
    scorer = Scorer(config)
    windows = iter(windows)
    try:
        while True:
            with tl.span("read"):
                window = next(windows, None)
            if window is None:
                return
            if not scorer.opened:
                scorer.open(window[0][0])
            with tl.span("score", records=len(window), tokens=sum(len(r["response_ids"]) for r, _ in window)):
                scorer.score(window)
            yield window
    finally:
        scorer.close()


def run(config, inputs: list[str], writer, sources: list[InputSource] | None = None) -> int:
    """Score every record of `inputs` and write it (with its new blocks) in input order."""
    from opd_common.cli_util import progress

    records = iter_inputs(inputs, check=True, sources=sources)
    if writer.resumed:
        log.info("resuming: skipping %d records already scored", writer.resumed)
        records = itertools.islice(records, writer.resumed, None)
    windows = batches(records, config.window)
    if config.data_parallel > 1:
        from .parallel import score_in_workers

        scored = score_in_workers(config, windows, config.data_parallel)
    else:
        scored = score_here(config, windows)
    t0, tokens, count = time.perf_counter(), 0, 0
    # windows go out in a writer thread: the next window is read and scored while the reader (a trainer in its
    # step) has not read the last one yet; on a failure the windows scored before it still go out
    with BackgroundWriter(writer, depth=1, tool="opd-score", on_broken_pipe=leave_quietly) as background, \
            progress(None, "record", config.quiet, "opd-score") as bar:
        for window in scored:
            background.put([rec for rec, _ in window], window=count)
            tokens += sum(len(rec["response_ids"]) for rec, _ in window)
            count += len(window)
            bar.update(len(window))
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
    seconds = time.perf_counter() - t0
    log.info("%d records, %d response tokens in %.1f s (%.0f tok/s)", count, tokens, seconds,
             tokens / max(seconds, 1e-9))
    return 0
