"""opd-rollout with the hf engine on the tiny model: records, alignment, determinism, streams, errors.

Most tests call the click command in-process (CliRunner); the streaming and pipeline tests run
the console scripts as real subprocesses. The vLLM engine has its own file (test_rollout_vllm.py),
which reuses the helpers defined here.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
from click.testing import CliRunner

from opd_common.datasets import bundled_path, sha256_of
from opd_common.engines import derive_seed
from opd_common.records import validate
from opd_common.streams import MANIFEST, decode_line, iter_inputs, sha256_file
from opd_common.tiny import EOS_TOKEN
from opd_rollout.cli import command

BIN = Path(sys.executable).parent

# The teacher-forced forward reproduces the engine's log-probs up to float32 noise. Measured max
# abs diff on the tiny model (CPU, float32), sampled and top-k log-probs: hf 3.3e-6 (base), 2.1e-6 (LoRA).
# 1e-4 leaves room for kernel changes, and is still >1000x below the gap to the temperature-scaled
# log-probs (checked below), so a wrong convention or an off-by-one alignment cannot pass.
ALIGN_TOL = 1e-4
# The same sample decoded in batches of different shapes (padding, batch size) gives the same
# tokens; its log-probs differ only in float32 reduction order: measured max 3.1e-6.
BATCH_TOL = 1e-5

# The reference run: 3 AIME prompts x 4 samples at temperature 0.7 with top-k 20. At T=0.7 the
# tiny model's responses are 1-20 tokens long, so --max-tokens 8 gives both 'stop' and 'length'.
MAIN_ARGS = ["-n", "4", "--max-tokens", "8", "--limit", "3", "--temperature", "0.7", "--top-k", "20",
             "--topk-logprobs", "5", "aime24"]


# --------------------------------------------------------------------------- helpers


def rollout(model: Path, *args: str, input: str | bytes | None = None, engine: str = "hf"):
    """Invoke opd-rollout in-process on `model` (hf engine, no progress bar)."""
    return CliRunner().invoke(command, ["--model", str(model), "--engine", engine, "--quiet", *args], input=input)


def ok(result):
    assert result.exit_code == 0, f"exit {result.exit_code}\nstderr: {result.stderr}\n{result.exception!r}"
    return result


def parse(stdout: str | bytes) -> list[dict]:
    """Every stdout line must be a valid record (stdout carries records only)."""
    lines = stdout.splitlines() if isinstance(stdout, bytes) else stdout.encode().splitlines()
    return [validate(decode_line(line, f"stdout line {i}"), f"stdout line {i}") for i, line in enumerate(lines, 1)]


def by_id(recs: list[dict]) -> dict[str, dict]:
    return {r["id"]: r for r in recs}


def bundled_rows(name: str, n: int) -> list[dict]:
    with open(bundled_path(name), "rb") as f:
        return [orjson.loads(line) for _, line in zip(range(n), f, strict=False)]


def load_tokenizer(model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


def load_model(model: Path, adapter: Path | None = None):
    """The reference: AutoModelForCausalLM in float32 (+ peft adapter), eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        lm = PeftModel.from_pretrained(lm, adapter)
    return lm.eval()


def teacher_forced_logits(lm, rec: dict):
    """Raw logits [T, V] predicting each response token from a forward of prompt_ids + response_ids."""
    import torch

    prompt, response = rec["prompt_ids"].tolist(), rec["response_ids"].tolist()
    with torch.no_grad():
        logits = lm(input_ids=torch.tensor([prompt + response])).logits[0].float()
    return logits[len(prompt) - 1:len(prompt) + len(response) - 1]


def chosen(logprobs_TV, rec: dict) -> np.ndarray:
    import torch

    ids = torch.tensor(rec["response_ids"].tolist(), dtype=torch.long)[:, None]
    return logprobs_TV.gather(-1, ids)[:, 0].numpy()


