"""The registry of objectives (opd_train/objectives.py) holds together: every --loss has an entry, each
entry's build gives the tensors its losses.py call reads, that call runs, and a record lacking a block
the objective reads gets the entry's hint. No model: a synthetic record, random logits."""

from __future__ import annotations

import pytest
import torch

from opd_common.errors import RecordError
from opd_common.records import Where
from opd_train import losses
from opd_train.config import LOSSES, TrainConfig
from opd_train.data import collate, make_example
from opd_train.objectives import OBJECTIVES, objective
from opd_train.trainer import set_group_advantages

T, K, V = 3, 2, 11


def record() -> dict:
    """A record with every block some objective reads."""
    return {"id": "p:0", "prompt_id": "p", "prompt_ids": [1, 2], "response_ids": [3, 4, 5],
            "logprobs": [-1.0, -2.0, -0.5], "example": {"problem": "1 + 1?"},
            "teachers": {"t": {"logprobs": [-0.5, -1.5, -1.0], "topk_ids": [[3, 6]] * T,
                               "topk_logprobs": [[-0.2, -2.0]] * T}},
            "shift": {"ids": [[3, 7]] * T, "delta": [[0.1, -0.2]] * T},
            "reward": {"total": 1.0, "correct": 1}}


def config(loss: str, **options) -> TrainConfig:
    return TrainConfig(model="unused", out="unused", loss=loss, max_steps=1, batch_groups=1, **options)


VARIANTS = [(name, {}) for name in OBJECTIVES] + [
    (name, {"self_teacher": "opsd"}) for name, obj in OBJECTIVES.items() if obj.with_self_teacher is not None]


def test_every_loss_flag_value_has_an_entry():
    assert LOSSES == tuple(OBJECTIVES)
    assert LOSSES[:6] == ("sft", "rkl", "fkl", "shift", "grpo", "dapo")  # (--help lists them in this order)
    assert all(name == obj.name for name, obj in OBJECTIVES.items())


@pytest.mark.parametrize("name, options", VARIANTS, ids=[f"{n}{'-self' if o else ''}" for n, o in VARIANTS])
def test_each_entry_builds_what_its_loss_call_reads_and_the_call_runs(name, options):
    cfg = config(name, **options)
    obj = objective(cfg)
    ex = make_example(record(), Where("r.jsonl", 1), cfg, teacher_render=lambda rec, where: [9, 8])
    if obj.group_advantages:
        set_group_advantages([ex])
    chunk = collate([ex])
    gen = torch.Generator().manual_seed(0)
    if obj.reference(cfg):
        chunk["ref_logp"] = -torch.rand(T, generator=gen)
    if obj.self_teacher:
        assert ex.teacher_context is not None
        chunk["teacher_logits"] = torch.randn(T, V, generator=gen)
    chunk.update(num_tokens=T, beta=1.0)
    from opd_train.model import call_loss

    logits_NV = torch.randn(T, V, generator=gen, requires_grad=True)
    for call in [obj.call, *(c for _, c in obj.metrics)]:
        assert callable(getattr(losses, call.fn)), call.fn
        assert set(call.args) <= set(chunk), call  # (kwargs may be absent: None)
    out = call_loss(obj.call, logits_NV, chunk, cfg)
    assert torch.isfinite(out.loss) and out.loss.requires_grad
    out.loss.backward()
    assert torch.isfinite(logits_NV.grad).all()
    for metric, call in obj.metrics:
        assert torch.isfinite(call_loss(call, logits_NV, chunk, cfg)), metric
    if obj.compact is not None:
        assert chunk[obj.compact].shape[0] == T


# which block to drop from record() to get each hint; an entry with a hint needs a case here
MISSING = {"fkl": ("teachers", "t", "topk_ids"), "uld": ("teachers", "t", "topk_logprobs"),
            "shift": ("shift",), "grpo": ("reward",), "dapo": ("reward",)}


def test_every_hint_has_a_case():
    assert {name for name, obj in OBJECTIVES.items() if obj.hint} == set(MISSING)


@pytest.mark.parametrize("name", sorted(MISSING))
def test_a_record_without_a_block_it_reads_gets_the_hint(name):
    rec = record()
    *parents, key = MISSING[name]
    block = rec
    for p in parents:
        block = block[p]
    del block[key]
    with pytest.raises(RecordError) as err:
        make_example(rec, Where("r.jsonl", 4), config(name))
    assert str(err.value).startswith("record 4 of r.jsonl: ")
    assert str(err.value).endswith(f", which --loss {name} reads; {OBJECTIVES[name].hint}")


