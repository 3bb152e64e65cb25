"""The record contract: packed arrays, normalization and validate()'s error texts."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from opd_common.errors import RecordError
from opd_common.records import (
    REQUIRED,
    SCHEMA,
    Where,
    is_packed,
    pack_array,
    pack_tree,
    plain_tree,
    unpack_array,
    unpack_tree,
    validate,
)

WHERE = Where("x.jsonl", 3)
ALIGN = "(per-token arrays are aligned to response tokens)"


def make_record(prompt_id: str = "p0", sample: int = 0, response_ids=(11, 12, 13, 2), *, group_size: int = 2,
                k: int | None = None, finish_reason: str = "stop", teachers: dict | None = None,
                reward: dict | None = None, model: str = "tiny", version: int = 0) -> dict:
    """A valid opd/1 record with numpy per-token arrays (as the tools hold them in memory).

    logprobs[t] = -(t + 1) / 8 (exact in float32); with k, topk_ids[t] = [ids[t], ids[t] + 1, ...]
    and topk_logprobs[t][j] = logprobs[t] - j.
    """
    ids_T = np.asarray(response_ids, dtype=np.int32)
    T = len(ids_T)
    logprobs_T = -(np.arange(T, dtype=np.float32) + 1) / 8
    rec = {
        "schema": SCHEMA,
        "id": f"{prompt_id}:{sample}",
        "prompt_id": prompt_id,
        "sample": sample,
        "group_size": group_size,
        "example": {"problem": "What is 6 * 7?", "answer": "42"},
        "policy": {"model": model, "revision": None, "adapter": None, "version": version},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": 16, "seed": 1234 + sample,
                     "engine": "hf", "logprobs": "raw", "thinking": False},
        "prompt_ids": [1, 5, 6, 7],
        "response_ids": ids_T,
        "finish_reason": finish_reason,
        "response_text": "abc",
        "logprobs": logprobs_T,
    }
    if k is not None:
        rec["topk_ids"] = (ids_T[:, None] + np.arange(k, dtype=np.int32)[None, :]).reshape(T, k)
        rec["topk_logprobs"] = (logprobs_T[:, None] - np.arange(k, dtype=np.float32)[None, :]).reshape(T, k)
    if teachers is not None:
        rec["teachers"] = teachers
    if reward is not None:
        rec["reward"] = reward
    return rec


def assert_records_equal(got: dict, want: dict) -> None:
    """Same keys, same values; arrays equal in value, shape and dtype (after validate())."""
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        if isinstance(value, np.ndarray):
            assert isinstance(got[key], np.ndarray), key
            assert got[key].dtype == value.dtype, key
            assert got[key].shape == value.shape, key
            np.testing.assert_array_equal(got[key], value, err_msg=key)
        elif isinstance(got[key], np.ndarray):  # a plain list in `want`, normalized by validate()
            assert got[key].tolist() == value, key
        elif isinstance(value, dict):
            assert isinstance(got[key], dict), key
            assert_records_equal(got[key], value)
        else:
            assert got[key] == value, key


def expect(rec: dict, message: str) -> None:
    with pytest.raises(RecordError) as info:
        validate(rec, WHERE)
    assert str(info.value) == message


# --------------------------------------------------------------------------- packing


def test_pack_array_is_little_endian_base64_with_dtype_and_shape():
    packed = pack_array(np.array([1, 256], dtype=np.int32))
    assert packed == {"nd": "int32", "shape": [2], "b64": "AQAAAAABAAA="}
    assert base64.b64decode(packed["b64"]) == b"\x01\x00\x00\x00\x00\x01\x00\x00"


@pytest.mark.parametrize("arr", [
    np.array([3, -1, 2**31 - 1, -(2**31)], dtype=np.int32),
    np.array([0.5, -1.25, -np.inf, 1e-30, -12.375], dtype=np.float32),
    np.arange(12, dtype=np.float32).reshape(3, 4) / 7,
    np.arange(6, dtype=np.int32).reshape(2, 3)[:, ::2],  # not C-contiguous
    np.zeros(0, dtype=np.int32),
    np.zeros((0, 16), dtype=np.float32),
    np.array([1.5, -2.0], dtype=">f4"),  # big-endian input still packs little-endian
], ids=["int32", "float32", "float32-2d", "int32-strided", "empty", "empty-2d", "big-endian"])
def test_pack_unpack_round_trip(arr):
    back = unpack_array(pack_array(arr))
    assert back.shape == arr.shape
    assert back.dtype == arr.dtype.newbyteorder("=")
    np.testing.assert_array_equal(back, arr)


def test_big_endian_input_packs_to_the_same_bytes_as_native():
    assert pack_array(np.array([1.5, -2.0], dtype=">f4")) == pack_array(np.array([1.5, -2.0], dtype=np.float32))


def test_pack_tree_and_unpack_tree_cover_nested_blocks_and_leave_other_values_alone():
    rec = make_record(k=2, teachers={"t": {"model": "m", "logprobs": np.array([-1, -2, -3, -4], np.float32)}})
    packed = pack_tree(rec)
    assert is_packed(packed["response_ids"]) and is_packed(packed["topk_logprobs"])
    assert is_packed(packed["teachers"]["t"]["logprobs"])
    assert packed["teachers"]["t"]["model"] == "m"
    assert packed["prompt_ids"] == [1, 5, 6, 7]  # plain lists stay plain
    assert isinstance(rec["response_ids"], np.ndarray)  # pack_tree copies, the input is untouched
    assert_records_equal(unpack_tree(packed), rec)


def test_plain_tree_turns_arrays_and_packed_arrays_into_lists():
    tree = {"a": np.array([1, 2], np.int32), "b": pack_array(np.array([[0.5], [0.25]], np.float32)),
            "c": [{"d": np.array([3], np.int32)}], "e": "text"}
    assert plain_tree(tree) == {"a": [1, 2], "b": [[0.5], [0.25]], "c": [{"d": [3]}], "e": "text"}


# --------------------------------------------------------------------------- validate


def test_where_names_record_and_file():
    assert str(WHERE) == "record 3 of x.jsonl"


def test_valid_record_passes_and_is_normalized_to_schema_dtypes():
    rec = plain_tree(make_record(k=3, teachers={"t": {"logprobs": [-1.0, -2.0, -3.0, -4.0],
                                                      "topk_ids": [[1, 2]] * 4,
                                                      "topk_logprobs": [[-1.0, -2.0]] * 4}}))
    out = validate(rec, WHERE)
    assert out is rec
    assert rec["response_ids"].dtype == np.int32 and rec["prompt_ids"].dtype == np.int32
    assert rec["logprobs"].dtype == np.float32 and rec["topk_logprobs"].shape == (4, 3)
    assert rec["teachers"]["t"]["topk_ids"].dtype == np.int32
    assert rec["teachers"]["t"]["logprobs"].tolist() == [-1.0, -2.0, -3.0, -4.0]


def test_empty_response_is_valid_and_keeps_its_ranks():
    rec = plain_tree(make_record(response_ids=(), k=4, finish_reason="length"))
    assert rec["topk_ids"] == [] and rec["logprobs"] == []
    validate(rec, WHERE)
    assert rec["response_ids"].shape == (0,) and rec["logprobs"].shape == (0,)
    assert rec["topk_ids"].shape == (0, 0) and rec["topk_logprobs"].shape == (0, 0)  # rank 2, k unknown


def test_arrays_of_other_dtypes_are_cast_to_the_schema_dtypes():
    rec = make_record(k=2)
    rec["logprobs"] = rec["logprobs"].astype(np.float64)
    rec["response_ids"] = rec["response_ids"].astype(np.int64)
    rec["topk_logprobs"] = rec["topk_logprobs"].astype(np.float16)
    validate(rec, WHERE)
    assert rec["logprobs"].dtype == np.float32 and rec["response_ids"].dtype == np.int32
    assert rec["topk_logprobs"].dtype == np.float32
    assert rec["logprobs"].tolist() == [-0.125, -0.25, -0.375, -0.5]


def test_arrays_already_of_schema_dtype_are_not_copied():
    rec = make_record()
    ids = rec["response_ids"]
    validate(rec, WHERE)
    assert rec["response_ids"] is ids


@pytest.mark.parametrize("key", list(REQUIRED))
def test_missing_required_field_names_record_file_and_field(key):
    rec = make_record()
    del rec[key]
    expect(rec, f"record 3 of x.jsonl has no '{key}' (was it written by opd-rollout?)")


def test_missing_response_ids_exact_text():
    rec = make_record()
    del rec["response_ids"]
    expect(rec, "record 3 of x.jsonl has no 'response_ids' (was it written by opd-rollout?)")


@pytest.mark.parametrize("key,value,typename", [
    ("sample", "0", "str"),
    ("sample", True, "bool"),
    ("group_size", 2.0, "float"),
    ("example", "problem text", "str"),
    ("response_ids", "11 12 13", "str"),
    ("id", 7, "int"),
])
def test_wrong_type_names_the_field(key, value, typename):
    rec = make_record()
    rec[key] = value
    expect(rec, f"record 3 of x.jsonl: field '{key}' has the wrong type ({typename})")


def test_non_object_record():
    expect([1, 2], "record 3 of x.jsonl: expected a JSON object, got list")


def test_wrong_schema_string():
    rec = make_record()
    rec["schema"] = "opd/2"
    expect(rec, "record 3 of x.jsonl: field 'schema' is 'opd/2'; this opd reads 'opd/1'")


def test_bad_finish_reason():
    rec = make_record(finish_reason="eos")
    expect(rec, "record 3 of x.jsonl: field 'finish_reason' must be one of ('stop', 'length'), got 'eos'")


def test_logprobs_shorter_than_response_ids():
    rec = make_record()
    rec["logprobs"] = rec["logprobs"][:3]
    expect(rec, f"record 3 of x.jsonl: field 'logprobs' has 3 entries but response_ids has 4 {ALIGN}")


def test_topk_rows_must_match_response_length():
    rec = make_record(k=2)
    rec["topk_logprobs"] = np.concatenate([rec["topk_logprobs"], rec["topk_logprobs"][:1]])
    expect(rec, f"record 3 of x.jsonl: field 'topk_logprobs' has 5 entries but response_ids has 4 {ALIGN}")


def test_topk_ids_without_topk_logprobs():
    rec = make_record(k=2)
    del rec["topk_logprobs"]
    expect(rec, "record 3 of x.jsonl: 'topk_ids' and 'topk_logprobs' must appear together")


def test_topk_logprobs_without_topk_ids():
    rec = make_record(k=2)
    del rec["topk_ids"]
    expect(rec, "record 3 of x.jsonl: 'topk_ids' and 'topk_logprobs' must appear together")


def test_teacher_block_length_mismatch():
    rec = make_record(teachers={"big": {"model": "m", "logprobs": [-0.5] * 5}})
    expect(rec, f"record 3 of x.jsonl: field 'teachers.big.logprobs' has 5 entries but response_ids has 4 {ALIGN}")


def test_teacher_topk_length_mismatch():
    rec = make_record(teachers={"big": {"logprobs": [-0.5] * 4, "topk_ids": [[1, 2]] * 3,
                                        "topk_logprobs": [[-1.0, -2.0]] * 4}})
    expect(rec, f"record 3 of x.jsonl: field 'teachers.big.topk_ids' has 3 entries but response_ids has 4 {ALIGN}")


def test_shift_delta_length_mismatch():
    rec = make_record()
    rec["shift"] = {"post": "a", "pre": "b", "k": 2, "ids": [[1, 2]] * 4, "delta": [[0.1, 0.2]] * 2}
    expect(rec, f"record 3 of x.jsonl: field 'shift.delta' has 2 entries but response_ids has 4 {ALIGN}")


def test_teacher_block_must_be_an_object():
    rec = make_record(teachers={"big": [-0.5, -0.5]})
    expect(rec, "record 3 of x.jsonl: field 'teachers.big' must be an object")


def test_per_token_array_of_wrong_rank():
    rec = make_record()
    rec["logprobs"] = [[-0.1], [-0.2], [-0.3], [-0.4]]
    expect(rec, "record 3 of x.jsonl: field 'logprobs' must have 1 dimension(s), got shape [4, 1]")


def test_teacher_topk_of_wrong_rank():
    rec = make_record(teachers={"t": {"logprobs": [-0.5] * 4, "topk_ids": [1, 2, 3, 4],
                                      "topk_logprobs": [[-1.0]] * 4}})
    expect(rec, "record 3 of x.jsonl: field 'teachers.t.topk_ids' must have 2 dimension(s), got shape [4]")


def test_non_numeric_per_token_array():
    rec = plain_tree(make_record())
    rec["logprobs"] = [-0.1, "x", -0.3, -0.4]
    with pytest.raises(RecordError) as info:
        validate(rec, WHERE)
    assert str(info.value).startswith("record 3 of x.jsonl: field 'logprobs' is not a numeric array (")
