"""Streams: files, zstd, shard directories with manifests, crash safety, stdin."""

from __future__ import annotations

import hashlib
import io
import json
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import orjson
import pytest
import zstandard
from test_records import assert_records_equal, make_record

import opd_common
from opd_common.errors import RecordError, StreamError
from opd_common.streams import (
    MANIFEST,
    ZSTD_MAGIC,
    BackgroundWriter,
    InputSource,
    ManifestInfo,
    ShardWriter,
    StreamWriter,
    encode,
    iter_inputs,
    open_writer,
)

ENCODINGS = ["packed", "json"]


def records(n: int = 7) -> list[dict]:
    """n valid records with top-k and a teacher block; record i has i % 4 + 1 response tokens."""
    out = []
    for i in range(n):
        ids = tuple(range(10 + i, 10 + i + i % 4 + 1))
        T = len(ids)
        teacher = {"model": "teach", "prompt": "as-is", "logprobs": np.full(T, -0.5 * i, np.float32)}
        out.append(make_record(f"p{i // 3}", i % 3, ids, group_size=3, k=2, teachers={"t": teacher},
                               reward={"correct": i % 2 == 0, "total": float(i)}))
    return out


def read_all(*specs: str, check: bool = True) -> list:
    return [rec for rec, _ in iter_inputs(list(specs), check=check)]


def read_all_with_sources(spec: str, sources: list[InputSource]) -> list[dict]:
    return [rec for rec, _ in iter_inputs([spec], sources=sources)]


def write_file(path: Path, recs: list[dict], encoding: str = "packed", compress: bool = False) -> Path:
    with open(path, "wb") as f, StreamWriter(f, encoding=encoding, compress=compress) as writer:
        for rec in recs:
            writer.write(rec)
    return path


