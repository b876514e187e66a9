"""Bad model files fail with one line naming the file (and tensor) and the problem."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from tokenmill.cli.main import main
from tokenmill.errors import ModelFileError
from tokenmill.model.loader import load_model


def _tiny_gguf(path: Path, arch: str = "llama", experts: int = 0) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    if experts:
        writer.add_expert_count(experts)
    writer.add_embedding_length(32)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.ones((8, 32), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((32, 32), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _truncated(tmp: Path) -> Path:
    path = _tiny_gguf(tmp / "model.gguf")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 1000])
    return path


def _wrong_magic(tmp: Path) -> Path:
    path = _tiny_gguf(tmp / "model.gguf")
    data = bytearray(path.read_bytes())
    data[:4] = b"GGML"
    path.write_bytes(bytes(data))
    return path


def _unknown_qtype(tmp: Path) -> Path:
    path = _tiny_gguf(tmp / "model.gguf")
    data = bytearray(path.read_bytes())
    name = b"blk.0.attn_q.weight"
    # tensor info: name, n_dims (u32), dims (u64 each), type (u32), offset (u64)
    at = data.index(name) + len(name) + 4 + 2 * 8
    assert int.from_bytes(data[at : at + 4], "little") == gguf.GGMLQuantizationType.F32
    data[at : at + 4] = (99).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def _unsupported_arch(tmp: Path) -> Path:
    return _tiny_gguf(tmp / "model.gguf", arch="mamba")


def _hybrid_gguf(tmp: Path) -> Path:
    return _tiny_gguf(tmp / "model.gguf", arch="qwen3next")


def _gemma4_moe_gguf(tmp: Path) -> Path:
    return _tiny_gguf(tmp / "model.gguf", arch="gemma4", experts=4)


def _gemma4_moe_hf(tmp: Path) -> Path:
    folder = tmp / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(
        '{"model_type": "gemma4_text", "enable_moe_block": true, "num_experts": 4, '
        '"top_k_experts": 2, "moe_intermediate_size": 8}'
    )
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    return folder


def _hybrid_hf(tmp: Path) -> Path:
    folder = tmp / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "qwen3_next"}')
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    return folder


def _missing_config(tmp: Path) -> Path:
    folder = tmp / "hf"
    folder.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(folder / "model.safetensors"))
    return folder


def _pickle_only(tmp: Path) -> Path:
    folder = tmp / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    torch.save({"w": torch.zeros(2)}, folder / "pytorch_model.bin")
    return folder


def _pickle_file(tmp: Path) -> Path:
    path = tmp / "model.pt"
    torch.save({"w": torch.zeros(2)}, path)
    return path


CASES = {
    "truncated": (_truncated, "truncated"),
    "wrong magic": (_wrong_magic, "not a GGUF file"),
    "unknown quant type": (_unknown_qtype, "99"),
    "unsupported architecture": (_unsupported_arch, "unsupported architecture 'mamba'"),
    "linear-attention GGUF": (_hybrid_gguf, "recurrent state per request"),
    "linear-attention HF directory": (_hybrid_hf, "recurrent state per request"),
    "Gemma 4 MoE GGUF": (_gemma4_moe_gguf, "mixture-of-experts block"),
    "Gemma 4 MoE HF directory": (_gemma4_moe_hf, "mixture-of-experts block"),
    "missing config.json": (_missing_config, "config.json is missing"),
    "pickle-only directory": (_pickle_only, "pickle"),
    "pickle file": (_pickle_file, "pickle"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_file_is_one_line_error(case: str, tmp_path: Path, capsys) -> None:
    make, expected = CASES[case]
    path = make(tmp_path)
    with pytest.raises(ModelFileError) as info:
        load_model(path, progress=False)
    message = str(info.value)
    assert "\n" not in message
    assert str(path) in message
    assert expected in message

    assert main(["generate", "--model", str(path), "hello"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and expected in err


def test_unknown_qtype_names_the_tensor(tmp_path: Path) -> None:
    with pytest.raises(ModelFileError) as info:
        load_model(_unknown_qtype(tmp_path), progress=False)
    assert "blk.0.attn_q.weight" in str(info.value)
