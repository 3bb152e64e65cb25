"""opd-train mechanics on the tiny models: budget, run dir, exact resume, atomic checkpoints,
micro-batch invariance, adapters that load elsewhere, and errors. Learning is in test_train_learning.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from test_rollout import load_model, ok, parse, rollout
from test_score import score

from opd_train import cli

TIMING = {"step_time", "tokens_per_s"}


@pytest.fixture(scope="module")
def scored(tiny_model, tiny_teacher, tmp_path_factory) -> Path:
    """8 AIME prompts x 2 samples from the tiny student (top-4), scored by the tiny teacher
    (sampled tokens + own top-4) and with a shift block (post = teacher, pre = student)."""
    recs = ok(rollout(tiny_model, "-n", "2", "--max-tokens", "12", "--limit", "8", "--topk-logprobs", "4",
                      "aime24")).stdout_bytes
    out = ok(score("--teacher", f"t={tiny_teacher}", "--topk", "4", "--shift", f"post={tiny_teacher},pre={tiny_model}",
                   "--shift-k", "4", input=recs)).stdout_bytes
    path = tmp_path_factory.mktemp("scored") / "scored.jsonl"
    path.write_bytes(out)
    assert len(parse(out)) == 16
    return path


def train(*args: str, input: bytes | None = None):
    return CliRunner().invoke(cli.command, ["--quiet", *args], input=input)


def base_args(model: Path, out: Path | None, *extra: str) -> list[str]:
    where = [] if out is None else ["--out", str(out)]
    return ["--model", str(model), *where, "--lr", "1e-3", "--lora-r", "4", "--lora-alpha", "8", *extra]


def metrics(run_dir: Path, drop_timing: bool = True) -> list[dict]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not (drop_timing and k in TIMING)} for r in rows]


def adapter_bytes(path: Path) -> bytes:
    return (path / "adapter_model.safetensors").read_bytes()


def error_of(result) -> str:
    assert result.exit_code != 0, result.stdout
    return result.stderr


# --------------------------------------------------------------------------- budget and run dir


def test_exact_budget_run_dir_and_checkpoints(scored, tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    ok(train(*base_args(tiny_model, run_dir, "--loss", "rkl", "--max-steps", "3", "--batch-groups", "2",
                        "--save-every", "2"), str(scored)))
    rows = metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["records"] == 4 for r in rows)  # 2 groups x group_size 2
    assert [r["records_read"] for r in rows] == [4, 8, 12]
    assert {"loss", "grad_norm", "lr", "tokens", "reverse_kl", "ratio", "advantage"} <= set(rows[0])
    names = sorted(p.name for p in run_dir.iterdir())
    assert names == ["checkpoint-000002", "checkpoint-000003", "config.json", "latest", "metrics.jsonl"]
    assert (run_dir / "latest").read_text() == "checkpoint-000003\n"
    state = json.loads((run_dir / "checkpoint-000003" / "trainer_state.json").read_text())
    assert state["step"] == 3 and state["max_steps"] == 3 and state["complete"] and state["records_read"] == 12
    config = json.loads((run_dir / "config.json").read_text())
    assert config["tool"] == "opd-train" and config["config"]["max_steps"] == 3 and config["inputs"] == [str(scored)]


def test_fkl_reports_the_importance_ratio_and_drift_of_the_sampled_tokens(scored, tiny_model, tmp_path):
    """fkl does not correct for a lagging sampler but reports it: `ratio` = mean exp(log p_S(y_t) - logprobs_t) and
    `drift` = mean(r - 1 - log r). Step 1's student is the base model that sampled the records (LoRA B = 0): 1
    and 0; once the adapter has moved (lr 1e-2), the same kind of records (sampled by the base) are off-policy."""
    run_dir = tmp_path / "run"
    ok(train(*base_args(tiny_model, run_dir, "--loss", "fkl", "--max-steps", "3", "--batch-size", "4",
                        "--lr", "1e-2"), str(scored)))
    rows = metrics(run_dir)
    assert rows[0]["ratio"] == pytest.approx(1.0, abs=1e-5) and rows[0]["drift"] < 1e-8
    assert abs(rows[2]["ratio"] - 1.0) > 1e-3 and rows[2]["drift"] > 1e-4, rows[2]


def test_short_input_is_an_error_unless_allowed(scored, tiny_model, tmp_path):
    args = base_args(tiny_model, tmp_path / "short", "--loss", "sft", "--max-steps", "5", "--batch-size", "6")
    result = train(*args, str(scored))  # 16 records = 2 steps of 6, 4 left over
    assert error_of(result) == (
        "Error: the input ended after 2 of --max-steps 5 steps (16 records read, 4 left in incomplete groups; "
        "checkpoint-000002 saved); give more input and --resume, or pass --allow-short to accept a short run\n")
    assert (tmp_path / "short" / "latest").read_text() == "checkpoint-000002\n"
    state = json.loads((tmp_path / "short" / "checkpoint-000002" / "trainer_state.json").read_text())
    assert state["step"] == 2 and not state["complete"]
    ok(train(*base_args(tiny_model, tmp_path / "allowed", "--loss", "sft", "--max-steps", "5", "--batch-size", "6",
                        "--allow-short"), str(scored)))
    assert [r["step"] for r in metrics(tmp_path / "allowed")] == [1, 2]


def test_resume_cannot_raise_the_budget_or_change_options(scored, tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    ok(train(*base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "2", "--batch-size", "4"), str(scored)))
    assert error_of(train(*base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "4", "--batch-size", "4",
                                     "--resume"), str(scored))) == (
        "Error: --resume: the options differ from the run's config.json (max_steps); resume with the same "
        "options (the step budget included), or start a new --out\n")
    assert error_of(train(*base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "2", "--batch-size", "4",
                                     "--resume"), str(scored))) == (
        f"Error: --resume: {run_dir} is complete (checkpoint-000002, --max-steps 2); nothing to do\n")
    assert error_of(train(*base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "2", "--batch-size", "4"),
                          str(scored))) == (
        f"Error: --out {run_dir} is not empty; use --resume to continue its run or --overwrite to replace it\n")


def test_resume_refuses_other_inputs_than_the_run_read(scored, tiny_model, tmp_path):
    """A resumed run skips the records it has read; given other inputs it would skip new data, so it refuses."""
    lines = scored.read_bytes().splitlines(keepends=True)
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_bytes(b"".join(lines[:8]))
    second.write_bytes(b"".join(lines[8:]))
    run_dir = tmp_path / "run"
    args = base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "4", "--batch-size", "4", "--allow-short")
    ok(train(*args, str(first)))  # 2 steps, 8 records read
    second_id = json.loads(lines[15])["id"]  # the 8th record of second.jsonl
    last_id = json.loads(lines[7])["id"]
    assert error_of(train(*args, "--resume", str(second))) == (
        f"Error: --resume: record 8 of second.jsonl is {second_id!r}, but record 8 the run read was {last_id!r}; "
        "pass the run's inputs again in the same order (new input after them)\n")
    ok(train(*args, "--resume", str(first), str(second)))
    assert [r["records_read"] for r in metrics(run_dir)] == [4, 8, 12, 16]


# --------------------------------------------------------------------------- exact resume


@pytest.fixture(scope="module")
def interleaved(scored, tmp_path_factory) -> Path:
    """The scored records with every group's first samples first: groups complete only in the second
    half, so batches leave records of incomplete groups pending across steps and checkpoints."""
    lines = scored.read_bytes().splitlines()
    path = tmp_path_factory.mktemp("interleaved") / "interleaved.jsonl"
    path.write_bytes(b"".join(line + b"\n" for line in lines[0::2] + lines[1::2]))
    return path


@pytest.mark.parametrize("loss", ["rkl", "shift"])
def test_resume_gives_the_same_steps_bit_for_bit(interleaved, tiny_model, tmp_path, monkeypatch, loss):
    """Stopped (Ctrl-C) during step 3 after checkpoint 2, then --resume: the metrics of every step and
    the final adapter equal an uninterrupted run's exactly (CPU). LoRA dropout is on, so the RNG
    state must come back too, and the checkpoint holds records of incomplete groups."""
    from opd_train.trainer import Trainer

    args = [*base_args(tiny_model, None), "--loss", loss, "--max-steps", "4", "--batch-groups", "2",
            "--save-every", "2", "--lora-dropout", "0.1", "--micro-batch-tokens", "200", str(interleaved)]
    if loss == "shift":
        args[-1:-1] = ["--lr-schedule", "cosine", "--warmup-steps", "1"]
    whole, part = tmp_path / "whole", tmp_path / "part"
    ok(train(*args, "--out", str(whole)))
    assert [r["records_read"] for r in metrics(whole)] == [10, 12, 14, 16]
    original = Trainer.train_step

    def interrupted(self, examples):
        if self.step == 2:
            raise KeyboardInterrupt
        return original(self, examples)

    monkeypatch.setattr(Trainer, "train_step", interrupted)
    assert train(*args, "--out", str(part)).exit_code == 1  # click's answer to Ctrl-C
    state = json.loads((part / "checkpoint-000002" / "trainer_state.json").read_text())
    assert state["records_read"] == 12  # 4 of them (groups 5-8's first samples) pending in the checkpoint
    monkeypatch.setattr(Trainer, "train_step", original)
    ok(train(*args, "--out", str(part), "--resume"))
    assert metrics(part) == metrics(whole)
    assert (part / "latest").read_text() == (whole / "latest").read_text() == "checkpoint-000004\n"
    assert adapter_bytes(part / "checkpoint-000004") == adapter_bytes(whole / "checkpoint-000004")


# --------------------------------------------------------------------------- atomic checkpoints

KILL_AT_SAVE = """
import os, sys
import opd_common.rundir as c
original = c.{target}
def killed(*args, **kwargs):
    if "checkpoint-000004" in str(args[0]) or "checkpoint-000004" in str(args[-1]):
        os._exit(9)  # the process dies here, nothing flushed or cleaned up
    return original(*args, **kwargs)
