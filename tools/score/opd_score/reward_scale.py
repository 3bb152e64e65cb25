"""The correctness part of ``reward.total`` on the scale ``opd-score --reward-scale`` names (docs/losses.md,
"The reward's scale").

opd_common.grading.reward writes ``total = accuracy + length_penalty`` with accuracy 1 (correct, and stopped
under --require-stop) or 0. A scale maps accuracy to (wrong, right) values: ``01`` keeps (0, 1), ``pm1`` is
DAPO's ``2 * correct - 1``, (-1, +1), so the soft overlong penalty weighs half as much against correctness.
"""

from __future__ import annotations

SCALES: dict[str, tuple[float, float]] = {"01": (0.0, 1.0), "pm1": (-1.0, 1.0)}  # name -> (wrong, right)


def rescale(block: dict, scale: str, require_stop: bool) -> dict:
    """The reward block with its accuracy on `scale` and the scale recorded (``scale``); other terms unchanged."""
    wrong, right = SCALES[scale]
    accurate = bool(block["correct"]) and (block["stop_ok"] or not require_stop)  # as grading.reward decides
    total = block["total"]
    if (wrong, right) != SCALES["01"]:
        total = total - (1.0 if accurate else 0.0) + (right if accurate else wrong)
    return {**block, "total": total, "scale": scale}
