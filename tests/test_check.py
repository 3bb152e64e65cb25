"""opd-check: each planted mismatch is a FAIL that names it; a consistent run (vLLM, with an adapter) passes;
the pure pieces (template diff, vocabulary diff, the top-k KL) against references computed here."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
from click.testing import CliRunner
from opd_check.checks_train import bucket_kl, full_kl
from opd_check.cli import command
from opd_check.tokenizers import compare_vocab, first_template_difference
from test_rollout import make_lora_adapter

FAST = ["--max-tokens", "16", "--limit", "2", "-n", "2", "--quiet"]


def opd_check(*args: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, "-m", "opd_check.cli", *args, "--json"], capture_output=True, text=True,
                         timeout=900)
    assert out.stdout.strip(), out.stderr[-3000:]
    report = json.loads(out.stdout)
    return out.returncode, {c["check"]: c for c in report["checks"]}


@pytest.fixture(scope="module")
def planted(tiny_model, tiny_teacher, tmp_path_factory):
    """A teacher with another vocabulary, one with another chat template, an adapter whose keys name no module."""
    from safetensors.numpy import load_file, save_file

    from opd_common.tiny import build_tiny

    tmp = tmp_path_factory.mktemp("planted")
    other_vocab = build_tiny(tmp / "digits", seed=1, split_digits=True)
    other_template = shutil.copytree(tiny_teacher, tmp / "template")
    jinja = other_template / "chat_template.jinja"
    jinja.write_text(jinja.read_text().replace("<|im_start|>assistant", "<|im_start|>bot"))
    adapter = make_lora_adapter(tiny_model, tmp / "adapter")
    renamed = shutil.copytree(adapter, tmp / "renamed")
    weights = load_file(renamed / "adapter_model.safetensors")
    save_file({k.replace(".layers.", ".blocks."): v for k, v in weights.items()},
              renamed / "adapter_model.safetensors")
    return {"vocab": other_vocab, "template": other_template, "adapter": adapter, "renamed": renamed}


@pytest.mark.slow
def test_each_planted_mismatch_fails_by_name(tiny_model, planted):
    code, checks = opd_check("--model", str(tiny_model), "--engine", "hf", "--adapter", str(planted["renamed"]),
                             "--teacher", f"a={planted['vocab']}", "--teacher", f"b={planted['template']}",
                             "--loss", "rkl", "--align", "ids", "--temperature", "0.7", "--grader", "integer", *FAST,
                             "math500")
    assert code == 1
    tok = checks["tokenizers"]
    assert tok["status"] == "FAIL"
    assert f"--teacher a={planted['vocab']}: vocab 2048 vs 2048, first id read differently: id " in tok["figure"]
    assert f"--teacher b={planted['template']}: chat templates differ at line 1, column " in tok["figure"]
    assert "<|im_start|>bot" in tok["figure"] and "<|im_start|>assistant" in tok["figure"]
    assert checks["rendering"]["status"] == "FAIL" and "reads the student's response ids as other text" in \
        checks["rendering"]["figure"]
    adapter = checks["adapter"]
    assert adapter["status"] == "FAIL" and "28 of the LoRA tensors" in adapter["figure"]
    assert "base_model.model.model.blocks.0." in adapter["figure"] and "not loaded" in adapter["figure"]
    logprobs = checks["logprobs"]
    assert logprobs["status"] == "FAIL" and "--temperature 0.7" in logprobs["figure"]
    assert logprobs["values"]["mean_abs_diff"] < 1e-4  # the engine itself agrees with the trainer
    assert checks["stops"]["status"] == "FAIL" and "--grader integer" in checks["stops"]["figure"]
    assert checks["self"]["status"] == "PASS"


@pytest.mark.slow
@pytest.mark.vllm
def test_a_consistent_run_through_vllm_with_an_adapter_passes(tiny_model, tiny_teacher, planted):
    code, checks = opd_check("--model", str(tiny_model), "--engine", "vllm", "--adapter", str(planted["adapter"]),
                             "--teacher", f"t={tiny_teacher}", "--loss", "fkl", "--topk", "16", "--grader",
                             "integer", "--max-tokens", "48", "--limit", "2", "-n", "2", "--quiet", "aime24")
    assert code == 0, {name: (c["status"], c["figure"]) for name, c in checks.items() if c["status"] != "PASS"}
    assert {name: c["status"] for name, c in checks.items()} == {
        "tokenizers": "PASS", "rendering": "PASS", "logprobs": "PASS", "adapter": "PASS", "self": "PASS",
        "topk": checks["topk"]["status"], "stops": checks["stops"]["status"]}
    assert checks["topk"]["status"] in ("PASS", "WARN") and checks["stops"]["status"] in ("PASS", "WARN")
    adapter = checks["adapter"]["values"]
    assert adapter["engine_vs_peft"] < 1e-4 < 0.1 < adapter["engine_vs_base"]  # vLLM sampled with the adapter
    assert checks["self"]["values"]["loss"] < 1e-5 and checks["self"]["values"]["grad_norm"] < 1e-4
    topk = checks["topk"]["values"]
    assert 0 < topk["tail_mass"] < 1 and topk["suggested_k"] in (8, 16, 32, 64, 128, 256, 512)


@pytest.mark.slow
def test_a_teacher_with_another_tokenizer_is_checked_over_the_text(tiny_model, planted):
    """--align auto (opd-score's default): the digit-splitting teacher is scored over the response text. The
    random tiny student's samples are byte soup, not UTF-8, so opd-score would refuse every one: a FAIL that
    says so. The prompt shown is the one that teacher reads: the student's, as text."""
    code, checks = opd_check("--model", str(tiny_model), "--engine", "hf", "--teacher", f"x={planted['vocab']}",
                             "--loss", "rkl", *FAST, "aime24")
    tok = checks["tokenizers"]
    assert code == 1 and tok["status"] == "FAIL", tok
    assert f"--teacher x={planted['vocab']}: another tokenizer, scored over the response text: 0 samples aligned, " \
           "0 partial, 4 refused" in tok["figure"] and "not valid UTF-8" in tok["figure"]
    shown = [d for d in checks["rendering"]["details"] if d.startswith(f"--teacher x={planted['vocab']} prompt")]
    assert shown and "Problem: Every morning Aya" in shown[0]  # the student's prompt as text, not its ids
    assert checks["rendering"]["status"] == "PASS"  # such a teacher does not read the student's ids


def test_text_samples_align_with_a_teacher_with_another_tokenizer(tiny_model, planted):
    from types import SimpleNamespace

    from opd_check.checks import check_text_teacher

    from opd_common.models import load_tokenizer

    student, teacher = load_tokenizer(str(tiny_model)), load_tokenizer(str(planted["vocab"]))
    texts = ["The answer is $\\boxed{1234}$.", "  two  spaces, 3.14 and é"]
    samples = [{"response_ids": np.asarray(student(t, add_special_tokens=False)["input_ids"] + [student.eos_token_id]),
                "finish_reason": "stop"} for t in texts]
    ctx = SimpleNamespace(config=SimpleNamespace(loss="rkl"), samples=lambda: samples,
                          student_tokenizer=lambda: student, same_vocab=lambda label: False)
    result = check_text_teacher(ctx, "--teacher x=X", teacher)
    assert result.status == "PASS", result
    assert result.values == {"aligned": 2, "partial": 0, "refused": 0, "tokens": sum(len(s["response_ids"])
                             for s in samples), "tokens_in_chunks": sum(len(s["response_ids"]) for s in samples)}
    ctx.config.loss = "fkl"
    result = check_text_teacher(ctx, "--teacher x=X", teacher)
    assert result.status == "FAIL" and "--loss fkl reads the teacher at the student's token ids" in result.figure
    assert result.fix.startswith("use --loss rkl or uld (aligned chunks)")


def test_template_difference_names_line_and_column():
    assert first_template_difference("a\nhello world", "a\nhello there") == \
        "line 2, column 7: 'hello world' vs 'hello there'"
    assert first_template_difference("a", "a\nb") == "line 2: one template ends there (1 vs 2 lines)"
    assert first_template_difference("same", "same") is None


def test_vocabulary_difference_finds_the_first_id_read_differently():
    class Tok:
        def __init__(self, vocab):
            self.vocab = vocab

        def get_vocab(self):
            return self.vocab

    student = Tok({"a": 0, "b": 1, "c": 2})
    assert compare_vocab(student, Tok({"a": 0, "b": 1, "c": 2, "d": 3})) == (None, 0, 1)
    assert compare_vocab(student, Tok({"a": 0, "c": 1, "b": 2})) == ("id 1: 'b' vs 'c'", 0, 0)


@pytest.mark.parametrize("tau", [0.7, 1.0, 1.5])
def test_the_top_k_kl_is_zero_at_identity_and_exact_when_only_one_id_is_left_out(tau):
    import torch

    gen = torch.Generator().manual_seed(0)
    t = torch.log_softmax(torch.randn(50, generator=gen) * 2, -1)
    s = torch.log_softmax(torch.randn(50, generator=gen) * 2, -1)
    assert abs(bucket_kl(t, t, 8, tau)) < 1e-6
    p, q = (np.exp(x.double().numpy() / tau) / np.exp(x.double().numpy() / tau).sum() for x in (t, s))
    reference = float((p * np.log(p / q)).sum())  # KL over the whole vocabulary, written out
    assert full_kl(t, s, tau) == pytest.approx(reference, rel=1e-4)
    assert bucket_kl(t, s, 49, tau) == pytest.approx(reference, rel=1e-4)  # the tail bucket is one id
    if tau == 1:  # at tau != 1 the tempered buckets are a divergence of their own (docs/losses.md)
        assert bucket_kl(t, s, 8, tau) < reference  # merging ids into a bucket can only lower a KL


def test_the_top_k_kl_of_a_peaked_teacher_is_finite():
    """A teacher whose top-k holds all but 1e-17 of its mass (the demo's teacher): 1 - head rounds to 0 in
    floating point, the tail summed over its ids does not."""
    import torch

    t = torch.full((100,), -40.0, dtype=torch.float64)
    t[0] = 0.0
    t = torch.log_softmax(t, -1)
    s = torch.log_softmax(torch.randn(100, generator=torch.Generator().manual_seed(1), dtype=torch.float64), -1)
    assert bucket_kl(t, s, 16, 1.0) == pytest.approx(full_kl(t, s, 1.0), rel=1e-9)
    assert np.isfinite(bucket_kl(t, s, 16, 1.1)) and bucket_kl(t, t, 16, 1.1) == 0


def test_config_errors_name_the_flag(tiny_model):
    result = CliRunner().invoke(command, ["--model", str(tiny_model), "--loss", "rkl"])
    assert result.exit_code == 1
    assert result.output.strip().endswith("--loss rkl learns from a teacher: give --teacher NAME=MODEL (as "
                                          "opd-score) or --self-teacher TEMPLATE (fkl)")
    result = CliRunner().invoke(command, ["--model", str(tiny_model), "--loss", "sft", "--limit", "0"])
    assert result.exit_code == 1 and "--limit must be >= 1, got 0" in result.output


def test_a_vocabulary_with_extra_ids_fails_as_opd_score_refuses_it():
    """The 1,024-id BPE's ids are the first 1,024 of the 2,048-id one: shared ids agree, but opd-score scores ids
    only with the whole vocabulary, so the preflight must not pass it."""
    from opd_check.tokenizers import check_pair

    from opd_common.tiny import build_tokenizer

    big, small = build_tokenizer(split_digits=True), build_tokenizer(vocab_size=1024, split_digits=True)
    result = check_pair("--teacher t=T", big, small, as_is=True)
    assert result.status == "FAIL" and "shared ids agree; 1024 ids only the student has, 0 only the teacher" in \
        result.figure
    assert "use --align auto" in result.fix
    assert check_pair("--shift post=P", big, big, as_is=True).status == "PASS"


def test_a_tokenizer_without_a_chat_template_has_no_prefix():
    from opd_check.tokenizers import generation_prefix

    from opd_common.tiny import build_tokenizer

    tok = build_tokenizer(vocab_size=512)
    tok.chat_template = None
    assert generation_prefix(tok, True) is None


def test_a_check_that_crashes_or_lacks_samples_is_a_line_not_a_traceback(monkeypatch):
    from opd_check import run

    def crash(ctx):
        raise ValueError("boom")

    def needs_samples(ctx):
        raise run.NoSamples("opd-rollout exited with 1: --model M: cannot load it")

    monkeypatch.setattr(run, "checks", lambda: [("a", crash), ("b", needs_samples), ("c", needs_samples)])
    results = run.run_checks(object())
    assert [(r.check, r.status) for r in results] == [("a", "FAIL"), ("rollout", "FAIL"), ("b", "SKIP"),
                                                      ("c", "SKIP")]
    assert results[0].figure == "the check crashed: ValueError: boom"
    assert results[1].figure == "opd-rollout exited with 1: --model M: cannot load it"