def assert_aligned(lm, recs: list[dict], k: int, top_k: int, tol: float = ALIGN_TOL) -> float:
    """Each record's logprobs/top-k equal log_softmax of the teacher-forced raw logits, and every
    sampled token is among the `top_k` (--top-k) most likely; returns the max abs diff."""
    import torch

    worst = 0.0
    for rec in recs:
        logprobs_TV = torch.log_softmax(teacher_forced_logits(lm, rec), dim=-1)
        chosen_T = chosen(logprobs_TV, rec)
        diff = float(np.abs(chosen_T - rec["logprobs"]).max(initial=0.0))
        assert diff <= tol, f"{rec['id']}: logprobs differ from the teacher-forced forward by {diff:.2e}"
        rank_T = (logprobs_TV > torch.from_numpy(chosen_T)[:, None]).sum(-1)
        assert int(rank_T.max()) < top_k, f"{rec['id']}: sampled a token outside the top-{top_k}"
        values_TK, ids_TK = torch.topk(logprobs_TV, k, dim=-1)
        np.testing.assert_array_equal(rec["topk_ids"], ids_TK.numpy(), err_msg=rec["id"])
        np.testing.assert_allclose(rec["topk_logprobs"], values_TK.numpy(), rtol=0, atol=tol, err_msg=rec["id"])
        worst = max(worst, diff)
    return worst


def make_lora_adapter(model: Path, out: Path, seed: int = 123, scale: float = 0.05) -> Path:
    """A peft LoRA adapter (r=8, all linear layers) with random non-zero B, so it changes the model."""
    import torch
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    peft_model = get_peft_model(load_model(model), config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * scale)
    peft_model.save_pretrained(out)
    return out


def assert_records_carry_inputs(recs: list[dict], rows: list[dict], n: int, engine: str) -> None:
    """ids, samples, group size, example, per-sample seeds and the sampling block, for every sample."""
    assert [r["id"] for r in recs] == [f"{row['id']}:{s}" for row in rows for s in range(n)]
    for rec, (row, s) in zip(recs, [(row, s) for row in rows for s in range(n)], strict=True):
        assert (rec["prompt_id"], rec["sample"], rec["group_size"]) == (row["id"], s, n)
        assert rec["example"] == row
        assert rec["sampling"]["seed"] == derive_seed(0, row["id"], s)
        assert rec["sampling"]["engine"] == engine
        assert rec["sampling"]["logprobs"] == "raw"
    assert len({r["sampling"]["seed"] for r in recs}) == len(recs)


def assert_finish_reasons(recs: list[dict], eos_id: int, max_tokens: int) -> None:
    assert {r["finish_reason"] for r in recs} == {"stop", "length"}
    for rec in recs:
        ids = rec["response_ids"].tolist()
        if rec["finish_reason"] == "stop":
            assert ids[-1] == eos_id and eos_id not in ids[:-1] and len(ids) <= max_tokens
        else:
            assert len(ids) == max_tokens and eos_id not in ids
        assert np.all(rec["logprobs"] <= 0) and np.all(np.isfinite(rec["logprobs"]))


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def main_run(tiny_model):
    result = ok(rollout(tiny_model, *MAIN_ARGS))
    return result.stdout_bytes, parse(result.stdout_bytes)


@pytest.fixture(scope="module")
def reference_lm(tiny_model):
    return load_model(tiny_model)


@pytest.fixture(scope="module")
def lora_adapter(tiny_model, tmp_path_factory):
    return make_lora_adapter(tiny_model, tmp_path_factory.mktemp("lora") / "adapter")


# --------------------------------------------------------------------------- records


def test_help_opens_with_a_pipe_example():
    result = CliRunner().invoke(command, ["--help"])
    assert result.exit_code == 0
    assert "opd-rollout --model M -n 4 aime24 | opd-score" in result.output.split("Options:")[0]