c.{target} = killed
from opd_train.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow  # two subprocesses that load torch
@pytest.mark.parametrize("target", ["fsync_tree", "atomic_write_text"])
def test_a_process_killed_mid_save_leaves_the_previous_checkpoint(scored, tiny_model, tmp_path, target):
    """Killed while checkpoint 4 is being written (fsync_tree: files written, not renamed) or just
    after its rename (atomic_write_text of `latest`): `latest` still names checkpoint 2, which loads, and
    --resume finishes the run."""
    run_dir = tmp_path / "run"
    args = ["--quiet", *base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "5", "--batch-size", "3",
                                  "--save-every", "2"), str(scored)]
    script = KILL_AT_SAVE.format(target=target)
    result = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 9, result.stderr
    assert (run_dir / "latest").read_text() == "checkpoint-000002\n"
    from peft import PeftModel

    PeftModel.from_pretrained(load_model(tiny_model), run_dir / "checkpoint-000002")  # loads
    # checkpoints are written in the background: step 5 may have trained (and logged) meanwhile
    assert [r["step"] for r in metrics(run_dir)][:4] == [1, 2, 3, 4]
    result = subprocess.run([str(Path(sys.executable).with_name("opd-train")), *args, "--resume"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (run_dir / "latest").read_text() == "checkpoint-000005\n"
    assert [r["step"] for r in metrics(run_dir)] == [1, 2, 3, 4, 5]
    assert not [p.name for p in run_dir.iterdir() if p.name.startswith(".")]  # no temporary left behind


# --------------------------------------------------------------------------- micro-batches


@pytest.mark.parametrize("loss", ["sft", "rkl", "fkl", "shift"])
def test_micro_batch_cut_does_not_change_the_step(scored, tiny_model, tmp_path, loss):
    """One step of 8 records in one micro-batch, or cut by a small token budget into several (and the
    LM head in chunks of 5 positions): same loss, metrics, gradient norm and adapter gradients."""
    runs = {}
    for name, extra in {"one": ["--micro-batch-tokens", "100000"],
                        "cut": ["--micro-batch-tokens", "300", "--logit-chunk", "5"]}.items():
        run_dir = tmp_path / name
        ok(train(*base_args(tiny_model, run_dir, "--loss", loss, "--max-steps", "1", "--batch-size", "8", *extra),
                 str(scored)))
        runs[name] = run_dir
    one, cut = metrics(runs["one"])[0], metrics(runs["cut"])[0]
    assert one.keys() == cut.keys()
    for key in one:
        assert one[key] == pytest.approx(cut[key], rel=1e-5, abs=1e-7), key
    grads = {name: step_gradients(tiny_model, scored, loss, *extra) for name, extra in
             {"one": (100000, 2048), "cut": (300, 5)}.items()}
    assert grads["one"].keys() == grads["cut"].keys()
    for key, g in grads["one"].items():
        assert float((g - grads["cut"][key]).abs().max()) <= 1e-5 * float(g.abs().max()) + 1e-9, key


def step_gradients(model: Path, scored: Path, loss: str, micro_batch_tokens: int, logit_chunk: int) -> dict:
    """The adapter gradients of one step over the first 8 records (before the optimizer)."""
    from opd_common.streams import iter_inputs
    from opd_train.config import TrainConfig
    from opd_train.data import make_example, micro_batches
    from opd_train.trainer import Trainer

    config = TrainConfig(model=str(model), out="unused", loss=loss, max_steps=1, batch_size=8, lr=1e-3, lora_r=4,
                         lora_alpha=8, micro_batch_tokens=micro_batch_tokens, logit_chunk=logit_chunk)
    trainer = Trainer(config, device="cpu")
    items = [item for item, _ in zip(iter_inputs([str(scored)]), range(8), strict=False)]
    examples = sorted((make_example(rec, where, config) for rec, where in items), key=lambda e: -e.length)
    cuts = micro_batches(examples, micro_batch_tokens)
    assert (len(cuts) > 1) == (micro_batch_tokens < 1000)
    num_tokens = sum(len(e.response_ids) for e in examples)
    for mb in cuts:
        trainer.student.micro_step(mb, num_tokens, trainer.beta)
    return {name: p.grad.detach().clone() for name, p in trainer.student.peft.named_parameters() if p.requires_grad}


def test_a_background_checkpoint_holds_the_weights_of_its_step_as_peft_writes_them(tiny_model, tmp_path):
    """The snapshot is taken when save() is called; training on meanwhile does not reach the files, which are
    what peft's save_pretrained writes (same adapter_config.json, same tensors)."""
    import torch
    from safetensors.torch import load_file

    from opd_train.config import TrainConfig
    from opd_train.trainer import Trainer

    config = TrainConfig(model=str(tiny_model), out=str(tmp_path / "run"), loss="sft", max_steps=2, batch_size=2,
                         lora_r=4, lora_alpha=8)
    trainer = Trainer(config, tmp_path / "run", device="cpu")
    (tmp_path / "run").mkdir()
    with torch.no_grad():
        for name, param in trainer.student.peft.named_parameters():
            if "lora_B" in name:
                param.normal_()
    trainer.student.peft.save_pretrained(str(tmp_path / "peft"))
    trainer.step = 1
    trainer.save(None)
    with torch.no_grad():  # the next step changes the live tensors while the files are written
        for param in trainer.student.params:
            param.add_(1.0)
    trainer.flush()
    ours, theirs = tmp_path / "run" / "checkpoint-000001", tmp_path / "peft"
    mine, peft = (json.loads((d / "adapter_config.json").read_text()) for d in (ours, theirs))
    assert set(mine.pop("target_modules")) == set(peft.pop("target_modules"))  # a set in peft: any order
    assert mine == peft
    a, b = load_file(ours / "adapter_model.safetensors"), load_file(theirs / "adapter_model.safetensors")
    assert sorted(a) == sorted(b)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    assert (tmp_path / "run" / "latest").read_text() == "checkpoint-000001\n"


# --------------------------------------------------------------------------- adapters and errors


def test_checkpoint_loads_with_peft_and_matches_the_trained_student(scored, tiny_model, tmp_path):
    run_dir = tmp_path / "run"
    ok(train(*base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "2", "--batch-size", "8", "--lr", "1e-2"),
             str(scored)))
    import torch
    from peft import PeftModel

    base = load_model(tiny_model)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        before = base(ids).logits
        tuned = PeftModel.from_pretrained(base, run_dir / "checkpoint-000002")
        after = tuned(ids).logits
    assert float((after - before).abs().max()) > 1e-3  # the adapter is not a no-op
    assert json.loads((run_dir / "checkpoint-000002" / "adapter_config.json").read_text())["r"] == 4


@pytest.mark.parametrize("args, expected", [
    (["--loss", "rkl", "--max-steps", "1"], "Error: give exactly one of --batch-groups (prompt groups per step) "
     "or --batch-size (records)\n"),
    (["--loss", "rkl", "--batch-size", "2"], "Error: --max-steps is required and must be >= 1, got None\n"),
    (["--loss", "sft", "--batch-size", "2", "--max-steps", "1", "--self-teacher", "opsd"],
     "Error: --self-teacher goes with --loss fkl (the full-vocabulary forward KL)\n"),
    (["--loss", "fkl", "--batch-size", "2", "--max-steps", "1", "--teacher", "nope"],
     "Error: record 1 of {path}: no teachers.nope block (the record has t); "
     "check --teacher or score the records with opd-score --teacher\n"),
])
def test_flag_and_record_errors(scored, tiny_model, tmp_path, args, expected):
    result = train("--model", str(tiny_model), "--out", str(tmp_path / "run"), *args, str(scored))
    assert error_of(result) == expected.format(path=scored.name)


def test_records_without_teacher_data_name_the_record(tiny_model, tmp_path):
    recs = ok(rollout(tiny_model, "-n", "1", "--max-tokens", "4", "--limit", "1", "aime24")).stdout_bytes
    path = tmp_path / "plain.jsonl"
    path.write_bytes(recs)
    result = train("--model", str(tiny_model), "--out", str(tmp_path / "run"), "--loss", "shift", "--batch-size", "1",
                   "--max-steps", "1", str(path))
    assert error_of(result) == (f"Error: record 1 of {path.name}: no shift block, which --loss shift reads; "
                                "score with opd-score --shift post=MODEL,pre=MODEL\n")


def test_metrics_stdout_and_stdin(scored, tiny_model, tmp_path):
    result = ok(train(*base_args(tiny_model, tmp_path / "run", "--loss", "sft", "--max-steps", "2", "--batch-size", "4",
                                 "--metrics-stdout"), input=scored.read_bytes()))
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["step"] for r in lines] == [1, 2]
    quiet = ok(train(*base_args(tiny_model, tmp_path / "run2", "--loss", "sft", "--max-steps", "1",
                                "--batch-size", "4"), input=scored.read_bytes()))
    assert quiet.stdout == ""


