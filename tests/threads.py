"""Running a test's kernels on a given number of torch threads."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

# The kernels split a call's rows, columns and attention tasks between threads: 2 halves them, 3
# leaves uneven shares. Test workers run on fewer threads (tests/conftest.py), so tests of how
# kernels share their work set these themselves.
THREAD_COUNTS = (1, 2, 3)


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
