"""OutputProcessor: from sampled tokens to text, finish decisions and `RequestOutput`s.

For every token a step samples it records the logprobs asked for, detokenizes incrementally and
decides whether the sequence is done (a stop token, a stop string, its length, or the context's);
it records prompt logprobs; and it assembles each request's `RequestOutput`. It only marks a
sequence finished (`finish_reason`) and reports it: releasing what the sequence holds is the
engine's business.
"""

from __future__ import annotations

import logging

import torch

from tokenmill.engine.outputs import CompletionOutput, Logprob, RequestOutput
from tokenmill.engine.request import Request, Sequence
from tokenmill.sample import SamplerOutput
from tokenmill.tokenizer import Tokenizer

log = logging.getLogger("tokenmill.engine")


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.num_generation_tokens = 0  # tokens appended to sequences so far
        self._finished: list[Sequence] = []  # finished since `take_finished`

    def take_finished(self) -> list[Sequence]:
        """The sequences finished since the last call, in the order they finished."""
        finished, self._finished = self._finished, []
        return finished

    def finish(self, seq: Sequence, reason: str, stop_reason: str | int | None = None) -> None:
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        self._finished.append(seq)

    def fail(self, seq: Sequence, message: str, is_input: bool = False) -> None:
        """End the sequence with "error"; its request reports `message` (is_input: the failure
        is the request's own doing)."""
        seq.request.error = message
        seq.request.error_is_input = is_input
        self.finish(seq, "error")

    def process_sampled(
        self, seqs: list[Sequence], sampled: SamplerOutput, logits: torch.Tensor
    ) -> None:
        """Append each sequence's sampled token (row i of `sampled` and of `logits` is seqs[i]'s),
        with its text and logprobs, and finish the sequences that are done. A sequence whose
        logits are not finite, or whose token cannot be processed, fails alone."""
        if not bool(sampled.usable.all()):  # one request's numerical failure must not reach others
            for seq, ok in zip(seqs, sampled.usable.tolist()):
                if not ok and seq.finish_reason is None:
                    self.fail(seq, "the model produced non-finite logits for this request")
        tokens = sampled.token_ids.tolist()
        lp = sampled.logprobs.tolist() if sampled.logprobs is not None else None
        top_ids = sampled.top_ids.tolist() if sampled.top_ids is not None else None
        top_lps = sampled.top_logprobs.tolist() if sampled.top_logprobs is not None else None
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            if seq.finish_reason is not None:
                continue
            try:
                seq.append_output_token(token)
                seq.new_token_ids.append(token)
                self.num_generation_tokens += 1
                if seq.logprobs is not None:
                    self._record_logprobs(seq, token, logits[i], lp[i], top_ids[i], top_lps[i])
                self._process_token(seq, token)
            except Exception as exc:  # noqa: BLE001 - e.g. a tokenizer failure: this request only
                log.exception("request %s failed", seq.seq_id)
                self.fail(seq, f"failed to process token {token}: {exc!r}")

    def _record_logprobs(
        self,
        seq: Sequence,
        token: int,
        logits: torch.Tensor,
        logprob: float,
        top_ids: list[int],
        top_lps: list[float],
    ) -> None:
        k = seq.params.logprobs
        entry = {
            tid: Logprob(lp, rank + 1, self.tokenizer.decode([tid]))
            for rank, (tid, lp) in enumerate(zip(top_ids[:k], top_lps[:k]))
        }
        if token not in entry:
            rank = int((logits.log_softmax(-1) > logprob).sum()) + 1
            entry = {token: Logprob(logprob, rank, self.tokenizer.decode([token]))} | entry
        seq.logprobs.append(entry)
        seq.cumulative_logprob += logprob

    def _process_token(self, seq: Sequence, token: int) -> None:
        """Detokenize one new token and decide whether the sequence is done."""
        params, request = seq.params, seq.request
        if token in request.stop_token_ids and seq.num_output_tokens >= params.min_tokens:
            seq.text += seq.detokenizer.flush()
            self.finish(seq, "stop", token if token in params.stop_token_ids else None)
            return
        before = len(seq.text)
        seq.text += seq.detokenizer.push(token)
        if self._stopped_by_string(seq, before):
            return
        if seq.num_output_tokens >= request.max_tokens or seq.num_tokens >= self.max_model_len:
            # the text held back (an incomplete character) may complete a stop string too
            before = len(seq.text)
            seq.text += seq.detokenizer.flush()
            if not self._stopped_by_string(seq, before):
                self.finish(seq, "length")

    def _stopped_by_string(self, seq: Sequence, before: int) -> bool:
        """Finish the sequence at the first stop string in its text that ends past `before`
        (where its new text starts), if there is one; whether it did."""
        params = seq.params
        if not params.stop or seq.num_output_tokens < params.min_tokens:
            return False
        start = max(0, before - max(len(s) for s in params.stop) + 1)
        found = [(i, s) for s in params.stop if (i := seq.text.find(s, start)) >= 0]
        if not found:
            return False
        at, stop = min(found)
        seq.text = seq.text[: at + len(stop) if params.include_stop_str_in_output else at]
        self.finish(seq, "stop", stop)
        return True

    @staticmethod
    def prompt_logprob_positions(seq: Sequence, start: int, num_tokens: int) -> range:
        """The prompt positions, among the num_tokens computed from `start` on, whose logits
        score the next prompt token: all of them but the prompt's last."""
        end = min(start + num_tokens, seq.num_prompt_tokens)
        return range(start, end - 1 if end == seq.num_prompt_tokens else end)

    def record_prompt_logprobs(
        self, seq: Sequence, positions: range, logprobs: torch.Tensor
    ) -> None:
        """Each prompt token's logprob given the tokens before it, with the top ones asked for;
        logprobs holds a row of log-softmaxed logits per position (the first token has none)."""
        prompt = seq.prompt_token_ids
        k = seq.params.prompt_logprobs
        targets = torch.tensor(prompt[positions.start + 1 : positions.stop + 1])
        chosen = logprobs.gather(1, targets[:, None]).squeeze(1)
        ranks = (logprobs > chosen[:, None]).sum(-1) + 1
        top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
        decode = self.tokenizer.decode
        for j, pos in enumerate(positions):
            target = prompt[pos + 1]
            entry = {target: Logprob(float(chosen[j]), int(ranks[j]), decode([target]))}
            if k:
                for r, (tid, lp) in enumerate(zip(top_ids[j].tolist(), top_lp[j].tolist())):
                    entry.setdefault(tid, Logprob(lp, r + 1, decode([tid])))
            seq.request.prompt_logprobs[pos + 1] = entry

    def make_output(self, request: Request) -> RequestOutput:
        """The request's output now: each sequence's text and tokens so far, and what is new
        since its last output. While a sequence can still end on a stop string, the text that
        could be the start of one is held back."""
        completions = []
        for seq in request.sequences:
            final = seq.finish_reason is not None
            stop = seq.params.stop
            held = 0 if final or not stop else max(len(s) for s in stop) - 1
            visible = max(seq.num_emitted_chars, len(seq.text) - held)
            delta = seq.text[seq.num_emitted_chars : visible]
            seq.num_emitted_chars = visible
            completions.append(
                CompletionOutput(
                    index=seq.index,
                    text=seq.text[:visible],
                    token_ids=list(seq.output_token_ids),
                    cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
                    # a snapshot: the sequence goes on appending to its own list
                    logprobs=None if seq.logprobs is None else list(seq.logprobs),
                    finish_reason=seq.finish_reason,
                    stop_reason=seq.stop_reason,
                    text_delta=delta,
                    token_ids_delta=seq.new_token_ids,
                )
            )
            seq.new_token_ids = []
        prompt_logprobs = request.prompt_logprobs
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=completions,
            finished=request.finished,
            prompt_logprobs=list(prompt_logprobs) if prompt_logprobs is not None else None,
            num_cached_tokens=max(request.sequences[0].num_cached_tokens, 0),
            error=request.error,
            error_is_input=request.error_is_input,
        )