def test_records_are_valid_and_carry_their_inputs(main_run, tiny_model):
    _, recs = main_run
    assert len(recs) == 12
    assert_records_carry_inputs(recs, bundled_rows("aime24", 3), n=4, engine="hf")
    for rec in recs:
        assert rec["policy"] == {"model": str(tiny_model), "revision": None, "adapter": None, "version": 0}
        assert rec["sampling"] | {"seed": 0} == {
            "temperature": 0.7, "top_p": 1.0, "top_k": 20, "max_tokens": 8, "seed": 0, "engine": "hf",
            "thinking": True, "logprobs": "raw"}
        assert rec["topk_ids"].shape == rec["topk_logprobs"].shape == (len(rec["response_ids"]), 5)
    # the four samples of a prompt share one rendered prompt
    assert len({r["prompt_ids"].tobytes() for r in recs}) == 3
    eos_id = load_tokenizer(tiny_model).convert_tokens_to_ids(EOS_TOKEN)
    assert_finish_reasons(recs, eos_id, max_tokens=8)


def test_logprobs_are_raw_and_match_a_teacher_forced_forward(main_run, reference_lm):
    """Sampled at T=0.7, top-k 20, the record still holds log_softmax(raw logits) (T=1, no top-k)."""
    import torch

    _, recs = main_run
    assert_aligned(reference_lm, recs, k=5, top_k=20)
    # the check can tell the conventions apart: temperature-scaled log-probs are far off
    gap = max(float(np.abs(chosen(torch.log_softmax(teacher_forced_logits(reference_lm, r) / 0.7, -1), r)
                           - r["logprobs"]).max()) for r in recs)
    assert gap > 1000 * ALIGN_TOL


# --------------------------------------------------------------------------- determinism


def test_same_seed_gives_byte_identical_records(main_run, tiny_model):
    stdout, _ = main_run
    assert ok(rollout(tiny_model, *MAIN_ARGS)).stdout_bytes == stdout


def test_a_different_seed_gives_different_samples(main_run, tiny_model):
    _, recs = main_run
    other = parse(ok(rollout(tiny_model, *MAIN_ARGS, "--seed", "1")).stdout_bytes)
    assert [r["id"] for r in other] == [r["id"] for r in recs]
    assert all(a["sampling"]["seed"] == derive_seed(1, a["prompt_id"], a["sample"]) for a in other)
    assert all(np.array_equal(a["prompt_ids"], b["prompt_ids"]) for a, b in zip(other, recs, strict=True))
    differ = sum(not np.array_equal(a["response_ids"], b["response_ids"]) for a, b in zip(other, recs, strict=True))
    assert differ >= 10  # measured: 12 of 12 (two 1-token responses could coincide by chance)


@pytest.mark.parametrize("limit, layout", [
    (1, ["--batch-size", "1"]),  # the first prompt alone, one sample per batch
    (2, ["--batch-size", "5"]),  # batches that mix the two prompts' samples
    (3, ["--batch-size", "3", "--batch-prompts", "2"]),  # other neighbours, other padding
], ids=["alone", "mixed", "regrouped"])
def test_a_sample_does_not_depend_on_its_batch(main_run, tiny_model, limit, layout):
    _, recs = main_run
    reference = by_id(recs)
    args = MAIN_ARGS[:MAIN_ARGS.index("--limit")] + MAIN_ARGS[MAIN_ARGS.index("--limit") + 2:]
    got = parse(ok(rollout(tiny_model, *args, "--limit", str(limit), *layout)).stdout_bytes)
    assert len(got) == 4 * limit
    for rec in got:
        ref = reference[rec["id"]]
        for key in ("prompt_ids", "response_ids", "topk_ids"):
            np.testing.assert_array_equal(rec[key], ref[key], err_msg=f"{rec['id']} {key}")
        assert (rec["finish_reason"], rec["sampling"], rec["response_text"]) == \
               (ref["finish_reason"], ref["sampling"], ref["response_text"])
        np.testing.assert_allclose(rec["logprobs"], ref["logprobs"], rtol=0, atol=BATCH_TOL)
        np.testing.assert_allclose(rec["topk_logprobs"], ref["topk_logprobs"], rtol=0, atol=BATCH_TOL)


# --------------------------------------------------------------------------- streams


def _line_reader(stream) -> queue.Queue:
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in iter(stream.readline, b""):
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return lines