# --------------------------------------------------------------------------- accelerate launch (2 ranks on CPU)


def launch(tmp_path: Path, kind: str, *args: str, stdin: bytes = b"", **fsdp_config) -> subprocess.CompletedProcess:
    """accelerate launch --config_file (2 processes, a free port) -m opd_train.cli ARGS < stdin."""
    from opd_train.distributed import accelerate_config

    config = accelerate_config(kind, 2, **fsdp_config)
    path = tmp_path / f"accelerate-{kind}.yaml"
    path.write_text(json.dumps(config))  # YAML reads JSON
    launcher = Path(sys.executable).with_name("accelerate")
    done = subprocess.run([str(launcher), "launch", "--config_file", str(path), "-m", "opd_train.cli", *args],
                          capture_output=True, input=stdin, timeout=600)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(), done.stderr.decode())


def assert_same_run(one: Path, two: Path, kind: str) -> None:
    """Same metrics, same checkpoints, final adapters equal to float tolerance; `two` ran on 2 ranks (FSDP or not)."""
    rows_one, rows_two = metrics(one), metrics(two)
    assert len(rows_one) == len(rows_two)
    for a, b in zip(rows_one, rows_two, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-7), (a["step"], key)
    last = (one / "latest").read_text()
    assert (two / "latest").read_text() == last
    state = json.loads((two / last.strip() / "trainer_state.json").read_text())
    assert (state["world_size"], state["fsdp"]) == (2, kind == "fsdp")
    from safetensors.torch import load_file

    want, got = (load_file(str(run / last.strip() / "adapter_model.safetensors")) for run in (one, two))
    assert want.keys() == got.keys() and len(want) == 28  # 2 layers x 7 projections x (A, B)
    for key, w in want.items():
        assert float((w - got[key]).abs().max()) <= 1e-5, key  # weights ~0.1, steps of lr 1e-3


