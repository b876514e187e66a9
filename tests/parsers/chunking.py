"""Ways of cutting an output into the pieces a stream delivers."""

from __future__ import annotations

import random
from collections.abc import Iterator


def splits(text: str) -> Iterator[list[str]]:
    """Every cut in two, one character at a time, and seeded random cuts in up to 8 pieces."""
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
    yield list(text)
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(2, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
