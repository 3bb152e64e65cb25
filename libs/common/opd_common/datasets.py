"""Bundled benchmark and training data (package data, provenance in data/PROVENANCE.md)."""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import StreamError


@dataclass(frozen=True)
class Bundled:
    name: str
    file: str
    split: str  # "benchmark" | "train"
    rows: int
    description: str


BUNDLED: dict[str, Bundled] = {
    b.name: b
    for b in (
        Bundled("aime24", "aime24.jsonl", "benchmark", 30, "AIME 2024 I+II, integer answers"),
        Bundled("aime25", "aime25.jsonl", "benchmark", 30, "AIME 2025 I+II, integer answers"),
        Bundled("hmmt25", "hmmt_feb_2025.jsonl", "benchmark", 30, "HMMT February 2025, LaTeX answers"),
        Bundled("math500", "math500.jsonl", "benchmark", 500, "MATH-500 (PRM800K test subset)"),
        Bundled("train-aime", "train_aime_1983_2023.jsonl", "train", 970, "AIME 1983-2023 with AoPS solutions"),
        Bundled("train-math", "train_math_full.jsonl", "train", 7498, "MATH train split with solutions"),
    )
}


def data_path(filename: str) -> Path:
    return Path(str(resources.files("opd_common") / "data" / filename))


def bundled_path(name: str) -> Path:
    """Path of a bundled dataset by name; unknown names get a 'did you mean' error."""
    if name not in BUNDLED:
        close = difflib.get_close_matches(name, BUNDLED, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise StreamError(f"unknown benchmark {name!r}{hint}; bundled: {', '.join(BUNDLED)}")
    return data_path(BUNDLED[name].file)


def sha256_of(name: str) -> str:
    return hashlib.sha256(bundled_path(name).read_bytes()).hexdigest()