@pytest.mark.slow  # one process, then a launch of two that load torch: ~20 s on 2 cores
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_ranks_under_accelerate_launch_match_one_process(scored, tiny_model, tmp_path, kind):
    """accelerate launch, 2 processes (gloo), data parallel or FSDP2 (base weights sharded per layer): each rank
    trains on its share of each step's 5 records, gradients and metric contributions are summed, so the loss
    curve and the final adapter equal one process's with the same global batch. The 300-token micro-batches
    give the ranks 3 and 2 passes (FSDP: the second makes a third at weight 0, as every pass gathers weights).
    Data parallel reads stdin (rank 0 reads the pipe and sends the batches), FSDP a file."""
    args = [*base_args(tiny_model, None, "--loss", "shift", "--max-steps", "3", "--batch-size", "5",
                       "--save-every", "2", "--micro-batch-tokens", "300"), "--device", "cpu", "--quiet", "--out"]
    ok(train(*args, str(tmp_path / "one"), str(scored)))
    source, stdin = ("-", scored.read_bytes()) if kind == "ddp" else (str(scored), b"")
    done = launch(tmp_path, kind, *args, str(tmp_path / "two"), source, stdin=stdin)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(tmp_path / "one", tmp_path / "two", kind)
    from peft import PeftModel

    PeftModel.from_pretrained(load_model(tiny_model), tmp_path / "two" / "checkpoint-000003")  # a plain peft adapter