def write_shards(out: Path, recs: list[dict], shard_size: int = 3, encoding: str = "packed",
                 info: ManifestInfo | None = None, **kwargs) -> Path:
    info = info or ManifestInfo(tool="opd-test", config={"shard_size": shard_size})
    with ShardWriter(out, info, shard_size=shard_size, encoding=encoding, **kwargs) as writer:
        for rec in recs:
            writer.write(rec)
    return out


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_all_equal(got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert_records_equal(g, w)


# --------------------------------------------------------------------------- files


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_plain_jsonl_round_trip(tmp_path, encoding):
    recs = records()
    path = write_file(tmp_path / "r.jsonl", recs, encoding)
    assert path.read_bytes().count(b"\n") == len(recs)
    assert_all_equal(read_all(str(path)), records())


def test_encodings_differ_on_disk_and_agree_when_read(tmp_path):
    recs = records()
    packed = write_file(tmp_path / "packed.jsonl", recs, "packed")
    plain = write_file(tmp_path / "plain.jsonl", recs, "json")
    first_packed = orjson.loads(packed.read_bytes().splitlines()[1])
    first_plain = orjson.loads(plain.read_bytes().splitlines()[1])
    assert first_packed["response_ids"] == {"nd": "int32", "shape": [2], "b64": "CwAAAAwAAAA="}  # [11, 12]
    assert first_packed["topk_logprobs"]["shape"] == [2, 2]
    assert first_plain["response_ids"] == [11, 12]
    assert first_plain["logprobs"] == [-0.125, -0.25]
    assert first_plain["topk_ids"] == [[11, 12], [12, 13]]
    assert first_plain["teachers"]["t"]["logprobs"] == [-0.5, -0.5]
    assert_all_equal(read_all(str(packed)), read_all(str(plain)))


@pytest.mark.parametrize("name", ["r.jsonl.zst", "r.jsonl"])
def test_zstd_file_is_detected_by_magic_bytes_whatever_its_name(tmp_path, name):
    path = write_file(tmp_path / name, records(), compress=True)
    assert path.read_bytes()[:4] == ZSTD_MAGIC
    assert_all_equal(read_all(str(path)), records())


def test_zstd_with_several_frames_is_read_across_frames(tmp_path):
    recs = records(4)
    cctx = zstandard.ZstdCompressor()
    path = tmp_path / "frames.jsonl.zst"
    path.write_bytes(b"".join(cctx.compress(encode(rec)) for rec in recs))
    assert_all_equal(read_all(str(path)), records(4))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_empty_response_keeps_its_ranks(tmp_path, encoding):
    rec = make_record(response_ids=(), k=4, finish_reason="length", teachers={"t": {"logprobs": []}})
    (got,) = read_all(str(write_file(tmp_path / "r.jsonl", [rec], encoding)))
    assert got["response_ids"].shape == (0,) and got["teachers"]["t"]["logprobs"].shape == (0,)
    # packed keeps k; plain JSON writes [] and cannot, so the reader makes it [0][0]
    assert got["topk_ids"].shape == got["topk_logprobs"].shape == ((0, 4) if encoding == "packed" else (0, 0))
    assert got["topk_ids"].dtype == np.int32 and got["topk_logprobs"].dtype == np.float32


def test_blank_lines_and_missing_final_newline_are_fine(tmp_path):
    a, b = records(2)
    path = tmp_path / "r.jsonl"
    path.write_bytes(b"\n" + encode(a) + b"  \n\n" + encode(b).rstrip(b"\n"))
    assert_all_equal(read_all(str(path)), records(2))


def test_several_inputs_are_read_in_order_and_hashed(tmp_path):
    recs = records(5)
    one = write_file(tmp_path / "one.jsonl", recs[:2])
    two = write_file(tmp_path / "two.jsonl.zst", recs[2:], compress=True)
    sources: list[InputSource] = []
    got = [(rec["id"], str(where)) for rec, where in iter_inputs([str(one), str(two)], sources=sources)]
    assert got == [("p0:0", "record 1 of one.jsonl"), ("p0:1", "record 2 of one.jsonl"),
                   ("p0:2", "record 1 of two.jsonl.zst"), ("p1:0", "record 2 of two.jsonl.zst"),
                   ("p1:1", "record 3 of two.jsonl.zst")]
    assert [s.describe() for s in sources] == [
        {"input": str(one), "kind": "file", "sha256": sha256(one)},
        {"input": str(two), "kind": "file", "sha256": sha256(two)},
    ]


def test_input_file_hash_is_known_even_when_reading_stops_early(tmp_path):
    path = write_file(tmp_path / "in.jsonl", records(3))
    sources: list[InputSource] = []
    stream = iter_inputs([str(path)], sources=sources)
    next(stream)  # e.g. opd-rollout --limit 1: the rest of the file is never read
    assert sources[0].describe() == {"input": str(path), "kind": "file", "sha256": sha256(path)}


def test_malformed_json_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(encode(records(1)[0]) + b"{not json}\n")
    with pytest.raises(RecordError) as info:
        read_all(str(path))
    assert str(info.value) == (
        "record 2 of bad.jsonl is not valid JSON (unexpected character, expected a string key at column 2)")


def test_malformed_packed_array_names_file_and_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"response_ids": {"nd": "int32", "shape": [3], "b64": "AAAA"}}\n')
    with pytest.raises(RecordError) as info:
        read_all(str(path))
    assert str(info.value).startswith("record 1 of bad.jsonl has a malformed packed array (")


def test_invalid_record_in_a_file_names_file_and_line(tmp_path):
    recs = records(3)
    del recs[2]["logprobs"]
    path = write_file(tmp_path / "r.jsonl", recs)
    with pytest.raises(RecordError) as info:
        read_all(str(path))
    assert str(info.value) == "record 3 of r.jsonl has no 'logprobs' (was it written by opd-rollout?)"


def test_check_false_reads_foreign_jsonl_unvalidated(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"problem": "1+1?", "answer": "2"}\n')
    assert read_all(str(path), check=False) == [{"problem": "1+1?", "answer": "2"}]
    with pytest.raises(RecordError, match="has no 'schema'"):
        read_all(str(path))


def test_missing_input_is_named():
    with pytest.raises(StreamError) as info:
        read_all("nope.jsonl")
    assert str(info.value) == ("input 'nope.jsonl' does not exist (expected '-', a .jsonl/.jsonl.zst or .parquet "
                               "file, a shard, parquet or datasets save_to_disk directory, or "
                               "hf://datasets/ORG/NAME[@REV][:SPLIT])")


def test_stream_writer_flush_makes_compressed_records_readable_before_close():
    buf = io.BytesIO()
    writer = StreamWriter(buf, compress=True)
    writer.write(records(1)[0])
    writer.flush()
    partial = zstandard.ZstdDecompressor().decompressobj().decompress(buf.getvalue())
    assert orjson.loads(partial)["id"] == "p0:0"
    writer.close()


