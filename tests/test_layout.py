"""The layout rules of docs/architecture.md: tools import only opd_common, and no import circles."""

from __future__ import annotations

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts" / "import_graph.py")
import_graph = importlib.util.module_from_spec(spec)
spec.loader.exec_module(import_graph)


def test_tools_import_only_opd_common_and_nothing_is_circular():
    assert import_graph.violations(import_graph.graph()) == []


def test_every_tool_depends_on_opd_common_only():
    edges = import_graph.package_edges(import_graph.graph())
    assert set(edges) == {"opd_rollout", "opd_score", "opd_train", "opd_eval", "opd_publish", "opd_check"}
    assert all(targets == {"opd_common"} for targets in edges.values()), edges


def _tree(tmp_path: Path, files: dict[str, str]) -> list[Path]:
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return [tmp_path]


def test_the_check_sees_a_tool_import_inside_a_function_and_a_relative_circle(tmp_path):
    sources = _tree(tmp_path, {
        "opd_common/__init__.py": "",
        "opd_common/a.py": "from . import b\n",
        "opd_common/b.py": "def f():\n    from .a import x\n",
        "opd_x/__init__.py": "",
        "opd_x/run.py": "import opd_common.a\n\ndef g():\n    from opd_y.cli import main\n",
        "opd_y/__init__.py": "",
        "opd_y/cli.py": "from opd_common import b\n",
    })
    problems = import_graph.violations(import_graph.graph(sources))
    assert problems == [
        "opd_x.run imports opd_y.cli: a tool imports only opd_common (move the shared piece there)",
        "import circle: opd_common.a <-> opd_common.b (make the dependency go one way)",
    ]