@pytest.mark.slow  # one process, then a launch of two, each compiling: ~45 s on 2 cores
def test_fsdp_with_compiled_layers_matches_one_process(scored, tiny_model, tmp_path):
    """--compile compiles each decoder layer in place (compile_decoder), and FSDP2 then shards those layers:
    its hooks run in the compiled layers, and the run still equals one compiled process's."""
    args = [*base_args(tiny_model, None, "--loss", "shift", "--max-steps", "3", "--batch-size", "5",
                       "--save-every", "2", "--micro-batch-tokens", "300"), "--device", "cpu", "--quiet", "--compile",
            "--out"]
    ok(train(*args, str(tmp_path / "one"), str(scored)))
    done = launch(tmp_path, "fsdp", *args, str(tmp_path / "two"), str(scored))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(tmp_path / "one", tmp_path / "two", "fsdp")


@pytest.mark.slow  # one process, then two launches of two: ~35 s on 2 cores
@pytest.mark.parametrize("kind", ["ddp", "fsdp"])
def test_two_ranks_resume_and_a_rank_without_records(scored, tiny_model, tmp_path, kind):
    """One record per step, so rank 1 never has one (it reports zeros, and under FSDP makes rank 0's passes
    at weight 0); the input ends after 2 of 4 steps, --resume on 2 ranks reads on from the checkpoint
    (optimizer, schedule): the 4 steps and the final adapter equal one uninterrupted process's."""
    lines = scored.read_bytes().splitlines(keepends=True)
    first, rest = tmp_path / "first.jsonl", tmp_path / "rest.jsonl"
    first.write_bytes(b"".join(lines[:2]))
    rest.write_bytes(b"".join(lines[2:]))
    args = [*base_args(tiny_model, None, "--loss", "rkl", "--max-steps", "4", "--batch-size", "1", "--save-every", "1",
                       "--lr-schedule", "cosine", "--warmup-steps", "1", "--allow-short"), "--device", "cpu", "--quiet"]
    ok(train(*args, "--out", str(tmp_path / "one"), str(scored)))
    done = launch(tmp_path, kind, *args, "--out", str(tmp_path / "two"), str(first))
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "two" / "latest").read_text() == "checkpoint-000002\n"
    done = launch(tmp_path, kind, *args, "--out", str(tmp_path / "two"), "--resume", str(first), str(rest))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_same_run(tmp_path / "one", tmp_path / "two", kind)