def test_open_writer_rejects_unknown_encoding(tmp_path):
    with pytest.raises(StreamError) as info:
        open_writer(str(tmp_path / "out"), ManifestInfo("t"), encoding="msgpack")
    assert str(info.value) == "--encoding must be one of ('packed', 'json'), got 'msgpack'"


# --------------------------------------------------------------------------- shard directories


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_shard_dir_round_trip_and_manifest(tmp_path, encoding):
    src = write_file(tmp_path / "in.jsonl", records())
    sources: list[InputSource] = []
    recs = read_all_with_sources(str(src), sources)
    info = ManifestInfo(tool="opd-test", config={"shard_size": 3, "seed": 0}, inputs=sources)
    out = write_shards(tmp_path / "out", recs, shard_size=3, encoding=encoding, info=info)

    names = sorted(p.name for p in out.iterdir())
    assert names == [MANIFEST, "records-00000.jsonl.zst", "records-00001.jsonl.zst", "records-00002.jsonl.zst"]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["schema"] == "opd/1"
    assert manifest["tool"] == "opd-test"
    assert manifest["version"] == opd_common.__version__
    assert manifest["config"] == {"shard_size": 3, "seed": 0}
    assert manifest["encoding"] == encoding
    assert manifest["records"] == 7
    assert manifest["inputs"] == [{"input": str(src), "kind": "file", "sha256": sha256(src)}]
    assert [(s["file"], s["records"]) for s in manifest["shards"]] == [
        ("records-00000.jsonl.zst", 3), ("records-00001.jsonl.zst", 3), ("records-00002.jsonl.zst", 1)]
    for shard in manifest["shards"]:
        path = out / shard["file"]
        assert shard["sha256"] == sha256(path)
        assert shard["bytes"] == path.stat().st_size
        assert path.read_bytes()[:4] == ZSTD_MAGIC
    assert manifest["started_at"] <= manifest["finished_at"]

    got = [(rec, str(where)) for rec, where in iter_inputs([str(out)])]
    assert [w for _, w in got][2:4] == ["record 3 of records-00000.jsonl.zst",
                                        "record 1 of records-00001.jsonl.zst"]
    assert_all_equal([rec for rec, _ in got], records())


def test_shard_dir_as_input_is_hashed_by_its_manifest(tmp_path):
    out = write_shards(tmp_path / "out", records(2))
    sources: list[InputSource] = []
    assert len(read_all_with_sources(str(out), sources)) == 2
    assert sources[0].describe() == {"input": str(out), "kind": "dir", "sha256": sha256(out / MANIFEST)}


def test_shard_name_and_empty_output(tmp_path):
    out = tmp_path / "out"
    with ShardWriter(out, ManifestInfo("opd-test"), name="rollouts", shard_size=2) as writer:
        writer.write(records(1)[0])
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "rollouts-00000.jsonl.zst"]
    empty = write_shards(tmp_path / "empty", [])
    manifest = json.loads((empty / MANIFEST).read_text())
    assert (manifest["records"], manifest["shards"]) == (0, [])
    assert read_all(str(empty)) == []


def test_directory_without_manifest_is_refused(tmp_path):
    out = write_shards(tmp_path / "out", records())
    (out / MANIFEST).unlink()
    with pytest.raises(StreamError) as info:
        read_all(str(out))
    assert str(info.value) == (
        f"{out} has no manifest.json: the tool that wrote it did not finish (3 shard file(s) present); "
        "re-run it (with --overwrite) or read the shard files directly")


def test_empty_directory_is_refused_without_shard_hint(tmp_path):
    with pytest.raises(StreamError) as info:
        read_all(str(tmp_path))
    assert str(info.value) == (f"{tmp_path} has no manifest.json: the tool that wrote it did not finish; "
                               "re-run it (with --overwrite) or read the shard files directly")


def test_shard_modified_after_writing_is_refused(tmp_path):
    out = write_shards(tmp_path / "out", records())
    shard = out / "records-00001.jsonl.zst"
    listed = sha256(shard)
    write_file(shard, records(3), compress=True)  # a valid shard, but not the one the manifest lists
    with pytest.raises(StreamError) as info:
        read_all(str(out))
    assert str(info.value) == (
        f"{shard}: sha256 {sha256(shard)[:12]}... disagrees with manifest.json ({listed[:12]}...); "
        "the shard was modified or corrupted after it was written")