@pytest.mark.slow  # a real subprocess: ~10 s of interpreter and torch start-up
def test_stdin_is_streamed_record_by_record(tiny_model, tmp_path):
    """A record for each prompt line comes out while stdin is still open."""
    cmd = [str(BIN / "opd-rollout"), "--model", str(tiny_model), "--engine", "hf", "--max-tokens", "4", "--quiet", "-"]
    with open(tmp_path / "stderr", "wb") as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err)
        try:
            lines = _line_reader(proc.stdout)
            for pid in ("p1", "p2"):
                proc.stdin.write(orjson.dumps({"id": pid, "problem": f"What is {pid}?"}) + b"\n")
                proc.stdin.flush()
                line = lines.get(timeout=120)  # stdin stays open: only streaming can produce this
                assert line is not None, (tmp_path / "stderr").read_text()
                (rec,) = parse(line)
                assert rec["id"] == f"{pid}:0"
            proc.stdin.close()
            assert proc.wait(timeout=60) == 0, (tmp_path / "stderr").read_text()
            assert lines.get(timeout=5) is None  # nothing more after the two records
        finally:
            proc.kill()


@pytest.mark.slow  # real subprocesses: ~10 s of interpreter and torch start-up each
def test_the_next_batch_decodes_while_the_reader_has_not_read_the_last(tiny_model, tmp_path):
    """Records go out in a writer thread: a batch several times a pipe's buffer, which the next stage does not
    read yet (a trainer in its step), does not hold back the next batch's decoding (OPD_TIMELINE: batch 1 is
    decoded while batch 0's write waits); once read, the stream is byte for byte the one a ready reader gets."""
    from opd_common.timeline import read

    cmd = [str(BIN / "opd-rollout"), "--model", str(tiny_model), "--engine", "hf", "--quiet", "--batch-prompts", "8",
           "-n", "4", "--max-tokens", "64", "--topk-logprobs", "20", "--limit", "24", "aime24"]
    reference = subprocess.run(cmd, capture_output=True, check=True, timeout=300).stdout
    assert len(reference) > 3 * 4 * 65536  # each of the 3 batches is > 4 pipe buffers: its write blocks
    timeline = tmp_path / "timeline"

    def spans(name: str) -> dict:
        return {s["batch"]: s for s in (read(timeline) if timeline.exists() else []) if s["name"] == name}

    decoded_unread, out = read_after(cmd, timeline, lambda: 1 in spans("decode"))
    assert decoded_unread, "batch 1 was not decoded while batch 0 waited in the pipe"
    assert spans("decode")[1]["end"] < spans("write")[0]["end"]
    assert out == reference


def read_after(cmd: list[str], timeline: Path, ready, wait: float = 90) -> tuple[bool, bytes]:
    """Run `cmd` with OPD_TIMELINE=timeline and read nothing of its stdout until ready() (or it exits, or `wait`
    seconds pass); then read it all. (ready() at that point, its stdout.)"""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env={**os.environ, "OPD_TIMELINE": str(timeline)})
    try:
        deadline = time.monotonic() + wait
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        was_ready = ready()
        out = proc.stdout.read()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
    return was_ready, out