@pytest.mark.slow  # a launch of two processes that stop before loading the model: ~7 s
@pytest.mark.parametrize("setting, expected", [
    ({"fsdp_version": 1}, "opd-train supports FSDP2 only, but the accelerate config has fsdp_version 1; set "
                          "fsdp_version: 2 in it (or pass --fsdp_version 2 to accelerate launch)"),
    ({"fsdp_offload_params": True}, "the accelerate config sets fsdp_offload_params: true, which opd-train does not "
                                    "support (only the LoRA weights train, and opd-train keeps them and their "
                                    "optimizer state on the device); set it to false"),
])
def test_fsdp_settings_it_cannot_honour_fail_before_the_run_dir(scored, tiny_model, tmp_path, setting, expected):
    run_dir = tmp_path / "run"
    done = launch(tmp_path, "fsdp", *base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "1",
                                               "--batch-size", "2"),
                  "--device", "cpu", "--quiet", str(scored), **setting)
    assert done.returncode != 0
    assert f"Error: {expected}\n" in done.stderr, done.stderr[-3000:]  # (the launcher may stop the other rank first)
    assert not run_dir.exists()


def test_publish_each_checkpoint_as_it_is_saved_and_stop_when_it_fails(scored, tiny_model, tmp_path):
    mirror = tmp_path / "mirror"
    run_dir = tmp_path / "run"
    ok(train(*base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "2", "--batch-size", "4",
                        "--save-every", "1", "--publish", f"file://{mirror}"), str(scored)))
    index = json.loads((mirror / "checkpoint_index.json").read_text())
    assert sorted(c["step"] for c in index["checkpoints"]) == [1, 2]
    assert adapter_bytes(mirror / "checkpoint-000002") == adapter_bytes(run_dir / "checkpoint-000002")

    blocked = tmp_path / "not-a-dir"
    blocked.write_text("a file where the mirror should be\n")
    failing = tmp_path / "failing"
    result = train(*base_args(tiny_model, failing, "--loss", "sft", "--max-steps", "2", "--batch-size", "4",
                              "--save-every", "1", "--publish", f"file://{blocked}"), str(scored))
    message = error_of(result)
    assert message.startswith(f"Error: --publish file://{blocked}: checkpoint-000001 was saved locally but not "
                              "published, so the run stops: "), message
    assert message.endswith(f"`opd-publish push {failing} --repo file://{blocked}` and --resume\n"), message
    assert [r["step"] for r in metrics(failing)] == [1]  # stopped at the first checkpoint
    assert (failing / "latest").read_text() == "checkpoint-000001\n"


