"""A request and the sequences generated for it.

A `Request` is what a user asked for: a prompt and its sampling parameters. It is generated as n
`Sequence`s (n > 1 for parallel sampling), and a sequence is what the scheduler and the KV cache
manager work on: its tokens, its status and how many of its tokens are computed. A sequence also
holds its output state (text so far, logprobs, finish reason), which the `OutputProcessor` updates.

Besides its tokens, a sequence carries the chain hashes of its full blocks of tokens
(`block_hashes`), which the prefix cache uses as keys. They are extended as tokens arrive, so a
step costs O(new full blocks) of hashing, and a preempted sequence keeps them for its re-run.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from dataclasses import dataclass, field

import torch
from llguidance import LLMatcher

from tokenmill.engine.outputs import TokenLogprobs
from tokenmill.sample import SamplingParams
from tokenmill.tokenizer import IncrementalDetokenizer

BlockHash = bytes
"""SHA-256 digest naming a block's contents and everything before it in its sequence."""

_ROOT_HASH: BlockHash = bytes(32)


def hash_block_tokens(
    parent: BlockHash | None,
    token_ids: list[int],
    extra_key: str | None,
    first_output: int | None = None,
) -> BlockHash:
    """Chain hash of one full block: (parent hash, token ids, extra key, and where output tokens
    are keyed apart from prompt tokens, the index of its first output token).

    SHA-256 rather than Python's `hash()`: a collision would make one request attend to another
    request's KV cache (wrong outputs, and a leak between users). With 64-bit `hash()` such
    collisions can be crafted; with SHA-256 they are out of reach. It is also stable across
    processes, and cheap next to a step (see the tuning log).
    The encoding is unambiguous for a fixed block size: 32-byte parent, 4 bytes per token, then
    a tag byte telling "no extra key" from any extra key, including "", then for a block of
    output tokens keyed apart, a 4-byte index after a byte that no key's UTF-8 holds.
    """
    data = (parent or _ROOT_HASH) + struct.pack(f"<{len(token_ids)}I", *token_ids)
    data += b"\0" if extra_key is None else b"\1" + extra_key.encode()
    if first_output is not None:
        data += b"\xff" + struct.pack("<I", first_output)
    return hashlib.sha256(data).digest()


class SequenceStatus(enum.Enum):
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
        SequenceStatus.FINISHED_STOPPED,
        SequenceStatus.FINISHED_LENGTH,
        SequenceStatus.FINISHED_ABORTED,
        SequenceStatus.FINISHED_ERROR,
    }
)

# The status a sequence ends in, by its finish reason (`CompletionOutput.finish_reason`).
FINISHED_STATUS = {
    "stop": SequenceStatus.FINISHED_STOPPED,
    "length": SequenceStatus.FINISHED_LENGTH,
    "abort": SequenceStatus.FINISHED_ABORTED,
    "error": SequenceStatus.FINISHED_ERROR,
}


@dataclass(eq=False)
class Sequence:
    """One generated sequence: a prompt and the tokens generated after it.

    `extra_key` is anything besides the tokens that changes the KV contents or must isolate the
    cache (LoRA adapter id, a per-user cache salt); it enters every block hash, so sequences with
    different keys never share blocks. With `outputs_keyed_apart` (where the model computes prompt
    and output tokens with different products: `quant_linear.prompts_apart`), a block holding
    output tokens is keyed apart from a prompt of the same tokens: a later prompt never takes the
    K/V its tokens had as output. Add output tokens only through `append_output_token`,
    which keeps `all_token_ids` and `block_hashes` in step with `output_token_ids`.

    The output fields are set for every sequence of a `Request` (the `InputProcessor` builds
    them); a sequence built alone, as the scheduler's tests build them, has none.
    """

    seq_id: str  # the request's id, with "#<index>" appended when the request has n > 1
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    arrival_time: float = 0.0
    priority: int = 0
    extra_key: str | None = None
    block_size: int = 16
    tenant: str = ""  # who sent it, for the fair policy's shares ("" : anonymous)
    outputs_keyed_apart: bool = False
    # scheduling state
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # speculative decoding: tokens drafted to follow this sequence, verified in its next step
    draft_token_ids: list[int] = field(default_factory=list)
    max_drafts: int | None = None  # prompt lookup's next drafts: one more than last accepted
    draft_misses: int = 0  # verifications in a row that accepted no draft
    draft_pause: int = 0  # steps to decode without drafting before drafting again
    draft_computed: int = 0  # leading tokens whose KV the draft model holds (its own pool)
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until scheduled
    status: SequenceStatus = SequenceStatus.WAITING
    num_preemptions: int = 0
    block_hashes: list[BlockHash] = field(init=False, repr=False)
    _all_token_ids: list[int] = field(init=False, repr=False)
    # output state
    request: Request | None = field(default=None, repr=False)
    index: int = 0  # its place among the request's sequences
    detokenizer: IncrementalDetokenizer | None = field(default=None, repr=False)
    generator: torch.Generator | None = field(default=None, repr=False)  # for a seeded request
    # llguidance's matcher of a constrained request (structured outputs), fed every output token
    matcher: LLMatcher | None = field(default=None, repr=False)
    text: str = ""
    num_emitted_chars: int = 0  # characters of `text` already handed out in outputs
    new_token_ids: list[int] = field(default_factory=list)  # tokens not yet handed out
    logprobs: list[TokenLogprobs] | None = None  # None unless the request asked for logprobs
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None  # see `CompletionOutput.finish_reason`
    stop_reason: str | int | None = None

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
            first_output = self.num_prompt_tokens - start
            keyed_apart = self.outputs_keyed_apart and first_output < size
            self.block_hashes.append(
                hash_block_tokens(
                    parent,
                    tokens[start : start + size],
                    self.extra_key,
                    max(first_output, 0) if keyed_apart else None,
                )
            )


@dataclass(eq=False)
class Request:
    """What a user asked for, and the sequences generated for it (one, or n for parallel sampling).

    `max_tokens` and `stop_token_ids` are resolved once for all of its sequences: the tokens each
    may generate (its params' max_tokens, or the room the prompt leaves in the context), and the
    token ids that end one (its params' stop_token_ids, plus the model's EOS unless ignore_eos).
    """

    request_id: str
    prompt: str | None  # None when the prompt came as token ids
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    stop_token_ids: frozenset[int]
    sequences: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # one per prompt token, if asked
    error: str | None = None  # why it failed, once a sequence finished with "error"
    error_is_input: bool = False  # the request's own input made it fail (its output constraint)

    @property
    def finished(self) -> bool:
        return all(seq.finish_reason is not None for seq in self.sequences)
