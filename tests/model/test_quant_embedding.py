"""A GGUF token embedding stays quantized; a compiled decode step must not freeze its batch size."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tokenmill.model.quant import GGMLWeight
from tokenmill.model.quant_linear import QuantEmbedding


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1])
def test_compiled_lookup_serves_every_batch_size(qtype, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    torch.manual_seed(0)
    table = torch.randn(50, 256).numpy()
    raw = torch.from_numpy(np.ascontiguousarray(gguf.quants.quantize(table, qtype)))
    embed = QuantEmbedding(GGMLWeight(raw, qtype, (50, 256)), torch.float32)
    expected = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), qtype))

    compiled = torch.compile(embed, dynamic=True)
    compiled(torch.tensor([1]))  # batch 1 is specialized, as in the runner's warm-up
    compiled(torch.tensor([3, 4]))
    with torch.compiler.set_stance("fail_on_recompile"):
        for ids in ([7, 0, 49], list(range(40))):
            torch.testing.assert_close(compiled(torch.tensor(ids)), expected[ids])