# --------------------------------------------------------------------------- grpo / dapo


def with_rewards(scored: Path, out: Path, correct_by_group: dict[int, list[int]]) -> Path:
    """The scored records with a reward block: group g's samples get correct_by_group[g] (reward = correct)."""
    groups: list[str] = []
    lines = []
    for line in scored.read_bytes().splitlines():
        rec = json.loads(line)
        if rec["prompt_id"] not in groups:
            groups.append(rec["prompt_id"])
        c = correct_by_group[groups.index(rec["prompt_id"])][rec["sample"]]
        rec["reward"] = {"correct": c, "format_ok": True, "stop_ok": True, "length_penalty": 0.0, "total": float(c),
                         "verifier": "math", "extracted": "1", "reason": "match" if c else "mismatch"}
        lines.append(json.dumps(rec))
    out.write_text("\n".join(lines) + "\n")
    return out


MIXED = {0: [1, 0], 1: [0, 0], 2: [1, 1], 3: [0, 1], 4: [1, 0], 5: [0, 0], 6: [1, 0], 7: [0, 1]}


def test_dapo_drops_uniform_groups_and_its_first_step_is_the_hand_computed_surrogate(scored, tiny_model, tmp_path):
    """Groups 1, 2 (all wrong / all right) and 5 are dropped and counted; on the first step the ratio is 1
    (records sampled by this model), so the loss is -sum_i A_i T_i / sum_i T_i with A = +-1/sqrt(2)/(1+1e-6)."""
    path = with_rewards(scored, tmp_path / "rewarded.jsonl", MIXED)
    run_dir = tmp_path / "run"
    ok(train(*base_args(tiny_model, run_dir, "--loss", "dapo", "--max-steps", "2", "--batch-groups", "2"), str(path)))
    rows = metrics(run_dir)
    assert [(r["groups_read"], r["groups_dropped"], r["records"]) for r in rows] == [(4, 2, 4), (3, 1, 4)]
    assert {"pg", "ratio", "clip_frac", "dual_clip_frac", "advantage"} <= set(rows[0])
    from opd_common.streams import iter_inputs

    recs = [rec for rec, _ in iter_inputs([str(path)])]  # decoded (response_ids may be packed in the file)
    first = [r for r in recs if r["prompt_id"] in {recs[0]["prompt_id"], recs[6]["prompt_id"]}]
    a = 1 / np.sqrt(2) / (1 + 1e-6)
    expected = -sum((a if r["reward"]["correct"] else -a) * len(r["response_ids"]) for r in first) / sum(
        len(r["response_ids"]) for r in first)
    assert rows[0]["loss"] == pytest.approx(expected, abs=1e-4)
    assert rows[0]["ratio"] == pytest.approx(1.0, abs=1e-4) and rows[0]["clip_frac"] == 0


def cut_responses(path: Path, out: Path, lengths: dict[int, int]) -> Path:
    """The records with response i (file order) cut to lengths[i] tokens, logprobs with it (the teacher, shift and
    top-k blocks dropped: grpo reads none of them)."""
    from opd_common.streams import encode, iter_inputs

    recs = []
    for i, (rec, _) in enumerate(iter_inputs([str(path)])):
        rec = {k: v for k, v in rec.items() if k not in ("teachers", "shift", "topk_ids", "topk_logprobs")}
        t = lengths.get(i, len(rec["response_ids"]))
        rec["response_ids"], rec["logprobs"] = rec["response_ids"][:t], rec["logprobs"][:t]
        recs.append(rec)
    out.write_bytes(b"".join(encode(r) for r in recs))
    return out


