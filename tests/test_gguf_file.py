"""runtime/load/gguf_file.py against gguf.GGUFReader (the oracle), plus every error path it names."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFReader, GGUFWriter
from gguf import GGUFValueType as V
from gguf.quants import quantize

from lowbit.runtime.errors import LowbitError
from lowbit.runtime.load.gguf_file import GGUFFile


def oracle_metadata(reader: GGUFReader) -> dict:
    # GGUFReader adds pseudo-fields GGUF.version / tensor_count / kv_count; they are not metadata.
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def assert_matches_oracle(path: Path, reader: GGUFReader, f: GGUFFile, byte_sample=None) -> None:
    assert f.version == int(reader.fields["GGUF.version"].contents())
    assert f.file_size == path.stat().st_size == reader.data.size
    assert f.metadata == oracle_metadata(reader)
    assert list(f.metadata) == [k for k in reader.fields if not k.startswith("GGUF.")]  # file order
    assert len(f.tensors) == len(reader.tensors)
    for mine, ref in zip(f.tensors, reader.tensors):
        assert mine.name == ref.name
        assert mine.tensor_type == ref.tensor_type and isinstance(mine.tensor_type, T)
        assert mine.shape == tuple(int(d) for d in ref.shape)
        assert all(type(d) is int for d in mine.shape)
        assert (mine.n_elements, mine.n_bytes, mine.data_offset) == (ref.n_elements, ref.n_bytes, ref.data_offset)
        assert mine.data.dtype == np.uint8 and mine.data.shape == (mine.n_bytes,)
    for i in (range(len(f.tensors)) if byte_sample is None else byte_sample):
        mine, ref = f.tensors[i], reader.tensors[i]
        assert np.array_equal(mine.data, np.ascontiguousarray(ref.data).view(np.uint8).reshape(-1)), mine.name


# ---- the default model -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def default_pair(default_gguf):
    return GGUFFile(default_gguf), GGUFReader(default_gguf)  # the oracle takes seconds to open


def test_default_model_matches_gguf_reader(default_gguf, default_pair):
    f, reader = default_pair
    n = len(f.tensors)
    sample = sorted({0, 1, 2, n // 3, n // 2, n - 2, n - 1} | set(range(0, n, 37)))
    assert_matches_oracle(default_gguf, reader, f, byte_sample=sample)
    assert len(f.metadata["tokenizer.ggml.tokens"]) == 49152
    assert all(type(s) is str for s in f.metadata["tokenizer.ggml.tokens"])
    assert all(type(x) is int for x in f.metadata["tokenizer.ggml.token_type"])


def test_default_model_data_is_zero_copy(default_pair):
    f, _ = default_pair
    t = f.tensors[len(f.tensors) // 2]
    assert isinstance(t.data, np.memmap) and not t.data.flags.writeable
    raw = np.memmap(f.path, dtype=np.uint8, mode="r")
    assert np.array_equal(t.data[:64], raw[t.data_offset:t.data_offset + 64])
    assert t.data_offset + t.n_bytes <= f.file_size


# ---- tiny files written by GGUFWriter ----------------------------------------------------------

SCALARS = {
    "t.u8": (V.UINT8, 200), "t.i8": (V.INT8, -100), "t.u16": (V.UINT16, 60000),
    "t.i16": (V.INT16, -30000), "t.u32": (V.UINT32, 4_000_000_000), "t.i32": (V.INT32, -2_000_000_000),
    "t.u64": (V.UINT64, 2**64 - 1), "t.i64": (V.INT64, -(2**63)), "t.f32": (V.FLOAT32, 0.5),
    "t.f64": (V.FLOAT64, 1e300), "t.bool_t": (V.BOOL, True), "t.bool_f": (V.BOOL, False),
    "t.str": (V.STRING, "héllo ✓ 🦙"), "t.str_empty": (V.STRING, ""),
}
ARRAYS = {
    "a.u8": (V.UINT8, [0, 1, 255]), "a.i8": (V.INT8, [-128, 127]), "a.u16": (V.UINT16, [65535, 1]),
    "a.i16": (V.INT16, [-32768, 5]), "a.u32": (V.UINT32, [7, 2**32 - 1]), "a.i32": (V.INT32, [-1, 2, -3]),
    "a.u64": (V.UINT64, [2**64 - 1, 0]), "a.i64": (V.INT64, [-(2**63), 2**63 - 1]),
    "a.f32": (V.FLOAT32, [0.25, -1.5, 3.0]), "a.f64": (V.FLOAT64, [1e-300, 2.5]),
    "a.bool": (V.BOOL, [True, False, True]), "a.str": (V.STRING, ["a", "", "ü b", "Ġthe"]),
}
NESTED = [[1, 2], [3], [4, 5, 6]]  # GGUFWriter writes arrays of arrays; GGUFReader flattens them


def write_tiny(path: Path, alignment: int | None = 64) -> Path:
    w = GGUFWriter(path, "llama")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    for key, (vtype, val) in SCALARS.items():
        w.add_key_value(key, val, vtype)
    for key, (sub, val) in ARRAYS.items():
        w.add_key_value(key, val, V.ARRAY, sub_type=sub)
    w.add_array("a.nested", NESTED)
    rng = np.random.default_rng(0)
    w.add_tensor("f32.vec", rng.standard_normal(7).astype(np.float32))
    w.add_tensor("f32.cube", rng.standard_normal((2, 3, 5)).astype(np.float32))
    w.add_tensor("f16.mat", rng.standard_normal((3, 10)).astype(np.float16))
    for qt in (T.Q8_0, T.Q4_0):
        w.add_tensor(f"{qt.name.lower()}.mat", quantize(rng.standard_normal((3, 64)).astype(np.float32), qt),
                     raw_dtype=qt)
    w.add_tensor("i32.vec", np.arange(5, dtype=np.int32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("alignment", [None, 1, 64, 256])
def test_tiny_file_matches_gguf_reader(tmp_path, alignment):
    path = write_tiny(tmp_path / "tiny.gguf", alignment)
    f, reader = GGUFFile(path), GGUFReader(path)
    meta = dict(f.metadata)
    assert meta.pop("a.nested") == NESTED
    assert reader.fields["a.nested"].contents() == [x for row in NESTED for x in row]
    oracle = oracle_metadata(reader)
    oracle.pop("a.nested")
    assert meta == oracle
    assert meta.get("general.alignment") == alignment
    for key, (vtype, val) in SCALARS.items():
        assert meta[key] == val and type(meta[key]) is type(val), key
    for key, (vtype, val) in ARRAYS.items():
        assert meta[key] == val and [type(x) for x in meta[key]] == [type(x) for x in val], key
    f.metadata.pop("a.nested")  # everything else, tensors included, must equal the oracle exactly
    for k in [k for k in reader.fields if k == "a.nested"]:
        del reader.fields[k]
    assert_matches_oracle(path, reader, f)
    types = {t.name: (t.tensor_type, t.shape) for t in f.tensors}
    assert types["f32.cube"] == (T.F32, (5, 3, 2)) and types["q4_0.mat"] == (T.Q4_0, (64, 3))
    assert types["q8_0.mat"] == (T.Q8_0, (64, 3)) and types["f16.mat"] == (T.F16, (10, 3))
    align = alignment or 32
    assert all(t.data_offset % align == 0 for t in f.tensors)


def raw_gguf(kv: bytes, n_kv: int, version: int = 3) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", version, 0, n_kv) + kv


def gguf_str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def test_empty_arrays_and_version_2(tmp_path):
    kv = (gguf_str("e.u32") + struct.pack("<IIQ", V.ARRAY, V.UINT32, 0)
          + gguf_str("e.str") + struct.pack("<IIQ", V.ARRAY, V.STRING, 0))
    for version in (2, 3):
        path = tmp_path / f"empty_v{version}.gguf"
        path.write_bytes(raw_gguf(kv, 2, version))
        f = GGUFFile(path)
        assert (f.version, f.metadata, f.tensors) == (version, {"e.u32": [], "e.str": []}, [])
        assert f.metadata == oracle_metadata(GGUFReader(path))


# ---- errors ------------------------------------------------------------------------------------

def expect_error(path: Path, *fragments: str) -> str:
    with pytest.raises(LowbitError) as ei:
        GGUFFile(path)
    msg = str(ei.value)
    assert "\n" not in msg and path.name in msg, msg
    for frag in fragments:
        assert frag in msg, msg
    return msg


@pytest.fixture
def tiny(tmp_path):
    path = write_tiny(tmp_path / "src.gguf")
    return path, path.read_bytes(), GGUFReader(path)


def test_wrong_magic_empty_and_missing(tmp_path, tiny):
    _, data, _ = tiny
    bad = tmp_path / "bad_magic.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    expect_error(bad, "not a GGUF file")
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    expect_error(empty, "not a GGUF file")
    expect_error(tmp_path / "missing.gguf", "cannot open")


def test_version_and_endianness(tmp_path, tiny):
    _, data, _ = tiny
    for version, frag in ((1, "unsupported GGUF version 1"), (4, "unsupported GGUF version 4")):
        p = tmp_path / f"v{version}.gguf"
        p.write_bytes(data[:4] + struct.pack("<I", version) + data[8:])
        expect_error(p, frag)
    p = tmp_path / "big.gguf"
    p.write_bytes(data[:4] + struct.pack(">I", 3) + data[8:])
    expect_error(p, "big-endian")


def test_truncated_at_named_points(tmp_path, tiny):
    _, data, reader = tiny
    kv_start = 24
    ti_start = reader.tensors[0].field.offset
    cuts = {
        "header": 10, "KV section start": kv_start + 3, "inside the KV section": (kv_start + ti_start) // 2,
        "inside tensor infos": ti_start + 5, "tensor infos end": reader.data_offset - 1,
    }
    for where, cut in cuts.items():
        p = tmp_path / f"cut_{cut}.gguf"
        p.write_bytes(data[:cut])
        msg = expect_error(p, "truncated")
        assert ("truncated GGUF header" in msg) or (where == "tensor infos end" and "truncated file" in msg), msg
    last = reader.tensors[-1]
    p = tmp_path / "cut_data.gguf"
    p.write_bytes(data[:last.data_offset + 10])
    expect_error(p, f"truncated file: tensor {last.name} ({last.tensor_type.name}) ends at byte "
                    f"{last.data_offset + last.n_bytes}, but the file has {last.data_offset + 10} bytes")


def test_truncated_anywhere_is_a_lowbit_error(tmp_path, tiny):
    _, data, reader = tiny
    last = reader.tensors[-1]
    p = tmp_path / "cut.gguf"
    for cut in range(last.data_offset + last.n_bytes):  # every byte before the data is complete
        p.write_bytes(data[:cut])
        expect_error(p)


def test_corrupted_header_never_leaks_other_errors(tmp_path, tiny):
    _, data, reader = tiny
    rng = random.Random(1)
    p = tmp_path / "fuzz.gguf"
    for _ in range(400):
        buf = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            buf[rng.randrange(4, reader.data_offset)] = rng.randrange(256)
        p.write_bytes(bytes(buf))
        try:
            GGUFFile(p)
        except LowbitError as e:
            assert "\n" not in str(e) and p.name in str(e)


def test_unknown_tensor_type_id(tmp_path, tiny):
    _, data, reader = tiny
    t = reader.tensors[2]
    name_len, _, _, dims, raw_dtype, _ = t.field.parts
    type_off = t.field.offset + 8 + int(name_len[0]) + 4 + 8 * len(dims)
    assert struct.unpack_from("<I", data, type_off)[0] == int(raw_dtype[0])
    p = tmp_path / "bad_type.gguf"
    p.write_bytes(data[:type_off] + struct.pack("<I", 99) + data[type_off + 4:])
    expect_error(p, f"tensor {t.name} has unknown tensor type id 99")


def test_unknown_value_type(tmp_path, tiny):
    _, data, reader = tiny
    field = reader.fields["t.u32"]
    type_off = field.offset + 8 + len("t.u32")
    assert struct.unpack_from("<I", data, type_off)[0] == V.UINT32
    p = tmp_path / "bad_value_type.gguf"
    p.write_bytes(data[:type_off] + struct.pack("<I", 77) + data[type_off + 4:])
    expect_error(p, "unknown metadata value type 77", "t.u32")