@pytest.mark.parametrize("teachers, expected", [
    ({}, "record 2 of r.jsonl: --loss rkl needs one teacher block, the record has none; score it with opd-score "
         "--teacher NAME=MODEL, or pick one with --teacher NAME"),
    ({"a": {}, "b": {}}, "record 2 of r.jsonl: --loss rkl needs one teacher block, the record has a, b; score it "
                         "with opd-score --teacher NAME=MODEL, or pick one with --teacher NAME"),
])
def test_teacher_block_errors(teachers, expected):
    rec = {**record(), "teachers": teachers}
    with pytest.raises(RecordError) as err:
        make_example(rec, Where("r.jsonl", 2), config("rkl"))
    assert str(err.value) == expected
    with pytest.raises(RecordError) as err:
        make_example(record(), Where("r.jsonl", 2), config("fkl", teacher="u"))
    assert str(err.value) == ("record 2 of r.jsonl: no teachers.u block (the record has t); check --teacher or "
                              "score the records with opd-score --teacher")


def test_config_defaults_and_requirements_come_from_the_entry():
    assert (config("grpo").clip_high, config("grpo").dynamic_sampling) == (0.2, False)
    assert (config("dapo").clip_high, config("dapo").dynamic_sampling) == (0.28, True)
    assert (config("rkl").clip_high, config("rkl").dynamic_sampling) == (None, None)
    from opd_common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--self-teacher goes with --loss fkl \(the full-vocabulary forward KL\)$"):
        config("rkl", self_teacher="opsd")
    with pytest.raises(ConfigError, match=r"^--loss grpo needs --batch-groups"):
        TrainConfig(model="m", out="o", loss="grpo", max_steps=1, batch_size=2)


@pytest.mark.parametrize("name", ["grpo", "dapo"])
def test_response_mean_aggregation_reaches_ppo_clip_as_token_weights(name):
    """--aggregation response-mean: the step's examples get tokens["weight"] = sum T / (B T_i), the registry passes
    it to ppo_clip, and the loss is the mean over responses of each response's token mean."""
    from opd_train.model import call_loss

    cfg = config(name, aggregation="response-mean")
    short = make_example(record(), Where("r.jsonl", 1), cfg)
    rec = {**record(), "id": "p:1", "response_ids": [3, 4, 5, 6, 7, 8], "logprobs": [-1.0] * 6,
           "reward": {"total": 0.0, "correct": 0}}
    long = make_example(rec, Where("r.jsonl", 2), cfg)
    set_group_advantages([short, long], cfg.aggregation)
    assert short.tokens["weight"].tolist() == pytest.approx([9 / 6] * 3)  # (3 + 6) / (2 * 3)
    assert long.tokens["weight"].tolist() == pytest.approx([9 / 12] * 6)
    chunk = {**collate([short, long]), "num_tokens": 9, "beta": 1.0}
    logits_NV = torch.randn(9, V, generator=torch.Generator().manual_seed(1))
    got = call_loss(objective(cfg).call, logits_NV, chunk, cfg).loss
    pg = [float(losses.ppo_clip(logits_NV[s], chunk["targets_N"][s], chunk["behaviour_logp"][s],
                                chunk["advantage"][s], n, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                dual_clip=cfg.dual_clip).loss) for s, n in ((slice(0, 3), 3), (slice(3, 9), 6))]
    assert float(got) == pytest.approx(sum(pg) / 2, rel=1e-6)
    token_cfg = config(name)
    plain = make_example(record(), Where("r.jsonl", 1), token_cfg)
    set_group_advantages([plain], token_cfg.aggregation)
    assert "weight" not in plain.tokens


def test_response_mean_aggregation_goes_with_grpo_and_dapo_only():
    from opd_common.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^--aggregation response-mean goes with --loss grpo or dapo; the other "
                                          r"losses are token means over the step$"):
        config("rkl", aggregation="response-mean")


def test_uld_sorts_the_teachers_probabilities_read_at_the_students_top_k():
    """opd-score --at-student-topk writes the teacher's log-probs at the student's top-k ids, in the student's
    order; uld compares sorted vectors, so the teacher's side is sorted when it is read."""
    import numpy as np

    rec = record()
    T = len(rec["response_ids"])
    unsorted = np.log(np.tile([[0.1, 0.6, 0.3]], (T, 1))).astype(np.float32)
    rec["teachers"]["t"].update(topk="student", topk_logprobs=unsorted, topk_ids=np.tile([[3, 4, 5]], (T, 1)))
    ex = make_example(rec, Where("r.jsonl", 1), config("uld"))
    np.testing.assert_allclose(ex.tokens["teacher_probs"], np.tile([[0.6, 0.3, 0.1]], (T, 1)), rtol=1e-6)
