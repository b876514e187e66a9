"""A generation request as the scheduler and the KV cache manager see it.

Besides its tokens, a request carries the chain hashes of its full blocks of tokens
(`block_hashes`), which the prefix cache uses as keys. They are extended as tokens arrive, so
a step costs O(new full blocks) of hashing, and a preempted request keeps them for its re-run.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any

BlockHash = bytes
"""SHA-256 digest naming a block's contents and everything before it in its sequence."""

_ROOT_HASH: BlockHash = bytes(32)


def hash_block_tokens(parent: BlockHash | None, token_ids: list[int], extra_key: str | None) -> BlockHash:
    """Chain hash of one full block: (parent hash, token ids, extra key).

    SHA-256 rather than Python's `hash()`: a collision would make one request attend to another
    request's KV cache (wrong outputs, and a leak between users). With 64-bit `hash()` such
    collisions can be crafted; with SHA-256 they are out of reach. It is also stable across
    processes. The cost is ~1 us per block of 16 tokens.
    The encoding is unambiguous for a fixed block size: 32-byte parent, 4 bytes per token, then
    a tag byte telling "no extra key" from any extra key, including "".
    """
    data = (parent or _ROOT_HASH) + struct.pack(f"<{len(token_ids)}I", *token_ids)
    data += b"\0" if extra_key is None else b"\1" + extra_key.encode()
    return hashlib.sha256(data).digest()


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED


_FINISHED = frozenset(
    {
        RequestStatus.FINISHED_STOPPED,
        RequestStatus.FINISHED_LENGTH,
        RequestStatus.FINISHED_ABORTED,
        RequestStatus.FINISHED_ERROR,
    }
)


@dataclass(eq=False)
class Request:
    """One sequence to generate.

    `extra_key` is anything besides the tokens that changes the KV contents or must isolate the
    cache (LoRA adapter id, a per-user cache salt); it enters every block hash, so requests with
    different keys never share blocks. Add output tokens only through `append_output_token`,
    which keeps `all_token_ids` and `block_hashes` in step with `output_token_ids`.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any
    arrival_time: float
    priority: int = 0
    extra_key: str | None = None
    block_size: int = 16
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until the scheduler sets it
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(init=False, repr=False)
    _all_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        self._all_token_ids = self.prompt_token_ids + self.output_token_ids
        self.block_hashes = []
        self._hash_new_full_blocks()

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens; one list grown in place (read it, don't mutate it)."""
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if len(self._all_token_ids) % self.block_size == 0:
            self._hash_new_full_blocks()

    def _hash_new_full_blocks(self) -> None:
        size, tokens = self.block_size, self._all_token_ids
        for start in range(len(self.block_hashes) * size, len(tokens) - size + 1, size):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block_tokens(parent, tokens[start : start + size], self.extra_key))
