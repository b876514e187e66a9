"""GGUF parsing and ggml dequantization, checked against the gguf package's reference code."""

from __future__ import annotations

import lzma
import math
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as V

from tokenmill.errors import ModelFileError
from tokenmill.model.gguf_file import GGUFFile, read_gguf_metadata
from tokenmill.model.quant import SUPPORTED_QTYPES, GGMLWeight, dequantize

QUANTIZED = [
    Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4
]  # fmt: skip
# gguf.quants.quantize supports these
PY_QUANTIZABLE = [Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
# Byte offsets of the fp16 scale fields (d, dmin) within each block.
F16_FIELDS = {
    Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2),
    Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,),
    Q.MXFP4: (),  # an E8M0 exponent byte: every bit pattern is a finite scale
}  # fmt: skip
# Logical shapes (torch order); (520, 512) spans more than one dequantization chunk.
SHAPES = [(256,), (3, 256), (2, 3, 256), (520, 512)]
VOCAB_GGUF_XZ = (
    Path(__file__).parent.parent / "data" / "tokenizer-vectors" / "ggml-vocab-llama-spm.gguf.xz"
)


def random_blocks(qtype: Q, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random block bytes (every bit pattern occurs) with finite fp16 scales in [-1, 1]."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n_blocks = math.prod(shape) // block_size
    blocks = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for start in F16_FIELDS[qtype]:
        scales = rng.uniform(-1, 1, n_blocks).astype(np.float16)
        blocks[:, start : start + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(*shape[:-1], shape[-1] // block_size * type_size)


def as_llama_cpp_writes_q4_k(raw: torch.Tensor, rng: np.random.Generator) -> None:
    """Q4_K block bytes changed in place as llama.cpp writes them: a block's largest 6-bit scale
    and min are 63 (here its first ones), and d and dmin powers of two, so that d x 63 / 63 is d
    exactly and the tile layout's scales take the compact form (`compact_tile_scales`)."""
    blocks = raw.view(-1, 144)
    blocks[:, 4] |= 63
    blocks[:, 8] |= 63
    powers = torch.from_numpy(2.0 ** -rng.integers(4, 12, (blocks.shape[0], 2)))
    blocks[:, :4] = powers.half().view(torch.uint8).view(-1, 4)


def write_gguf(
    path: Path,
    tensors: dict[str, np.ndarray | tuple[np.ndarray, Q]],
    alignment: int | None = None,
    kv: Sequence[tuple[str, Any, V, V | None]] = (),
) -> Path:
    """Write a GGUF file; a tensor given as (uint8 bytes, qtype) is stored raw in that type."""
    writer = gguf.GGUFWriter(path, "test")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, value, vtype, sub_type in kv:
        writer.add_key_value(key, value, vtype, sub_type)
    for name, tensor in tensors.items():
        if isinstance(tensor, tuple):
            writer.add_tensor(name, tensor[0], raw_dtype=tensor[1])
        else:
            writer.add_tensor(name, tensor)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def reference(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    return torch.from_numpy(np.array(gguf.quants.dequantize(raw, qtype), dtype=np.float32))


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Bit-exact equality in float32 (NaN-safe: compares bit patterns)."""
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    assert torch.equal(actual.view(torch.int32), expected.view(torch.int32))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[np.ndarray, Q]]]:
    """One file holding every supported type in several shapes; returns it and the raw data
    written."""
    rng = np.random.default_rng(0)
    raw: dict[str, tuple[np.ndarray, Q]] = {}
    for shape in SHAPES:
        dense = rng.standard_normal(shape).astype(np.float32)
        raw[f"F32{shape}"] = (dense, Q.F32)
        raw[f"F16{shape}"] = (dense.astype(np.float16), Q.F16)
        for qtype in PY_QUANTIZABLE:
            raw[f"{qtype.name}{shape}.quantized"] = (gguf.quants.quantize(dense, qtype), qtype)
        for qtype in QUANTIZED:
            raw[f"{qtype.name}{shape}.random"] = (random_blocks(qtype, shape, rng), qtype)
    tensors = {
        name: (data if qtype in (Q.F32, Q.F16) else (data, qtype))
        for name, (data, qtype) in raw.items()
    }
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "all-types.gguf", tensors)
    return path, raw


def test_tensor_directory_matches_gguf_reader(model) -> None:
    path, raw = model
    f = GGUFFile(path)
    reader = gguf.GGUFReader(path)
    assert list(f.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        info = f.tensors[t.name]
        assert info.shape == tuple(reversed(t.shape.tolist()))
        assert (info.qtype, info.offset, info.nbytes) == (t.tensor_type, t.data_offset, t.n_bytes)


def test_every_tensor_dequantizes_bit_exactly(model) -> None:
    path, raw = model
    f = GGUFFile(path)
    for name, (data, qtype) in raw.items():
        loaded = f.load(name)
        shape = f.tensors[name].shape
        if qtype in (Q.F32, Q.F16, Q.BF16):
            assert isinstance(loaded, torch.Tensor) and loaded.shape == shape
            dense = loaded.float()
        else:
            assert (
                isinstance(loaded, GGMLWeight) and loaded.shape == shape and loaded.qtype == qtype
            )
            assert loaded.data.dtype == torch.uint8 and loaded.data.shape[0] == math.prod(
                shape[:-1]
            )
            dense = loaded.dequantize()
        assert_same(dense, reference(data, qtype).reshape(shape))


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda q: q.name)
def test_row_slices_and_output_dtype(model, qtype: Q) -> None:
    path, raw = model
    weight = GGUFFile(path).load(f"{qtype.name}(520, 512).random")
    full = weight.dequantize()
    rows = GGMLWeight(weight.data[7:19], qtype, (12, 512)).dequantize()
    assert_same(rows, full[7:19])
    assert torch.equal(weight.dequantize(torch.float16), full.half())


def _mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of path (from /proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0]:
            inside = line.endswith(str(path))
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_released_pages_leave_memory_and_read_back_unchanged(model) -> None:
    path, raw = model
    f = GGUFFile(path)
    weights = [w for w in map(f.load, raw) if isinstance(w, GGMLWeight)]
    copies = [w.data.clone() for w in weights]  # touches every page
    touched = _mapped_rss_kib(path)
    for w in weights:
        w.release()
    assert _mapped_rss_kib(path) < touched // 2
    assert all(torch.equal(w.data, c) for w, c in zip(weights, copies))  # read again from the file


def test_dequantize_function_and_supported_set() -> None:
    assert SUPPORTED_QTYPES == {Q.F32, Q.F16, Q.BF16, *QUANTIZED}
    raw = random_blocks(Q.Q4_K, (2, 256), np.random.default_rng(1))
    assert_same(dequantize(torch.from_numpy(raw), Q.Q4_K, (2, 256)), reference(raw, Q.Q4_K))
    with pytest.raises(ValueError, match="do not encode"):
        dequantize(torch.from_numpy(raw), Q.Q4_K, (3, 256))
    with pytest.raises(ValueError, match="unsupported quantization type IQ2_XXS"):
        dequantize(torch.zeros(66, dtype=torch.uint8), Q.IQ2_XXS, (256,))


def test_dense_tensors_are_views_of_the_file(tmp_path: Path) -> None:
    ints = np.arange(12, dtype=np.int32).reshape(3, 4)
    path = write_gguf(tmp_path / "dense.gguf", {"w": np.ones((2, 3), np.float32), "i": ints})
    f = GGUFFile(path)
    a, b = f.load("w"), f.load("w")
    assert a.shape == (2, 3) and a.dtype == torch.float32
    assert a.data_ptr() == b.data_ptr()  # both views of the same mapped bytes
    a.zero_()  # copy-on-write mapping: writable, and the file stays untouched
    assert torch.equal(GGUFFile(path).load("w"), torch.ones(2, 3))
    assert torch.equal(f.load("i"), torch.from_numpy(ints))


@pytest.mark.parametrize("alignment", [1, 64])
def test_custom_alignment(tmp_path: Path, alignment: int) -> None:
    rng = np.random.default_rng(2)
    odd = np.arange(3, dtype=np.int8)  # with alignment 1 the next tensor starts at an odd offset
    dense = rng.standard_normal((2, 5)).astype(np.float32)
    q = random_blocks(Q.Q6_K, (2, 256), rng)
    path = write_gguf(
        tmp_path / "aligned.gguf", {"odd": odd, "dense": dense, "q": (q, Q.Q6_K)}, alignment
    )
    f = GGUFFile(path)
    assert f.metadata["general.alignment"] == alignment
    assert all(info.offset % alignment == 0 for info in f.tensors.values())
    assert torch.equal(f.load("odd"), torch.from_numpy(odd))
    assert torch.equal(f.load("dense"), torch.from_numpy(dense))
    assert_same(f.load("q").dequantize(), reference(q, Q.Q6_K))


METADATA: list[tuple[str, Any, V, V | None]] = [
    ("u8", 255, V.UINT8, None),
    ("i8", -128, V.INT8, None),
    ("u16", 65535, V.UINT16, None),
    ("i16", -32768, V.INT16, None),
    ("u32", 2**32 - 1, V.UINT32, None),
    ("i32", -(2**31), V.INT32, None),
    ("u64", 2**64 - 1, V.UINT64, None),
    ("i64", -(2**63), V.INT64, None),
    ("f32", 0.1, V.FLOAT32, None),
    ("f64", math.pi, V.FLOAT64, None),
    ("yes", True, V.BOOL, None),
    ("no", False, V.BOOL, None),
    ("text", "plain ascii", V.STRING, None),
    ("unicode", "héllo wörld ✓ 日本語 🚀", V.STRING, None),
    ("empty", "", V.STRING, None),
    ("tokens", ["<s>", "", "▁the", "日本", "🚀", "a\nb"], V.ARRAY, None),
    ("ints", [1, -2, 3], V.ARRAY, V.INT32),
    ("u64s", [0, 2**64 - 1], V.ARRAY, V.UINT64),
    ("i16s", [-5, 7], V.ARRAY, V.INT16),
    ("floats", [0.5, -1.25, 2.0**127], V.ARRAY, V.FLOAT32),
    ("f64s", [math.e], V.ARRAY, V.FLOAT64),
    ("bools", [True, False, True], V.ARRAY, V.BOOL),
]


def test_metadata_round_trip(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "meta.gguf", {}, kv=METADATA)
    meta = GGUFFile(path).metadata
    reader = gguf.GGUFReader(path)
    assert meta == {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(meta) == ["general.architecture", *(key for key, *_ in METADATA)]
    expected = {key: value for key, value, *_ in METADATA}
    expected["f32"] = float(np.float32(0.1))
    assert meta == {"general.architecture": "test", **expected}
    assert all(type(meta[key]) is type(value) for key, value in expected.items())
    assert read_gguf_metadata(path) == meta


def test_nested_arrays(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "nested.gguf", {}, kv=[("nested", [[1, 2], [3]], V.ARRAY, None)])
    assert GGUFFile(path).metadata["nested"] == [[1, 2], [3]]


def test_real_vocab_file_matches_gguf_reader(tmp_path: Path) -> None:
    vocab = tmp_path / "ggml-vocab-llama-spm.gguf"
    vocab.write_bytes(lzma.decompress(VOCAB_GGUF_XZ.read_bytes()))
    reader = gguf.GGUFReader(vocab)
    expected = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert read_gguf_metadata(vocab) == expected


# --- malformed files ---------------------------------------------------------------------


@pytest.fixture()
def small(tmp_path: Path) -> Path:
    """A valid file with a string array, a quantized tensor and a dense tensor, to damage."""
    rng = np.random.default_rng(3)
    tensors = {
        "blk.0.q": (random_blocks(Q.Q4_0, (2, 256), rng), Q.Q4_0),
        "blk.0.dense": rng.standard_normal((2, 48)).astype(np.float32),
    }
    kv = [("tokenizer.ggml.tokens", [f"tok{i}" for i in range(100)], V.ARRAY, None)]
    return write_gguf(tmp_path / "small.gguf", tensors, kv=kv)


def open_error(path: Path, tensor: str | None = None) -> str:
    """Open (and with ``tensor``, load) the file; return the one-line ModelFileError message."""
    with pytest.raises(ModelFileError) as info:
        f = GGUFFile(path)
        if tensor is not None:
            f.load(tensor)
    message = str(info.value)
    assert "\n" not in message and str(path) in message
    if tensor is not None:
        assert f"'{tensor}'" in message
    return message


def patch(path: Path, offset: int, value: bytes) -> None:
    data = bytearray(path.read_bytes())
    data[offset : offset + len(value)] = value
    path.write_bytes(bytes(data))


def type_field(path: Path, tensor: str, n_dims: int = 2) -> int:
    """Byte offset of the ggml type number in ``tensor``'s info record."""
    name = tensor.encode()
    return (
        path.read_bytes().index(struct.pack("<Q", len(name)) + name)
        + 8
        + len(name)
        + 4
        + 8 * n_dims
    )


def test_truncated_tensor_data(small: Path) -> None:
    info = GGUFFile(small).tensors["blk.0.dense"]
    end = info.offset + info.nbytes
    small.write_bytes(small.read_bytes()[: end - 100])
    message = open_error(small)
    assert (
        f"truncated: tensor data ends at byte {end} but the file has {end - 100} bytes" in message
    )
    assert "'blk.0.dense'" in message


@pytest.mark.parametrize("keep", [6, 20, 40, 500])
def test_truncated_header(small: Path, keep: int) -> None:
    small.write_bytes(small.read_bytes()[:keep])
    assert "truncated: header needs byte" in open_error(small)


def test_cut_in_half(small: Path) -> None:
    small.write_bytes(small.read_bytes()[: small.stat().st_size // 2])
    assert "truncated" in open_error(small)


def test_wrong_magic(small: Path) -> None:
    patch(small, 0, b"GGML")
    assert "not a GGUF file (magic b'GGML')" in open_error(small)


@pytest.mark.parametrize("version", [1, 4])
def test_unsupported_version(small: Path, version: int) -> None:
    patch(small, 4, struct.pack("<I", version))
    assert f"unsupported GGUF version {version}" in open_error(small)


def test_unknown_ggml_type(small: Path) -> None:
    patch(small, type_field(small, "blk.0.q"), struct.pack("<I", 99))
    assert "unknown ggml type 99" in open_error(small, "blk.0.q")


@pytest.mark.parametrize("qtype", [Q.IQ2_XXS, Q.TQ1_0], ids=lambda q: q.name)
def test_known_but_unsupported_type(small: Path, qtype: Q) -> None:
    patch(small, type_field(small, "blk.0.q"), struct.pack("<I", qtype))
    f = GGUFFile(small)  # opening works: the type and its size are known
    assert f.tensors["blk.0.q"].qtype == qtype
    assert f.load("blk.0.dense").shape == (2, 48)
    message = open_error(small, "blk.0.q")
    assert f"unsupported quantization type {qtype.name} (supported: " in message


def test_row_length_not_a_multiple_of_the_block_size(small: Path) -> None:
    patch(small, type_field(small, "blk.0.dense"), struct.pack("<I", Q.Q8_0))
    assert "row length 48 is not a multiple of the Q8_0 block size 32" in open_error(
        small, "blk.0.dense"
    )


def test_unknown_metadata_value_type(small: Path) -> None:
    key = b"tokenizer.ggml.tokens"
    patch(small, small.read_bytes().index(key) + len(key), struct.pack("<I", 13))
    assert "metadata 'tokenizer.ggml.tokens' has unknown value type 13" in open_error(small)


def test_invalid_utf8_in_string_array(small: Path) -> None:
    patch(small, small.read_bytes().index(b"tok42"), b"\xff")
    assert "metadata 'tokenizer.ggml.tokens'[42]: invalid UTF-8" in open_error(small)


def test_missing_tensor(small: Path) -> None:
    assert "no such tensor" in open_error(small, "nope")


def test_empty_file_directory_and_missing_file(tmp_path: Path) -> None:
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    assert "empty file" in open_error(empty)
    assert "is a directory" in open_error(tmp_path)
    assert "cannot open" in open_error(tmp_path / "missing.gguf")
