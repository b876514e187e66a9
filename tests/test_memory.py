"""Process-wide memory settings that `import tokenmill` makes."""

from __future__ import annotations

import ctypes.util
import subprocess
import sys

import pytest

PROBE = """
import ctypes, sys
import torch
if sys.argv[1] == "tokenmill":
    import tokenmill  # noqa: F401
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks",
                                                     "hblkhd", "usmblks", "fsmblks", "uordblks",
                                                     "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
before = libc.mallinfo2().hblks
kept = torch.empty(20 << 20, dtype=torch.uint8)
print(libc.mallinfo2().hblks - before)
"""


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or ctypes.util.find_library("c") != "libc.so.6",
    reason="glibc's allocator only",
)
def test_multi_megabyte_tensors_come_from_the_heap_not_fresh_mappings() -> None:
    """With 2 MB pages, PyTorch's large temporaries were each mapped anew and faulted in on every
    step; after `import tokenmill` glibc serves them from its heap. A fresh interpreter each, since
    glibc's own threshold rises once a mapped block of that size has been freed."""

    def mapped_blocks_added(imports: str) -> int:
        result = subprocess.run(
            [sys.executable, "-c", PROBE, imports],
            capture_output=True,
            text=True,
            check=True,
            env={"THP_MEM_ALLOC_ENABLE": "1", "PATH": ""},
        )
        return int(result.stdout.split()[-1])

    assert mapped_blocks_added("torch only") == 1  # the probe sees what it is meant to see
    assert mapped_blocks_added("tokenmill") == 0