@pytest.mark.slow  # a real subprocess: ~10 s of interpreter and torch start-up
def test_pipeline_into_opd_cat_summary(main_run, tiny_model):
    _, recs = main_run
    rollout_cmd = " ".join([str(BIN / "opd-rollout"), "--model", str(tiny_model), "--engine", "hf", "--quiet",
                            *MAIN_ARGS])
    proc = subprocess.run(f"set -o pipefail; {rollout_cmd} | {BIN / 'opd-cat'} --summary", shell=True,
                          executable="/bin/bash", capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode()
    summary = json.loads(proc.stdout)
    lengths = [len(r["response_ids"]) for r in recs]
    finish = {reason: sum(r["finish_reason"] == reason for r in recs) for reason in ("stop", "length")}
    assert summary["records"] == 12 and summary["groups"] == 3
    assert summary["response_tokens"] == sum(lengths)
    assert summary["response_length"]["max"] == max(lengths) and summary["response_length"]["min"] == min(lengths)
    assert summary["finish_reason"] == finish
    assert summary["engine"] == {"hf": 12} and summary["policy_version"] == {"0": 12}


# --------------------------------------------------------------------------- bad input


def _bad_json(tmp_path: Path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"id": "a", "problem": "1+1?"}\n{"id": "b", problem: "2+2?"}\n')
    return str(path)


def _no_problem(tmp_path: Path) -> str:
    path = tmp_path / "questions.jsonl"
    path.write_text('{"id": "a", "query": "1+1?"}\n')  # 'question' would be a recognised prompt field
    return str(path)


@pytest.mark.parametrize("case", ["malformed-json", "missing-field", "unknown-benchmark", "missing-model", "n-zero",
                                  "missing-template-file"])
def test_bad_input_is_one_clear_error_and_no_manifest(tiny_model, tmp_path, case):
    model, args = str(tiny_model), []
    missing = str(tmp_path / "no-such-model")
    if case == "malformed-json":
        args, expected = [_bad_json(tmp_path)], (
            "Error: record 2 of prompts.jsonl is not valid JSON (unexpected character, expected a string key "
            "at column 13)")
    elif case == "missing-field":
        args, expected = [_no_problem(tmp_path)], (
            "Error: line 1 of questions.jsonl has no prompt: expected a text field (problem, prompt, question) or a "
            "conversation (prompt, messages: {role, content} lists); its columns: id, query; name the prompt column "
            "with --prompt-field (or fill --template from the columns)")
    elif case == "unknown-benchmark":
        args, expected = ["aime2024"], (
            "Error: unknown benchmark 'aime2024' (did you mean 'aime24'?); "
            "bundled: aime24, aime25, hmmt25, math500, train-aime, train-math")
    elif case == "missing-model":
        model, args, expected = missing, ["aime24"], f"Error: --model {missing}: no such model directory"
    elif case == "n-zero":
        args, expected = ["-n", "0", "aime24"], "Error: -n must be >= 1, got 0"
    else:
        template = tmp_path / "none.txt"
        args, expected = ["--template", f"@{template}", "aime24"], (
            f"Error: --template @{template}: cannot read the file (No such file or directory)")
    out = tmp_path / "out"
    result = rollout(Path(model), "--max-tokens", "4", "--out", str(out), *args)
    assert result.exit_code == 1, result.output
    assert result.stderr == expected + "\n"  # exactly one line: no traceback, no progress bars
    assert result.stdout == ""
    assert not (out / MANIFEST).exists()
    if out.exists():
        assert not list(out.glob("*.jsonl.zst"))  # at most a *.tmp, never a shard that looks complete


def test_bad_input_on_stdin_names_stdin(tiny_model):
    result = rollout(tiny_model, "--max-tokens", "4", input='{"id": "a", "problem": "1+1?"}\nnot json\n')
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        "Error: record 2 of <stdin> is not valid JSON (invalid literal, expected 'null' at column 1)"]
    assert [r["id"] for r in parse(result.stdout_bytes)] == ["a:0"]  # the record before it was written


# --------------------------------------------------------------------------- outputs and options


def test_out_dir_writes_shards_and_a_manifest(tiny_model, tmp_path):
    out = tmp_path / "rollouts"
    args = ["-n", "2", "--max-tokens", "8", "--limit", "3", "aime24"]
    ok(rollout(tiny_model, *args, "--out", str(out), "--shard-size", "4"))
    manifest = json.loads((out / MANIFEST).read_text())
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "rollouts-00000.jsonl.zst", "rollouts-00001.jsonl.zst"]
    assert manifest["tool"] == "opd-rollout" and manifest["schema"] == "opd/1" and manifest["records"] == 6
    assert [(s["file"], s["records"]) for s in manifest["shards"]] == \
           [("rollouts-00000.jsonl.zst", 4), ("rollouts-00001.jsonl.zst", 2)]
    assert all(s["sha256"] == sha256_file(out / s["file"]) for s in manifest["shards"])
    config = manifest["config"]
    assert (config["model"], config["engine"], config["n"], config["max_tokens"], config["limit"], config["seed"],
            config["shard_size"], config["out"]) == (str(tiny_model), "hf", 2, 8, 3, 0, 4, str(out))
    assert config["template"].startswith("Problem: {problem}")  # defaults are resolved too
    assert manifest["inputs"] == [{"input": str(bundled_path("aime24")), "kind": "file", "sha256": sha256_of("aime24")}]
    # the directory reads back (hashes checked) as the same records stdout gives
    from_dir = [rec for rec, _ in iter_inputs([str(out)])]
    from_stdout = parse(ok(rollout(tiny_model, *args)).stdout_bytes)
    assert [r["id"] for r in from_dir] == [r["id"] for r in from_stdout]
    for a, b in zip(from_dir, from_stdout, strict=True):
        assert orjson.dumps(a, option=orjson.OPT_SERIALIZE_NUMPY) == orjson.dumps(b, option=orjson.OPT_SERIALIZE_NUMPY)