def test_shard_listed_but_missing_is_refused(tmp_path):
    out = write_shards(tmp_path / "out", records())
    (out / "records-00002.jsonl.zst").unlink()
    with pytest.raises(StreamError) as info:
        read_all(str(out))
    assert str(info.value) == f"{out}/manifest.json lists records-00002.jsonl.zst, which is missing"


def test_record_count_disagreeing_with_manifest_is_refused(tmp_path):
    out = write_shards(tmp_path / "out", records())
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["shards"][0]["records"] = 4
    (out / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(StreamError) as info:
        read_all(str(out))
    assert str(info.value) == f"{out / 'records-00000.jsonl.zst'}: has 3 records but manifest.json says 4"


def test_unreadable_manifest_is_refused(tmp_path):
    out = write_shards(tmp_path / "out", records(1))
    (out / MANIFEST).write_text('{"schema": "opd/1"}')
    with pytest.raises(StreamError, match=r"manifest.json is not a valid opd manifest \('shards'\)"):
        read_all(str(out))


@pytest.mark.parametrize("written,final_shards", [(2, []), (4, ["records-00000.jsonl.zst"])],
                         ids=["in-first-shard", "after-one-shard"])
def test_crash_mid_write_leaves_only_tmp_and_no_manifest(tmp_path, written, final_shards):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="boom"):
        with ShardWriter(out, ManifestInfo("opd-test"), shard_size=3) as writer:
            for rec in records(written):
                writer.write(rec)
            raise RuntimeError("boom")
    partial = f"records-{len(final_shards):05d}.jsonl.zst.tmp"
    assert sorted(p.name for p in out.iterdir()) == sorted([*final_shards, partial])
    assert not (out / MANIFEST).exists()
    with pytest.raises(StreamError) as info:
        read_all(str(out))
    assert f"{out} has no manifest.json: the tool that wrote it did not finish" in str(info.value)


def test_out_onto_finished_output_is_refused_without_overwrite(tmp_path):
    out = write_shards(tmp_path / "out", records(4))
    with pytest.raises(StreamError) as info:
        write_shards(out, records(1))
    assert str(info.value) == (f"--out {out} already holds a finished output; "
                               "pass --overwrite or choose another directory")
    assert len(read_all(str(out))) == 4  # untouched

    write_shards(out, records(1), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "records-00000.jsonl.zst"]
    assert [r["id"] for r in read_all(str(out))] == ["p0:0"]


def test_out_onto_unfinished_output_is_refused_without_overwrite(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with ShardWriter(out, ManifestInfo("opd-test")) as writer:
            writer.write(records(1)[0])
            raise RuntimeError("crash")
    with pytest.raises(StreamError) as info:
        write_shards(out, records(1))
    assert str(info.value) == (f"--out {out} already holds an unfinished output (no manifest); "
                               "pass --overwrite or choose another directory")
    write_shards(out, records(2), overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == [MANIFEST, "records-00000.jsonl.zst"]


def test_out_must_be_a_directory_and_shard_size_positive(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(StreamError, match=r"^--out .*file exists and is not a directory$"):
        write_shards(tmp_path / "file", [])
    with pytest.raises(StreamError, match=r"^--shard-size must be >= 1, got 0$"):
        write_shards(tmp_path / "out", [], shard_size=0)


# --------------------------------------------------------------------------- stdin (real subprocesses)

READER = """
import sys
from opd_common.streams import iter_inputs
sources = []
for rec, where in iter_inputs(['-'], sources=sources):
    print(where, rec['id'], len(rec['response_ids']), rec['logprobs'].dtype, flush=True)
print('sha256', sources[0].sha256, flush=True)
"""


def stdin_bytes(recs: list[dict], compress: bool) -> bytes:
    buf = io.BytesIO()
    with StreamWriter(buf, compress=compress) as writer:
        for rec in recs:
            writer.write(rec)
    return buf.getvalue()


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "zstd"])
def test_stdin_subprocess(compress):
    data = stdin_bytes(records(3), compress)
    assert (data[:4] == ZSTD_MAGIC) is compress
    proc = subprocess.run([sys.executable, "-c", READER], input=data, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().splitlines() == [
        "record 1 of <stdin> p0:0 1 float32",
        "record 2 of <stdin> p0:1 2 float32",
        "record 3 of <stdin> p0:2 3 float32",
        f"sha256 {hashlib.sha256(data).hexdigest()}",
    ]


def _readline(proc: subprocess.Popen, timeout: float = 20.0) -> bytes | None:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline() if ready else None


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "zstd"])
def test_stdin_streams_records_before_end_of_input(compress):
    proc = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        writer = StreamWriter(proc.stdin, compress=compress)
        for i, rec in enumerate(records(2)):
            writer.write(rec)
            writer.flush()
            assert _readline(proc) == f"record {i + 1} of <stdin> p0:{i} {i + 1} float32\n".encode()
        writer.close()
        proc.stdin.close()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_stdin_zstd_magic_split_across_pipe_writes_is_detected():
    data = stdin_bytes(records(1), compress=True)
    proc = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdin.write(data[:2])
    proc.stdin.flush()
    time.sleep(1.0)  # the reader has started and sees only half the magic bytes
    proc.stdin.write(data[2:])
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0, proc.stderr.read().decode()
    out = proc.stdout.read()
    assert out.decode().splitlines()[0] == "record 1 of <stdin> p0:0 1 float32"


