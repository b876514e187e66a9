"""GGUF file access (placeholder API: metadata only; tensors to come)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf

from tokenmill.errors import ModelFileError


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """Return the GGUF key/value metadata as plain Python values (str, int, float, bool, lists)."""
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:  # noqa: BLE001 - reported as one line naming the file
        raise ModelFileError(path, f"not a readable GGUF file ({exc})") from exc
    out: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF."):
            continue
        out[name] = field.contents()
    return out