def test_encoding_json_writes_plain_lists(main_run, tiny_model):
    _, recs = main_run
    packed = orjson.loads(main_run[0].splitlines()[0])
    assert packed["logprobs"]["nd"] == "float32" and packed["response_ids"]["nd"] == "int32"  # the default
    lines = ok(rollout(tiny_model, *MAIN_ARGS, "--encoding", "json")).stdout_bytes.splitlines()
    assert len(lines) == 12
    for line, ref in zip(lines, recs, strict=True):
        raw = orjson.loads(line)
        assert raw["response_ids"] == ref["response_ids"].tolist() and raw["prompt_ids"] == ref["prompt_ids"].tolist()
        assert all(isinstance(x, int) for x in raw["response_ids"])
        assert all(isinstance(x, float) for x in raw["logprobs"])
        assert np.array_equal(np.asarray(raw["logprobs"], dtype=np.float32), ref["logprobs"])  # float32 round-trip
        assert raw["topk_ids"] == ref["topk_ids"].tolist()


def test_thinking_off_renders_an_empty_think_block(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    problem = bundled_rows("aime24", 1)[0]["problem"]
    user = (f"<|im_start|>user\nProblem: {problem}\n\nPlease reason step by step, and put your final answer "
            "within \\boxed{}.<|im_end|>\n<|im_start|>assistant\n")
    for thinking, suffix in (("on", ""), ("off", "<think>\n\n</think>\n\n")):
        (rec,) = parse(ok(rollout(tiny_model, "--max-tokens", "2", "--limit", "1", "--thinking", thinking,
                                  "aime24")).stdout_bytes)
        assert tokenizer.decode(rec["prompt_ids"].tolist()) == user + suffix
        assert rec["sampling"]["thinking"] is (thinking == "on")


def test_template_from_file(tiny_model, tmp_path):
    template = tmp_path / "template.txt"
    template.write_text("Q: {problem}\nThe answer is {answer}; show why.")
    (rec,) = parse(ok(rollout(tiny_model, "--max-tokens", "2", "--limit", "1", "--template", f"@{template}",
                              "aime24")).stdout_bytes)
    row = bundled_rows("aime24", 1)[0]
    assert load_tokenizer(tiny_model).decode(rec["prompt_ids"].tolist()) == (
        f"<|im_start|>user\nQ: {row['problem']}\nThe answer is {row['answer']}; show why.<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_lora_adapter_samples_from_the_adapted_model(tiny_model, lora_adapter, reference_lm):
    """Log-probs match a teacher-forced peft forward and differ from the base model's."""
    import torch

    recs = parse(ok(rollout(tiny_model, "--adapter", str(lora_adapter), *MAIN_ARGS)).stdout_bytes)
    assert len(recs) == 12 and all(r["policy"]["adapter"] == str(lora_adapter) for r in recs)
    assert_aligned(load_model(tiny_model, lora_adapter), recs, k=5, top_k=20)
    base_gap = max(float(np.abs(chosen(torch.log_softmax(teacher_forced_logits(reference_lm, r), -1), r)
                                - r["logprobs"]).max()) for r in recs)
    assert base_gap > 0.1  # measured 0.5-1.6 per record: the adapter really is applied
