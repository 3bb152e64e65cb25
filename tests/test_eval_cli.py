"""opd-eval as a user runs it: ls, run (hf engine on the tiny model), resume, compare, report, errors.

compare and report are checked on results files whose sample rows are written by hand (through
opd-eval's own assembly of the results document), so every difference, CI bound and p-value
has a hand-computed reference; the end-to-end vLLM run is in test_eval_vllm.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import orjson
import pytest
from click.testing import CliRunner

from opd_common.engines import derive_seed
from opd_eval.benchmarks import load_benchmark
from opd_eval.cli import command
from opd_eval.config import EvalConfig
from opd_eval.metrics import summarize
from opd_eval.results import progress_path
from opd_eval.run import assemble

HF_ARGS = ["--engine", "hf", "--bench", "aime24", "--limit", "3", "-n", "2", "--max-tokens", "12",
           "--temperature", "0.7", "--chunk", "2", "--grade-workers", "1", "--quiet"]


def cli(*args: str):
    return CliRunner().invoke(command, list(args))


def ok(result):
    assert result.exit_code == 0, f"exit {result.exit_code}\nstderr: {result.stderr}\n{result.exception!r}"
    return result


def fail(result, expected: str):
    assert result.exit_code == 1, result.output
    assert result.stderr == f"Error: {expected}\n"  # one line: no traceback
    assert result.stdout == ""


# --------------------------------------------------------------------------- ls, help, errors


def test_help_opens_with_a_pipe_example():
    result = ok(cli("--help"))
    assert "opd-eval run --model M --bench aime24 -n 12 --out base.json | jq .avg" in result.stdout.split("Options:")[0]
    for sub in ("run", "compare", "report", "ls"):
        assert "|" in ok(cli(sub, "--help")).stdout.split("Options:")[0]


def test_ls_lists_benchmarks_with_sizes_and_sources():
    lines = ok(cli("ls")).stdout.splitlines()
    assert lines[0].split() == ["name", "problems", "source", "description"]
    assert [line.split()[:3] for line in lines[1:]] == [
        ["aime24", "30", "QwenLM/Qwen2.5-Math@a45202bd"], ["aime25", "30", "eth-sri/matharena@96440b20"],
        ["hmmt25", "30", "eth-sri/matharena@96440b20"], ["math500", "500", "hkust-nlp/simpleRL-reason@cf1c7858"]]
    entries = [json.loads(line) for line in ok(cli("ls", "--json")).stdout.splitlines()]
    assert [e["name"] for e in entries] == ["aime24", "aime25", "hmmt25", "math500"]
    assert all(len(e["sha256"]) == 64 for e in entries)


def _data(tmp_path, rows) -> str:
    path = tmp_path / "mine.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return str(path)


def test_unknown_benchmark_suggests_the_closest_name(tmp_path):
    fail(cli("run", "--model", "m", "--bench", "aime2024", "--out", str(tmp_path / "r.json")),
         "--bench: unknown benchmark 'aime2024' (did you mean 'aime24'?); bundled: aime24, aime25, hmmt25, math500 "
         "(or --data FILE for your own JSONL; `opd-eval ls` lists them)")
    fail(cli("run", "--model", "m", "--bench", "math-500", "--out", str(tmp_path / "r.json")),
         "--bench: unknown benchmark 'math-500' (did you mean 'math500'?); bundled: aime24, aime25, hmmt25, math500 "
         "(or --data FILE for your own JSONL; `opd-eval ls` lists them)")


def test_missing_answer_field_names_the_line_and_the_flag(tmp_path):
    data = _data(tmp_path, [{"id": "q1", "question": "1+1?", "final": "2"}, {"id": "q2", "question": "2+2?"}])
    out = str(tmp_path / "r.json")
    fail(cli("run", "--model", "m", "--data", data, "--out", out),
         "line 1 of mine.jsonl has no 'answer' field, the gold answer (set --answer-field to the field that "
         "holds it; the row has: final, id, question)")
    fail(cli("run", "--model", "m", "--data", data, "--answer-field", "final", "--out", out),
         "line 2 of mine.jsonl has no 'final' field, the gold answer (set --answer-field to the field that "
         "holds it; the row has: id, question)")
    # with the right fields the problems load and the next check (the model) speaks
    data = _data(tmp_path, [{"id": "q1", "question": "1+1?", "final": 2}])
    missing = str(tmp_path / "no-model")
    fail(cli("run", "--model", missing, "--data", data, "--answer-field", "final", "--out", out),
         f"--model {missing}: no such model directory")
    assert not Path(out).exists() and not progress_path(Path(out)).exists()


@pytest.mark.parametrize(("args", "expected"), [
    (["--model", "m", "--out", "r.json"], "give exactly one of --bench NAME (see `opd-eval ls`) or --data FILE"),
    (["--model", "m", "--bench", "aime24"], "--out is required: the results JSON file to write (e.g. --out base.json)"),
    (["--model", "m", "--bench", "aime24", "--out", "r.json", "--checkpoint", "5"],
     "--checkpoint needs --run-dir (the opd-train run directory that holds it)"),
    (["--model", "m", "--bench", "aime24", "--out", "r.json", "-n", "0"], "-n must be >= 1, got 0"),
    (["--model", "m", "--bench", "aime24", "--out", "r.json", "--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
])
def test_bad_flags(args, expected):
    fail(cli("run", *args), expected)


def test_checkpoint_that_is_not_there_lists_the_ones_that_are(tmp_path):
    run_dir = tmp_path / "run"
    for step in (25, 50):
        (run_dir / f"checkpoint-{step:06d}").mkdir(parents=True)
        (run_dir / f"checkpoint-{step:06d}" / "adapter_config.json").write_text("{}")
    base = ["run", "--model", "m", "--bench", "aime24", "--out", str(tmp_path / "r.json"), "--run-dir", str(run_dir)]
    fail(cli(*base, "--checkpoint", "75"),
         f"--checkpoint 75: {run_dir} has no checkpoint-000075/ (checkpoints there: 25, 50)")
    fail(cli(*base), f"--run-dir {run_dir}: no 'latest' file yet (no checkpoint written); give --checkpoint N "
                     "(checkpoints there: 25, 50)")
    fail(cli(*base, "--checkpoint", "last"), "--checkpoint must be a step number or 'latest', got 'last'")


def test_integer_grader_refuses_a_non_integer_gold_before_sampling(tiny_model, tmp_path):
    data = _data(tmp_path, [{"id": "a", "problem": "x?", "answer": "7"},
                            {"id": "b", "problem": "y?", "answer": "\\frac{1}{2}"}])
    args = ["run", "--model", str(tiny_model), "--engine", "hf", "--data", data, "--grader", "integer",
            "--out", str(tmp_path / "r.json"), "--quiet"]
    expected = (r"line 2 of mine.jsonl: gold answer '\\frac{1}{2}' is not an integer, so the integer grader cannot "
                "grade against it (use the math grader)")
    fail(cli(*args), expected)
    # nothing was sampled: the progress file holds only its header, and a second try is not
    # told to --resume an 'unfinished evaluation'
    assert progress_path(tmp_path / "r.json").read_bytes().count(b"\n") == 1
    fail(cli(*args), expected)


# ------------------------------------------------------------------------------ run + resume


@pytest.fixture(scope="module")
def full_run(tiny_model, tmp_path_factory):
    out = tmp_path_factory.mktemp("full") / "full.json"
    result = ok(cli("run", "--model", str(tiny_model), *HF_ARGS, "--out", str(out)))
    return out, result


def test_run_writes_one_results_file_and_one_stdout_line(full_run, tiny_model):
    out, result = full_run
    assert not progress_path(out).exists()  # the sidecar is gone once the results are written
    res = orjson.loads(out.read_bytes())
    assert res["schema"] == "opd-eval/1" and res["step"] == 0 and res["adapter"] is None
    assert res["benchmark"]["name"] == "aime24" and res["benchmark"]["problems"] == 3 and res["benchmark"]["limit"] == 3
    assert len(res["model"]["sha256"]) == 64 and res["model"]["files"] >= 3
    assert res["sampling"] == {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "max_tokens": 12, "n": 2,
                               "thinking": "on", "template": EvalConfig.__dataclass_fields__["template"].default,
                               "problem_field": "problem", "grader": "math", "seed": 0}
    ids = [(r["prompt_id"], r["sample"]) for r in res["samples"]]
    assert ids == [(f"aime24-I-{i}", s) for i in (1, 2, 3) for s in (0, 1)]
    for row in res["samples"]:
        assert row["seed"] == derive_seed(0, row["prompt_id"], row["sample"])
        assert 1 <= row["length"] <= 12 and row["finish_reason"] in ("stop", "length")
        assert (row["finish_reason"] == "length") == (row["length"] == 12)
        assert row["correct"] == (row["reason"] == "match")
        assert isinstance(row["response_text"], str)
    # the metrics are those of the rows
    again = summarize(res["samples"], order=[f"aime24-I-{i}" for i in (1, 2, 3)])
    assert again["overall"] == {k: v for k, v in res["metrics"]["overall"].items() if k != "avg_ci"}
    assert [p["answer"] for p in res["metrics"]["per_problem"]] == ["204", "25", "809"]
    # stdout: exactly one JSON line, the overall metrics; the table went to stderr
    [line] = result.stdout.splitlines()
    summary = json.loads(line)
    assert summary["results"] == str(out) and summary["avg"] == res["metrics"]["overall"]["avg"]
    assert "avg@2" in result.stderr and "reasons" in result.stderr


class CrashAfter:
    """A real engine that is 'killed' (KeyboardInterrupt) when asked for its (k+1)-th chunk."""

    def __init__(self, engine, k: int):
        self.engine, self.k, self.name = engine, k, engine.name

    def generate(self, requests):
        if self.k == 0:
            raise KeyboardInterrupt
        self.k -= 1
        return self.engine.generate(requests)

    def close(self):
        self.engine.close()


def test_interrupted_run_resumes_to_the_same_results(full_run, tiny_model, tmp_path):
    from opd_common.config import build
    from opd_common.engines import make_engine
    from opd_eval.run import run

    out = tmp_path / "resumed.json"
    config = build(EvalConfig, None, {"model": str(tiny_model), "engine": "hf", "bench": "aime24", "limit": 3, "n": 2,
                                      "max_tokens": 12, "temperature": 0.7, "chunk": 2, "grade_workers": 1,
                                      "quiet": True, "out": str(out)})
    with pytest.raises(KeyboardInterrupt):
        run(config, engine=CrashAfter(make_engine(config.engine_config()), 1))
    assert not out.exists()
    lines = progress_path(out).read_bytes().splitlines()
    assert len(lines) == 1 + 2  # the header and the first chunk's two graded samples
    with open(progress_path(out), "ab") as f:
        f.write(b'{"prompt_id": "aime24-I-2", "sam')  # a row torn by the crash
    # without --resume the unfinished evaluation is not silently replaced
    fail(cli("run", "--model", str(tiny_model), *HF_ARGS, "--out", str(out)),
         f"--out {out} has an unfinished evaluation (resumed.json.progress.jsonl); pass --resume to continue it, "
         "--overwrite to start again, or choose another file")
    # nor continued with other settings
    other = [a if a != "0.7" else "0.9" for a in HF_ARGS]
    fail(cli("run", "--model", str(tiny_model), *other, "--out", str(out), "--resume"),
         "--resume: resumed.json.progress.jsonl was started with another sampling; run with the same settings, "
         "or pass --overwrite to start again")
    ok(cli("run", "--model", str(tiny_model), *HF_ARGS, "--out", str(out), "--resume"))
    resumed, full = orjson.loads(out.read_bytes()), orjson.loads(full_run[0].read_bytes())
    assert resumed["samples"] == full["samples"]  # per-sample seeds: chunking and resuming change nothing
    assert resumed["metrics"] == full["metrics"]
    assert resumed["timing"]["resumed"] is True
    fail(cli("run", "--model", str(tiny_model), *HF_ARGS, "--out", str(out)),
         f"--out {out} already holds finished results; pass --overwrite or choose another file")


# -------------------------------------------------------------------------- compare, report


def make_results(path: Path, correct_per_problem: list[int], *, bench: str = "aime24", n: int = 2,
                 step: int | None = 0, **sampling) -> Path:
    """A results file for hand-written verdicts: problem i has correct_per_problem[i] of n correct."""
    problems = load_benchmark(bench, None, limit=len(correct_per_problem)).problems
    config = EvalConfig(model="m", bench=bench, limit=len(problems), n=n, out=str(path), **sampling)
    bench_obj = load_benchmark(bench, None, limit=len(problems))
    rows = []
    for p, c in zip(problems, correct_per_problem, strict=True):
        for s in range(n):
            good = s < c
            rows.append({"prompt_id": p.prompt_id, "sample": s, "seed": derive_seed(config.seed, p.prompt_id, s),
                         "finish_reason": "stop", "length": 100 + s, "answer_from": "boxed",
                         "extracted": p.answer if good else "0", "correct": good,
                         "reason": "match" if good else "mismatch"})
    header = {"model": {"ref": "m", "revision": None, "sha256": None, "files": 0}, "adapter": None,
              "benchmark": bench_obj.describe(len(problems)), "sampling": config.sampling()}
    path.write_bytes(orjson.dumps(assemble(header, config, bench_obj, rows, step, "hf", 1.0)))
    return path


def test_compare_hand_computed(tmp_path):
    a = make_results(tmp_path / "a.json", [0, 1, 2, 1])  # accuracies 0, .5, 1, .5
    b = make_results(tmp_path / "b.json", [1, 1, 2, 2], seed=7)  # .5, .5, 1, 1 (another seed: comparable)
    result = ok(cli("compare", str(a), str(b), "--resamples", "2000"))
    report = json.loads(result.stdout)
    [c] = report["comparisons"]
    assert (c["problems"], c["avg_a"], c["avg_b"], c["diff"]) == (4, 0.5, 0.75, 0.25)
    assert (c["wins"], c["losses"], c["ties"]) == (2, 0, 2)
    assert 0.0 <= c["ci"][0] <= 0.25 <= c["ci"][1] <= 0.5
    assert (c["p_value"], c["p_method"]) == (0.5, "exact")  # d = (.5, 0, 0, .5): 2 of 4 sign flips
    assert [p["diff"] for p in c["per_problem"]] == [0.5, 0.0, 0.0, 0.5]
    assert report["baseline"]["avg"] == 0.5
    assert "b.json" in result.stderr and "2/0/2" in result.stderr
    # the same seed gives the same CI
    assert json.loads(ok(cli("compare", str(a), str(b), "--resamples", "2000")).stdout) == report


def test_compare_refuses_different_benchmarks_and_settings(tmp_path):
    a = make_results(tmp_path / "a.json", [0, 1, 2])
    other_bench = make_results(tmp_path / "b.json", [0, 1, 2], bench="aime25")
    hotter = make_results(tmp_path / "c.json", [0, 1, 2], temperature=0.7, max_tokens=100)
    fewer = make_results(tmp_path / "d.json", [0, 1])
    fail(cli("compare", str(a), str(other_bench)),
         f"{a} and {other_bench} are not comparable: different benchmarks (aime24 vs aime25). A paired comparison "
         "needs the same problems under the same protocol (pass --force to compare anyway, over the problems "
         "both have)")
    fail(cli("compare", str(a), str(hotter)),
         f"{a} and {hotter} are not comparable: different sampling settings (max_tokens 38912 vs 100; temperature "
         "1.0 vs 0.7). A paired comparison needs the same problems under the same protocol (pass --force to compare "
         "anyway, over the problems both have)")
    result = cli("compare", str(a), str(fewer))
    assert result.exit_code == 1 and "different problems of aime24 (3 vs 2 problems" in result.stderr
    # --force: over the shared problems, with the reasons kept as warnings
    c = json.loads(ok(cli("compare", str(a), str(fewer), "--force")).stdout)["comparisons"][0]
    assert c["problems"] == 2 and c["diff"] == 0.0 and c["warnings"]
    fail(cli("compare", str(a), str(other_bench), "--force"), f"{a} and {other_bench} share no problem ids; "
         "there is nothing to pair")
    fail(cli("compare", str(a)), "compare needs at least two results files: BASELINE.json OTHER.json [...]")
    (tmp_path / "x.json").write_text('{"hello": 1}')
    fail(cli("compare", str(a), str(tmp_path / "x.json")),
         f"{tmp_path / 'x.json'}: not an opd-eval results file (expected \"schema\": \"opd-eval/1\")")


def test_report_table_and_plot(tmp_path):
    from PIL import Image

    d = tmp_path / "results"
    d.mkdir()
    make_results(d / "step0.json", [0, 1, 2, 1], step=0)     # avg 50.0
    make_results(d / "step50.json", [1, 1, 2, 1], step=50)   # avg 62.5, +12.5 vs step 0
    make_results(d / "step100.json", [1, 1, 2, 2], step=100)  # avg 75.0, +25.0 vs step 0
    (d / "config.json").write_text('{"not": "results"}')  # other JSON files are skipped
    result = ok(cli("report", str(d), "--resamples", "2000"))
    md = (d / "report.md").read_text()
    assert result.stdout == md + "\n"
    rows = [line for line in md.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split(" | ")[:2] for r in rows] == [["| 0", "step0.json"], ["| 50", "step50.json"],
                                                  ["| 100", "step100.json"]]
    assert [r.split(" | ")[2].split(" ")[0] for r in rows] == ["50.0", "62.5", "75.0"]
    assert [r.split(" | ")[8].split(" ")[0] for r in rows] == ["-", "+12.5", "+25.0"]
    assert rows[2].split(" | ")[10] == "2/0/2 |"
    with Image.open(d / "accuracy.png") as img:
        img.load()
        assert img.format == "PNG" and img.size[0] > 300 and img.size[1] > 200
    # results without a training step cannot be placed
    make_results(d / "other.json", [0, 0, 0, 0], step=None)
    result = cli("report", str(d))
    assert result.exit_code == 1 and "other.json: no training step" in result.stderr
    fail(cli("report", str(tmp_path / "empty-or-missing")),
         f"report: {tmp_path / 'empty-or-missing'} is not a directory (give the folder that holds results files)")