def test_grpo_response_mean_first_step_and_micro_batch_cut(scored, tiny_model, tmp_path):
    """--aggregation response-mean on 4 groups whose responses have different lengths. On the first step the ratio
    is 1, so the loss is -(1/B) sum_i A_i = 0 (advantages are centred in each group), where token-mean's is
    -sum_i A_i T_i / sum_i T_i != 0; and cutting the step into micro-batches and LM-head chunks changes nothing."""
    path = cut_responses(with_rewards(scored, tmp_path / "rewarded.jsonl", MIXED), tmp_path / "cut.jsonl",
                         {0: 3, 3: 2, 6: 4, 7: 9})
    rows = {}
    for name, extra in {"token": ["--aggregation", "token-mean"],
                        "one": ["--aggregation", "response-mean", "--micro-batch-tokens", "100000"],
                        "cut": ["--aggregation", "response-mean", "--micro-batch-tokens", "300", "--logit-chunk", "5"]
                        }.items():
        ok(train(*base_args(tiny_model, tmp_path / name, "--loss", "grpo", "--max-steps", "1", "--batch-groups", "4",
                            *extra), str(path)))
        rows[name] = metrics(tmp_path / name)[0]
    from opd_common.streams import iter_inputs

    recs = [rec for rec, _ in iter_inputs([str(path)])][:8]  # the first 4 groups, 2 samples each
    a = 1 / np.sqrt(2) / (1 + 1e-6)
    adv = [0.0 if len({r["reward"]["correct"] for r in recs if r["prompt_id"] == rec["prompt_id"]}) == 1
           else (a if rec["reward"]["correct"] else -a) for rec in recs]
    lengths = [len(r["response_ids"]) for r in recs]
    token_mean = -sum(x * t for x, t in zip(adv, lengths, strict=True)) / sum(lengths)
    assert abs(token_mean) > 0.05 and rows["token"]["loss"] == pytest.approx(token_mean, abs=1e-4)
    assert rows["one"]["loss"] == pytest.approx(0.0, abs=1e-5)
    assert rows["one"]["ratio"] == pytest.approx(1.0, abs=1e-4) and rows["one"]["grad_norm"] > 0
    assert rows["one"].keys() == rows["cut"].keys()
    for key in rows["one"]:
        assert rows["one"][key] == pytest.approx(rows["cut"][key], rel=1e-5, abs=1e-7), key
    assert rows["one"]["grad_norm"] != pytest.approx(rows["token"]["grad_norm"], rel=1e-3)


def test_dynamic_sampling_bound_fails_the_step_cleanly(scored, tiny_model, tmp_path):
    path = with_rewards(scored, tmp_path / "uniform.jsonl", {g: [1, 1] for g in range(8)})
    result = train(*base_args(tiny_model, tmp_path / "run", "--loss", "dapo", "--max-steps", "1", "--batch-groups", "2",
                              "--max-candidate-batches", "2"), str(path))
    assert error_of(result) == (
        "Error: dynamic sampling dropped 4 complete groups (all correct or all wrong) without filling this step's 2 "
        "(--max-candidate-batches 2); the step is not trained. Sample prompts of mixed difficulty or more samples "
        "per group, or raise the bound, then --resume\n")
    assert not (tmp_path / "run" / "metrics.jsonl").read_text()


def test_grpo_needs_groups_and_rewards(scored, tiny_model, tmp_path):
    assert error_of(train(*base_args(tiny_model, tmp_path / "a", "--loss", "grpo", "--max-steps", "1",
                                     "--batch-size", "2"), str(scored))) == (
        "Error: --loss grpo needs --batch-groups (advantages are normalized within groups)\n")
    assert error_of(train(*base_args(tiny_model, tmp_path / "b", "--loss", "grpo", "--max-steps", "1",
                                     "--batch-groups", "1"), str(scored))) == (
        f"Error: record 1 of {scored.name}: no reward.total, which --loss grpo reads; "
        "score with opd-score --reward math\n")


@pytest.mark.parametrize("batching", [["--batch-size", "4"], ["--batch-groups", "2"]])
def test_max_staleness_drops_records_of_old_policies(scored, tiny_model, tmp_path, batching):
    """Records 1-4 come from version 0, 5-8 from version 0 too (stale for step 2 with S = 0), 9-12 from version 1."""
    lines = []
    for i, line in enumerate(scored.read_bytes().splitlines()[:12]):
        rec = json.loads(line)
        rec["policy"]["version"] = 0 if i < 8 else 1
        lines.append(json.dumps(rec))
    path = tmp_path / "versions.jsonl"
    path.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    ok(train(*base_args(tiny_model, run_dir, "--loss", "sft", "--max-steps", "2", "--max-staleness", "0", *batching),
             str(path)))
    rows = metrics(run_dir)
    assert [(r["records"], r["records_read"], r["records_stale"]) for r in rows] == [(4, 4, 0), (4, 12, 4)]
