"""Reading a launched step's results (launch.py) into the engine's outputs, and ending and failing sequences.

A step's tokens are read once (by the engine: paged.py `_resolve`, the step's one host sync). A token that arrives
for a sequence that ended or was preempted since its step was launched is dropped; one that ends its sequence ends
it here, and a token its grammar refuses fails its request (a 400: the client's grammar or params at fault).
"""

from __future__ import annotations

from services.scheduler.engine.base import StepOutput
from services.scheduler.engine.launch import InFlight
from services.scheduler.engine.pooling import pooled_outputs
from services.scheduler.engine.sampling import SampleResult
from services.scheduler.engine.scheduler import BatchScheduler
from services.scheduler.engine.sequence import Seq


class StepResolver:
    """Turns sampled tokens into outputs and ends (or fails) the sequences they end."""

    def __init__(self, scheduler: BatchScheduler, eos_ids: set[int], max_context: int):
        self.scheduler = scheduler
        self.eos_ids = eos_ids
        self.max_context = max_context

    def resolve(self, flight: InFlight, result: SampleResult | None) -> list[StepOutput]:
        """Turn the tokens the step `flight` sampled (`result`, read by the engine: the step's one host sync)
        into outputs."""
        outputs = []
        if flight.pooled:
            assert flight.pooled_out is not None
            outputs = pooled_outputs(flight.pooled, flight.pooled_out)
        if flight.out is None or result is None:
            return outputs
        refused = []
        with_logprobs = bool(flight.out.want)
        for k, (seq, at, epoch, tok) in enumerate(zip(flight.seqs, flight.token_index, flight.epochs, result.ids,
                                                      strict=True)):
            if seq.ended or seq.epoch != epoch:
                continue  # aborted, stopped or preempted since the step was launched: its token is dropped
            out = self.accept(seq, at, tok)
            if out is None:
                refused.append(seq)  # nothing admissible was left (e.g. min_tokens banned the only end)
                continue
            if with_logprobs and result.logprobs[k] is not None:
                out.logprobs = [result.logprobs[k]]
                if result.top_logprobs[k] is not None:
                    out.top_logprobs = [result.top_logprobs[k]]
            outputs.append(out)
            if out.finish_reason:
                del seq.tokens[at + 1:]  # a token launched after this one is not the request's
                self.scheduler.finish(seq)
        return self._refuse(outputs, refused) if refused else outputs

    def accept(self, seq: Seq, at: int, tok: int) -> StepOutput | None:
        """Put a sampled token at its place in the sequence: its output (with the first one's extras), or None
        when the sequence's grammar refuses it."""
        seq.tokens[at] = tok
        seq.unresolved -= 1
        produced = at + 1 - seq.prompt_len
        grammar = seq.grammar
        if grammar is not None and not grammar.accept(seq.tokens[seq.prompt_len:at + 1]):
            return None
        finish = None
        if (tok in self.eos_ids or seq.req.params.stop_token_ids or grammar is not None
                or produced >= seq.max_tokens or at + 1 >= self.max_context):
            finish = self.finish_reason(seq, tok, produced, at + 1)
        out = StepOutput(seq.uid, produced - 1, [tok], seq.index, finish)
        if produced == 1:
            out.cached_tokens = max(seq.cached_tokens, 0)
            if seq.scores_prompt:
                out.prompt_logprobs = seq.prompt_logprobs = [seq.scores[p] for p in sorted(seq.scores)]
                seq.scores = {}
        return out

    def _refuse(self, outputs: list[StepOutput], refused: list[Seq]) -> list[StepOutput]:
        """The step's outputs with those of the refused sequences replaced by their failure: the client's grammar
        (or its params) at fault, a 400."""
        gone = {s.uid for s in refused}
        outputs = [o for o in outputs if o.uid not in gone]
        for seq in refused:
            assert seq.grammar is not None
            outputs += self.fail([seq], seq.grammar.refusal, 400, guided_param([seq]))
        return outputs

    def finish_reason(self, seq: Seq, tok: int, produced: int, length: int) -> str | None:
        """Why the sequence ends with `tok`, its `produced`-th completion token and its `length`-th token."""
        p = seq.req.params
        if produced >= p.min_tokens and ((tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            return "stop"
        if seq.grammar is not None and seq.grammar.done:
            return "stop"
        if produced >= seq.max_tokens or length >= self.max_context:
            return "length"
        return None

    def fail(self, seqs: list[Seq], error: str, status: int = 500, param: str | None = None) -> list[StepOutput]:
        """Fail the requests of `seqs`, every choice of each (those not forked yet too), and drop their sequences."""
        outputs, failed = [], set()
        for seq in seqs:
            if seq.uid not in failed:  # the whole request fails, with every choice
                failed.add(seq.uid)
                for s in self.scheduler.drop(seq.uid):
                    for index in range(s.index, s.index + s.forks + 1):  # unforked choices fail too
                        outputs.append(StepOutput(s.uid, s.completion_len, [], index, "error", error=error,
                                                  error_status=status, error_param=param))
        return outputs


def guided_param(seqs: list[Seq]) -> str | None:
    """The request parameter its structured output came from (what a 400 about its grammar names)."""
    guided = seqs[0].req.params.guided if seqs else None
    return (guided.param or None) if guided is not None else None
