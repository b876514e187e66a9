"""StepBatch: one step's scheduled sequences laid out as the model runner takes them."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.engine.kv_cache_manager import KVCacheManager
from tokenmill.engine.request import Sequence
from tokenmill.engine.scheduler import SchedulerOutput


@dataclass
class StepBatch:
    """Sequence i computes token_ids[i], ending at context length context_lens[i], with its KV in
    block_tables[i]; its tokens are rows of the step's flat batch, in order. A decode with drafts
    (speculative decoding) computes its last token and the drafts, and samples at each of them.
    The sequences computing output tokens come first, then those computing prompt tokens
    (prompt_tokens[i] of them: all its new tokens, the scheduler never mixes the two in a chunk),
    as the model runner takes them."""

    token_ids: list[list[int]]
    context_lens: list[int]
    block_tables: list[list[int]]
    prompt_tokens: list[int]
    num_tokens: int
    sampling_seqs: list[Sequence]  # the sequences that reach their last token, and so sample ...
    sample_rows: list[int]  # ... from the logits of these rows (1 + its drafts' rows each)
    # (row, prompt position, tokens, sequence) of each prompt chunk whose logits score the prompt
    prompt_logprob_rows: list[tuple[int, int, int, Sequence]]

    @classmethod
    def build(cls, sched: SchedulerOutput, kv: KVCacheManager) -> StepBatch:
        token_ids, context_lens, tables, seqs, sample_rows, prompt_rows = [], [], [], [], [], []
        prompt_tokens = []
        scheduled = list(zip(sched.sequences, sched.num_new_tokens))
        # output tokens first (a stable sort: the scheduler's order within each kind)
        scheduled.sort(key=lambda item: item[0].num_computed_tokens < item[0].num_prompt_tokens)
        offset = 0
        for seq, n in scheduled:
            start, drafts = seq.num_computed_tokens, seq.draft_token_ids
            prompt_tokens.append(min(max(seq.num_prompt_tokens - start, 0), n))
            tokens = seq.all_token_ids[start : start + n]
            if drafts:
                tokens = tokens + drafts
            token_ids.append(tokens)
            context_lens.append(start + n)
            tables.append(kv.get_block_ids(seq.seq_id))
            if start + n == seq.num_tokens + len(drafts):
                seqs.append(seq)
                sample_rows.extend(range(offset + n - 1 - len(drafts), offset + n))
            # the request's prompt logprobs come from its first sequence
            if (
                seq.request.prompt_logprobs is not None
                and seq.index == 0
                and start < seq.num_prompt_tokens
            ):
                prompt_rows.append((offset, start, n, seq))
            offset += n
        return cls(
            token_ids, context_lens, tables, prompt_tokens, offset, seqs, sample_rows, prompt_rows
        )

    @property
    def needs_last_token_logits_only(self) -> bool:
        """Whether every sequence samples once and nothing else is scored (decode steps): the
        runner then returns the last tokens' logits itself, which lets it use its compiled
        graph."""
        return not self.prompt_logprob_rows and len(self.sampling_seqs) == len(
            self.token_ids
        ) == len(self.sample_rows)

    @property
    def samples_every_token(self) -> bool:
        """Whether every token of the step is a sampling row and nothing else is scored (decodes
        with drafts): the runner then returns every token's logits itself (`token_logits`).
        Sampling rows are distinct token indices, so as many of them as tokens are all of them."""
        return not self.prompt_logprob_rows and len(self.sample_rows) == self.num_tokens
