"""Cross-tokenizer alignment (opd_common.xtok) and the chunk objectives (losses.chunk_advantages, losses.uld).

Alignment is checked on hand-made byte pieces (expected chunks written out by hand), on the two tokenizers
of opd_common.tiny (digit-splitting and plain BPE, plus a 1,024-id BPE) against an independent brute-force
reference that decodes every prefix with the tokenizers themselves, and on the cases that must not align
silently (normalizers, invalid UTF-8, a cut mid-character). The objectives are checked against loops
written from docs/losses.md's equations."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opd_common.xtok import Aligner, align_pieces, chunk_sums, token_bytes
from opd_train import losses as L


@pytest.fixture(scope="module")
def toks():
    from opd_common.tiny import build_tokenizer

    return {"digits": build_tokenizer(split_digits=True), "plain": build_tokenizer(),
            "small": build_tokenizer(vocab_size=1024, split_digits=True)}


# --------------------------------------------------------------------------- pure alignment


def test_align_pieces_hand_made():
    # "12345" as 1|2|3|4|5 vs 12|3|45: boundaries both have at bytes 2, 3, 5
    s, t, b = align_pieces([b"1", b"2", b"3", b"4", b"5"], [b"12", b"3", b"45"])
    assert (s.tolist(), t.tolist(), b.tolist()) == ([2, 3, 5], [1, 2, 3], [2, 3, 5])
    # whitespace runs: "a   b" as a|' '|'  b' (ends 1, 2, 5) vs 'a '|'  '|b (ends 2, 4, 5): shared 2 and 5
    s, t, b = align_pieces([b"a", b" ", b"  b"], [b"a ", b"  ", b"b"])
    assert (s.tolist(), t.tolist(), b.tolist()) == ([2, 3], [1, 3], [2, 5])
    s, t, b = align_pieces([b"a ", b"   ", b"b"], [b"a", b"    b"])  # ends 2, 5, 6 vs 1, 6: only the end
    assert (s.tolist(), t.tolist(), b.tolist()) == ([3], [2], [6])
    # 'é' (2 bytes) split as bytes on both sides: the byte boundary inside it is shared too
    s, t, b = align_pieces([b"caf", b"\xc3", b"\xa9"], [b"ca", b"f\xc3", b"\xa9"])
    assert (s.tolist(), t.tolist(), b.tolist()) == ([2, 3], [2, 3], [4, 5])
    # a zero-byte token joins the chunk it ends
    s, t, b = align_pieces([b"x", b"", b"y"], [b"xy"])
    assert (s.tolist(), t.tolist(), b.tolist()) == ([3], [1], [2])


def test_chunk_sums_against_a_loop():
    rng = np.random.default_rng(0)
    values = rng.normal(size=20).astype(np.float32)
    ends = np.array([1, 4, 5, 11, 17])
    want = [float(np.sum(values[a:b], dtype=np.float64)) for a, b in zip([0, 1, 4, 5, 11], ends, strict=True)]
    assert np.allclose(chunk_sums(values, ends), want, atol=1e-6)
    assert chunk_sums(values[:3], np.array([1, 2, 3])).tolist() == values[:3].tolist()  # one-token chunks: exact


# --------------------------------------------------------------------------- the tiny tokenizers


def _brute_force(tok_s, ids_s, tok_t, ids_t) -> list[tuple[int, int]]:
    """Shared boundaries from prefix decodes (GOLD's way, O(T^2)): (student count, teacher count) pairs where
    the decoded prefixes are the same text."""
    def prefixes(tok, ids):
        return {tok.decode(ids[:i + 1], clean_up_tokenization_spaces=False): i + 1 for i in range(len(ids))}
    ps, pt = prefixes(tok_s, ids_s), prefixes(tok_t, ids_t)
    return sorted((ps[text], pt[text]) for text in ps.keys() & pt.keys() if "\ufffd" not in text)


def _chunks(al):
    starts = [0, *al.char_end.tolist()[:-1]]
    return [al.text[a:b] for a, b in zip(starts, al.char_end.tolist(), strict=True)]


@pytest.mark.parametrize("text", ["12345 + 678 = 13023", "a   b\n\n  c\t\td  ", "café ∑ x² 😀 naïve",
                                  "\\boxed{432}", "  leading spaces and 3.14159"])
@pytest.mark.parametrize("teacher", ["plain", "small"])
def test_aligner_on_tiny_tokenizers_matches_brute_force(toks, text, teacher):
    s, t = toks["digits"], toks[teacher]
    ids = s(text, add_special_tokens=False)["input_ids"] + [s.eos_token_id]
    al = Aligner(s, t, "--teacher t")(ids)
    assert al.status == "ok" and al.text == text
    t_ids = al.teacher_ids.tolist()
    assert t_ids == t(text, add_special_tokens=False)["input_ids"] + [t.eos_token_id]
    # every chunk spells the same text from both sides' tokens, and the chunks tile the text
    s0 = t0 = 0
    for s1, t1, piece in zip(al.student_end.tolist(), al.teacher_end.tolist(), _chunks(al), strict=True):
        assert s.decode(ids[s0:s1]) == t.decode(t_ids[t0:t1]) or (s1 == len(ids) and piece == "")
        s0, t0 = s1, t1
    assert "".join(_chunks(al)) == text and (s0, t0) == (len(ids), len(t_ids))
    body = list(zip(al.student_end.tolist()[:-1], al.teacher_end.tolist()[:-1], strict=True))  # without the EOS
    whole_chars = [(a, b) for a, b in body]
    assert [p for p in whole_chars if "\ufffd" not in s.decode(ids[:p[0]])] == _brute_force(s, ids[:-1], t,
                                                                                              t_ids[:-1])


def test_numbers_split_by_one_tokenizer_and_merged_by_the_other(toks):
    """Hand-checked: the digit tokenizer has one token per digit; the plain BPE merges '12', '45', '30', '23'
    (as convert_ids_to_tokens shows), so those digit pairs are two-token chunks on the student's side."""
    s, t = toks["digits"], toks["plain"]
    text = "12345 + 678 = 13023"
    ids = s(text, add_special_tokens=False)["input_ids"] + [s.eos_token_id]
    al = Aligner(s, t, "--teacher t")(ids)
    assert t.convert_ids_to_tokens(al.teacher_ids.tolist()) == [
        "12", "3", "45", "Ġ+", "Ġ6", "7", "8", "Ġ=", "Ġ1", "30", "23", "<|im_end|>"]
    assert _chunks(al) == ["12", "3", "45", " +", " 6", "7", "8", " =", " 1", "30", "23", ""]
    assert np.diff([0, *al.student_end.tolist()]).tolist() == [2, 1, 2, 1, 2, 1, 1, 1, 2, 2, 2, 1]


def test_a_response_stopped_by_another_stop_token_pairs_it_with_the_teachers_eos(toks):
    """The engine stops on every EOS id of the model's generation config (Qwen: <|im_end|> and <|endoftext|>);
    a record that stopped on one that is not the tokenizer's eos_token still ends with one EOS chunk."""
    s, t = toks["digits"], toks["plain"]
    other_stop = s.convert_tokens_to_ids("<|endoftext|>")
    assert other_stop != s.eos_token_id
    ids = s("12 + 3", add_special_tokens=False)["input_ids"] + [other_stop]
    for same in (False, True):
        al = Aligner(s, s if same else t, "--teacher t", same_vocab=same)(ids, stopped=True)
        assert al.text == "12 + 3" and al.status == "ok", (same, al.text)
        assert int(al.student_end[-1]) == len(ids) and int(al.student_end[-2]) == len(ids) - 1
        assert al.teacher_ids[-1] == (other_stop if same else t.eos_token_id)
    literal = Aligner(s, t, "--teacher t")(ids)  # without `stopped`: only the tokenizer's EOS is read as a stop
    assert literal.text.endswith("<|endoftext|>")


def test_a_teacher_that_opens_every_text_with_bos_reads_its_prompt_with_it(toks):
    from opd_common.xtok import teacher_prompt_ids

    s, t = toks["digits"], toks["plain"]
    rec = {"prompt_ids": np.asarray(s("What is 2+2?", add_special_tokens=False)["input_ids"])}
    plain = teacher_prompt_ids(rec, s, t).tolist()
    assert plain == t("What is 2+2?", add_special_tokens=False)["input_ids"]  # no BOS in this tokenizer

    class WithBos:  # a Llama-style tokenizer: add_special_tokens (its default) puts BOS first
        bos_token_id = 7

        def __call__(self, text, add_special_tokens=True):
            ids = t(text, add_special_tokens=False)["input_ids"]
            return {"input_ids": [7, *ids] if add_special_tokens else ids}

    assert teacher_prompt_ids(rec, s, WithBos()).tolist() == [7, *plain]


def test_same_vocab_keeps_the_student_ids_one_chunk_per_token(toks):
    s = toks["digits"]
    ids = s("x = 😀 12", add_special_tokens=False)["input_ids"] + [s.eos_token_id]
    al = Aligner(s, s, "--teacher t", same_vocab=True)(ids)
    assert al.teacher_ids.tolist() == ids and al.student_end.tolist() == list(range(1, len(ids) + 1))
    assert al.teacher_end.tolist() == al.student_end.tolist() and al.status == "ok"
    assert al.text == "x = 😀 12" and "".join(_chunks(al)) == al.text and al.char_end[-1] == len(al.text)


def test_cut_mid_character_is_partial_and_invalid_bytes_are_refused(toks):
    s, t = toks["digits"], toks["plain"]
    ids = s("ab 😀", add_special_tokens=False)["input_ids"]
    emoji = len(s("ab ", add_special_tokens=False)["input_ids"])
    al = Aligner(s, t, "--teacher t")(ids[:emoji + 2])  # max_tokens cut the emoji's 4 byte tokens after 2
    assert al.status == "partial" and al.text == "ab " and int(al.student_end[-1]) == emoji
    assert al.reason == "2 trailing student tokens are in no chunk"
    lone = s.convert_tokens_to_ids("Ã")  # a lead byte followed by a digit: invalid UTF-8 mid-response
    al = Aligner(s, t, "--teacher t")([lone] + s("5", add_special_tokens=False)["input_ids"])
    assert al.status == "refused" and al.reason == "the student's tokens are not valid UTF-8 at byte 0"
    assert len(al.student_end) == 0 and len(al.teacher_ids) == 0


def test_a_normalizer_that_changes_the_text_refuses_the_record(toks):
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast

    lower = PreTrainedTokenizerFast(tokenizer_object=toks["plain"].backend_tokenizer.__class__.from_str(
        toks["plain"].backend_tokenizer.to_str()), eos_token="<|im_end|>")
    lower.backend_tokenizer.normalizer = normalizers.Lowercase()
    s = toks["digits"]
    al = Aligner(s, lower, "--teacher t")(s("Sum IS 7", add_special_tokens=False)["input_ids"])
    assert al.status == "refused" and al.reason.startswith(
        "the teacher's tokenizer does not reproduce the text (normalizer or unknown bytes): the bytes differ from "
        "byte 0 (b'Sum IS 7' vs b'sum is 7')")
    assert Aligner(s, lower, "--teacher t")(s("sum is 7", add_special_tokens=False)["input_ids"]).status == "ok"


def test_sentencepiece_style_tokenizer_and_its_dummy_prefix(toks):
    """A Metaspace BPE (Llama-2/Mistral style: '▁' for spaces, byte fallback, a prefix space added to the text):
    its added leading space is not the student's, every other byte must match."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Metaspace(prepend_scheme="always"), decoders.ByteFallback()])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "</s>"] + [f"<0x{b:02X}>" for b in
                                                                                    range(256)], show_progress=False)
    tok.train_from_iterator(["the sum of 12 and 30 is 42", "café ∑ naïve"] * 20, trainer=trainer)
    sp = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>")
    assert token_bytes(sp, "--teacher t")[sp.convert_tokens_to_ids("<0xE2>")] == b"\xe2"
    s = toks["digits"]
    for text in ["the sum of 12 and 30 is 42", "café ∑ 😀"]:
        ids = s(text, add_special_tokens=False)["input_ids"] + [s.eos_token_id]
        al = Aligner(s, sp, "--teacher t")(ids)
        assert al.status == "ok" and "".join(_chunks(al)) == text
        assert al.teacher_ids[-1] == sp.eos_token_id and al.student_end[-1] == len(ids)


# --------------------------------------------------------------------------- the chunk objectives


def _reference_chunk_advantages(teacher_C, behaviour_T, ends, discount):
    r = [0.0] * len(behaviour_T)
    start = 0
    for c, end in enumerate(ends):
        r_c = float(teacher_C[c]) - sum(float(b) for b in behaviour_T[start:end])
        for t in range(start, end):
            r[t] = r_c / (end - start)
        start = end
    return [sum(discount ** (s - t) * r[s] for s in range(t, len(r))) for t in range(len(r))]


@pytest.mark.parametrize("discount", [0.0, 0.9])
def test_chunk_advantages_against_the_equation(discount):
    gen = torch.Generator().manual_seed(0)
    behaviour = -torch.rand(9, generator=gen) * 3
    ends = torch.tensor([2, 3, 6, 8])  # the last student token is in no chunk
    teacher = -torch.rand(4, generator=gen) * 6
    adv, share = L.chunk_advantages(teacher, behaviour, ends, discount)
    want = _reference_chunk_advantages(teacher.tolist(), behaviour.tolist(), ends.tolist(), discount)
    assert torch.allclose(adv, torch.tensor(want), atol=1e-5)
    assert adv[8] == 0.0 and share[8] == behaviour[8]  # no chunk: no signal
    # the teacher share sums to each chunk's teacher log-prob
    assert torch.allclose(torch.stack([share[a:b].sum() for a, b in [(0, 2), (2, 3), (3, 6), (6, 8)]]), teacher,
                          atol=1e-5)


@pytest.mark.parametrize("discount", [0.0, 0.5])
def test_one_token_chunks_give_rkl_advantages_exactly(discount):
    gen = torch.Generator().manual_seed(1)
    behaviour, teacher = -torch.rand(7, generator=gen) * 4, -torch.rand(7, generator=gen) * 4
    adv, _ = L.chunk_advantages(teacher, behaviour, torch.arange(1, 8), discount)
    assert torch.equal(adv, L.rkl_advantages(teacher, behaviour, discount))


def test_uld_value_gradient_and_zero_at_equal_sorted_probabilities():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 9, generator=gen, requires_grad=True)
    teacher = torch.sort(torch.softmax(torch.randn(4, 9, generator=gen), -1), descending=True).values[:, :3]
    weight = torch.tensor([1.0, 0.0, 1.0, 1.0])
    out = L.uld(logits, teacher, weight, num_tokens=5)
    p = np.sort(torch.softmax(logits.detach(), -1).numpy(), axis=-1)[:, ::-1][:, :3]
    want = sum(w * np.abs(p[n] - teacher[n].numpy()).sum() for n, w in enumerate(weight.tolist())) / 5
    assert abs(float(out.loss.detach()) - want) < 1e-6 and abs(float(out.metrics["uld_positions"]) - 3 / 5) < 1e-7
    out.loss.backward()
    assert torch.all(logits.grad[1] == 0) and logits.grad[0].abs().sum() > 0
    # the student's own sorted top-k (in any order of its ids: only the sorted values matter) gives 0
    own = torch.sort(torch.softmax(logits.detach(), -1), descending=True).values[:, :3]
    assert float(L.uld(logits.detach()[:, torch.randperm(9, generator=gen)], own, weight, 5).loss) < 1e-7


def test_a_tokenizer_of_unknown_bytes_is_named_by_the_callers_flag(toks):
    """A word-level tokenizer has no byte decoder: the error names the flag of the side it came from, the student's
    as the caller spells it (opd-score --student-tokenizer, opd-check --model)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from opd_common.errors import ConfigError

    backend = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    words = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="[UNK]")
    with pytest.raises(ConfigError, match=r"^--model: its tokenizer is neither byte-level BPE"):
        Aligner(words, toks["plain"], "--teacher t=T", student_flag="--model")
    with pytest.raises(ConfigError, match=r"^--student-tokenizer: "):
        Aligner(words, toks["plain"], "--teacher t=T")
    with pytest.raises(ConfigError, match=r"^--teacher t=T: "):
        Aligner(toks["plain"], words, "--teacher t=T", student_flag="--model")