# --------------------------------------------------------------------------- the background writer


class _GatedWriter:
    """A writer whose writes wait until `gate` is set (a reader that is not reading), or fail with `error`."""

    def __init__(self, error: BaseException | None = None):
        import threading

        self.gate, self.error = threading.Event(), error
        self.written, self.flushes = [], 0

    def write(self, rec):
        self.gate.wait()
        if self.error is not None:
            raise self.error
        self.written.append(rec)

    def flush(self):
        self.flushes += 1


def _put_in_thread(writer: BackgroundWriter, batch: list):
    import threading

    t = threading.Thread(target=writer.put, args=(batch,), daemon=True)
    t.start()
    return t


def test_background_writer_lets_the_producer_go_on_while_a_write_waits_and_keeps_the_order():
    """put() returns while the first batch waits to be written; with depth 2, two more batches wait and a fourth
    put blocks until the writer moves; close() writes everything, in order, one flush per batch."""
    inner = _GatedWriter()
    writer = BackgroundWriter(inner, depth=2)
    t0 = time.monotonic()
    writer.put([{"i": 0}, {"i": 1}])
    time.sleep(0.1)  # the thread has taken batch 0 and waits in its write
    writer.put([{"i": 2}])
    writer.put([{"i": 3}])
    assert time.monotonic() - t0 < 1.0 and inner.written == []
    blocked = _put_in_thread(writer, [{"i": 4}])
    blocked.join(0.3)
    assert blocked.is_alive()  # depth 2 batches already wait
    inner.gate.set()
    blocked.join(5)
    assert not blocked.is_alive()
    writer.close()
    assert [r["i"] for r in inner.written] == [0, 1, 2, 3, 4] and inner.flushes == 4


def test_background_writer_raises_a_write_error_in_the_producer():
    inner = _GatedWriter(error=BrokenPipeError("reader gone"))
    inner.gate.set()
    writer = BackgroundWriter(inner, depth=1)
    writer.put([{"i": 0}])
    deadline = time.monotonic() + 10
    with pytest.raises(BrokenPipeError, match="reader gone"):  # check() raises once the thread has failed
        while time.monotonic() < deadline:
            writer.check()
            time.sleep(0.01)
    with pytest.raises(BrokenPipeError, match="reader gone"):
        writer.put([{"i": 1}])
    with pytest.raises(BrokenPipeError):
        writer.close()


def test_background_writer_writes_what_it_was_given_when_the_producer_fails():
    """The producer failed (a bad input line): close(raise_error=False) still writes every batch handed over, and
    a write error of its own does not hide the producer's."""
    inner = _GatedWriter()
    writer = BackgroundWriter(inner, depth=2)
    writer.put([{"i": 0}])
    writer.put([{"i": 1}])
    inner.gate.set()
    writer.close(raise_error=False)
    assert [r["i"] for r in inner.written] == [0, 1]
    failing = _GatedWriter(error=BrokenPipeError("reader gone"))
    failing.gate.set()
    writer = BackgroundWriter(failing)
    writer.put([{"i": 0}])
    writer.close(raise_error=False)
    assert failing.written == []
