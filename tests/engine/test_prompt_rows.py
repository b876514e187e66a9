"""Prompt and output tokens in a step: the scheduler never puts both in one sequence's chunk, the
step lays out output chunks first and counts each chunk's prompt tokens, the model runner checks
that layout, and where the model computes the two kinds apart (`quant_linear.prompt_rows`) the
prefix cache keys a block of output tokens apart from a prompt of the same tokens."""

from __future__ import annotations

import pytest

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.model_runner import first_prompt_row
from tokenmill.engine.request import Request, Sequence
from tokenmill.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from tokenmill.engine.step_batch import StepBatch
from tokenmill.sample import SamplingParams


def _sequence(seq_id: str, prompt: list[int]) -> Sequence:
    """A sequence of a request of its own, blocks of 4 tokens."""
    params = SamplingParams(temperature=0, max_tokens=64)
    request = Request(seq_id, None, prompt, params, 64, frozenset())
    seq = Sequence(seq_id, prompt, params, block_size=4, request=request)
    request.sequences.append(seq)
    return seq


def _run_step(scheduler: Scheduler, kv: KVCacheManager) -> StepBatch:
    """One step as the engine runs it, without a model: each sampling sequence gets token 7."""
    out = scheduler.schedule()
    batch = StepBatch.build(out, kv)
    for seq, n in zip(out.sequences, out.num_new_tokens):
        seq.num_computed_tokens += n
    for seq in batch.sampling_seqs:
        seq.append_output_token(7)
    return batch


def test_a_preempted_sequence_recomputes_its_prompt_then_its_output_in_other_chunks() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=64), kv)
    old = _sequence("old", list(range(1, 11)))
    scheduler.add_sequence(old)
    for _ in range(6):  # the prompt, then 5 decodes
        _run_step(scheduler, kv)
    assert old.num_output_tokens == 6
    scheduler._preempt(old, scheduler.schedule())  # the step the pool ran dry in
    scheduler.add_sequence(_sequence("new", list(range(20, 33))))
    first = _run_step(scheduler, kv)  # old's prompt again beside new's prompt
    assert first.token_ids == [list(range(1, 11)), list(range(20, 33))]
    assert first.prompt_tokens == [10, 13]
    assert not first.sampling_seqs[1:] and first.sampling_seqs[0].seq_id == "new"
    second = _run_step(scheduler, kv)  # old's output tokens and new's first decode
    assert second.prompt_tokens == [0, 0]
    assert sorted(map(len, second.token_ids)) == [1, 6]
    assert {s.seq_id for s in second.sampling_seqs} == {"old", "new"}


def test_steps_count_each_chunk_s_prompt_tokens() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    scheduler = Scheduler(SchedulerConfig(max_num_batched_tokens=12), kv)
    long = _sequence("long", list(range(1, 21)))  # prefilled over two steps
    scheduler.add_sequence(long)
    _run_step(scheduler, kv)
    scheduler.add_sequence(_sequence("short", [30, 31]))
    _run_step(scheduler, kv)  # long's last 8 prompt tokens, short's prompt
    batch = _run_step(scheduler, kv)  # two decodes
    assert batch.prompt_tokens == [0, 0]
    scheduler.add_sequence(_sequence("late", [40, 41, 42]))
    batch = _run_step(scheduler, kv)
    assert batch.prompt_tokens == [0, 0, 3]
    assert batch.token_ids[2] == [40, 41, 42]
    assert batch.sample_rows == [0, 1, 4]


def test_a_step_lays_out_output_chunks_before_prompt_chunks() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=4, enable_prefix_caching=False)
    prefilling, decoding = _sequence("a", list(range(1, 11))), _sequence("b", [20, 21])
    decoding.num_computed_tokens = 2
    decoding.append_output_token(22)
    for seq, n in ((prefilling, 4), (decoding, 1)):
        kv.allocate_slots(seq, n)
    # the fair policy, say, ran a's next prompt chunk first
    out = SchedulerOutput(sequences=[prefilling, decoding], num_new_tokens=[4, 1])
    batch = StepBatch.build(out, kv)
    assert batch.token_ids == [[22], [1, 2, 3, 4]]
    assert batch.prompt_tokens == [0, 4]
    assert batch.context_lens == [3, 4]
    assert batch.sampling_seqs == [decoding] and batch.sample_rows == [0]
    assert first_prompt_row(batch.token_ids, batch.prompt_tokens) == 1


@pytest.mark.parametrize(
    ("token_ids", "prompt_tokens", "first"),
    [
        ([[1], [2, 3]], None, 3),
        ([[1], [2, 3]], [0, 2], 1),
        ([[1, 2], [3]], [2, 1], 0),
        ([[1], [2]], [0, 0], 2),
    ],
)
def test_first_prompt_row_of_a_step(token_ids, prompt_tokens, first) -> None:
    assert first_prompt_row(token_ids, prompt_tokens) == first


@pytest.mark.parametrize(
    ("token_ids", "prompt_tokens"),
    [
        ([[1, 2], [3]], [1, 0]),  # a chunk of both kinds
        ([[1, 2], [3]], [2, 0]),  # a prompt chunk before an output chunk
        ([[1]], [0, 0]),  # a count per sequence
    ],
)
def test_first_prompt_row_refuses_other_layouts(token_ids, prompt_tokens) -> None:
    with pytest.raises(ValueError, match="prompt token"):
        first_prompt_row(token_ids, prompt_tokens)


def test_output_blocks_are_keyed_apart_from_prompts_of_the_same_tokens() -> None:
    def hashes(prompt: list[int], outputs: list[int], apart: bool) -> list[bytes]:
        seq = Sequence("s", prompt, block_size=4, outputs_keyed_apart=apart)
        for token in outputs:
            seq.append_output_token(token)
        return seq.block_hashes

    prompt, outputs = list(range(1, 7)), list(range(7, 15))
    plain = hashes(prompt, outputs, apart=False)
    apart = hashes(prompt, outputs, apart=True)
    as_prompt = hashes(prompt + outputs, [], apart=True)
    assert len(plain) == len(apart) == len(as_prompt) == 3
    assert plain == as_prompt  # without keying apart, a later prompt takes the output's blocks
    assert apart[0] == as_prompt[0]  # the prompt's whole block is shared
    assert apart[1] != as_prompt[1] and apart[2] != as_prompt[2]
    # where the output starts within the block is part of the key
    assert hashes(prompt[:5], [6, *outputs], apart=True)[1] != apart[1]
