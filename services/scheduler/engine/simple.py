"""A simple engine: batched decode by recomputing every running sequence each step (no KV cache).

It stands behind the same interface as the paged engine and batches all running requests into one
left-padded forward per step. It is the fallback (`--engine simple`) and a cross-check for the paged
engine; it is not fast.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from services.scheduler.engine.base import (
    EngineRequest,
    RequestRejected,
    StepOutput,
    allowed_completion,
    refuse_prefill_only,
)
from services.scheduler.engine.grammar import GrammarCache, GrammarError, SeqGrammar
from services.scheduler.engine.sampling import Sampler, SampleRow

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    req: EngineRequest
    index: int
    max_tokens: int
    out: list[int] = field(default_factory=list)
    grammar: SeqGrammar | None = None


class SimpleEngine:
    def __init__(self, model, eos_ids: set[int], max_running: int = 16):
        self.model = model.eval()
        self.eos_ids = eos_ids
        self.max_running = max_running
        self.max_context = int(getattr(model.config, "max_position_embeddings", 2048))
        self.seqs: list[_Seq] = []
        self.sampler = Sampler(eos_ids, next(model.parameters()).device)
        self.grammars: GrammarCache | None = None  # structured outputs; set by the factory
        self._room = self._free_room()

    def add(self, req: EngineRequest) -> int:
        """Queue a request and return its max_tokens; an omitted one is what the context leaves (no KV cache)."""
        p = req.params
        if p.pooling is not None:
            raise refuse_prefill_only("simple")
        if req.adapter is not None:
            raise RequestRejected(f"no LoRA adapter named '{req.adapter}' (this engine serves none; the paged engine "
                                  "does, with --max-loras)", code="model_not_found", param="model")
        max_tokens = allowed_completion(len(req.input_ids), p, self.max_context)
        seqs = [_Seq(req, i, max_tokens, list(req.output_ids[i]) if i < len(req.output_ids) else [])
                for i in range(p.n)]
        if p.guided is not None:
            self._constrain(seqs)
        self.seqs.extend(seqs)
        self._room = self._free_room()
        return max_tokens

    def _constrain(self, seqs: list[_Seq]) -> None:
        """This fallback engine compiles in the caller's thread (the paged engine does not)."""
        guided = seqs[0].req.params.guided
        if self.grammars is None or guided is None:
            raise RequestRejected("structured outputs are not available on this engine")
        try:
            compiled = self.grammars.get(guided).result()
            for s in seqs:
                s.grammar = SeqGrammar(compiled, guided.after, s.out, guided.think)
        except GrammarError as e:
            raise RequestRejected(str(e), param=guided.param) from None

    def abort(self, uid: str, index: int | None = None) -> bool:
        before = len(self.seqs)
        self.seqs = [s for s in self.seqs if not (s.req.uid == uid and index in (None, s.index))]
        self._room = self._free_room()
        return len(self.seqs) != before

    def room(self) -> int:
        """Published by whoever last changed the batch (services/scheduler/engine/paged.py `_room`)."""
        return self._room

    def _free_room(self) -> int:
        return max(0, self.max_running - len({s.req.uid for s in self.seqs}))

    def has_work(self) -> bool:
        return bool(self.seqs)

    def stats(self) -> dict:
        return {"dtype": str(next(self.model.parameters()).dtype).removeprefix("torch."),
                "running": len({s.req.uid for s in self.seqs}), "waiting": 0, "sequences": len(self.seqs)}

    prefix_page_size = 0  # no prefix cache: nothing to publish for routing

    def prefix_changes(self) -> tuple[list[bytes], list[bytes]]:
        return [], []

    def prefix_digests(self) -> list[bytes]:
        return []

    def resident_adapters(self) -> list[str]:
        return []

    def close(self) -> None:
        self.seqs.clear()
        self._room = self._free_room()
        if self.grammars is not None:
            self.grammars.close()

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        if not self.seqs:
            return []
        rows = [s.req.input_ids + s.out for s in self.seqs]
        width = max(map(len, rows))
        ids = torch.zeros(len(rows), width, dtype=torch.long)
        mask = torch.zeros(len(rows), width, dtype=torch.long)
        for r, row in enumerate(rows):
            ids[r, width - len(row):] = torch.tensor(row)
            mask[r, width - len(row):] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].float()
        result = self.sampler(logits, [SampleRow(s.req.params, s.index, len(s.out), s.req.input_ids + s.out,
                                                 len(s.req.input_ids), s.grammar) for s in self.seqs])
        outputs, keep = [], []
        for k, s in enumerate(self.seqs):
            tok = result.ids[k]
            start = len(s.out)
            s.out.append(tok)
            p = s.req.params
            finish = None
            if s.grammar is not None and not s.grammar.accept(s.out):
                guided = p.guided
                outputs.append(StepOutput(s.req.uid, start, [], s.index, "error", error=s.grammar.refusal,
                                          error_status=400, error_param=(guided.param or None) if guided else None))
                continue
            ended = s.grammar is not None and s.grammar.done
            if ended or (len(s.out) >= p.min_tokens and (
                    (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids)):
                finish = "stop"
            elif len(s.out) >= s.max_tokens:
                finish = "length"
            lp = [result.logprobs[k]] if result.logprobs[k] is not None else None
            top = [result.top_logprobs[k]] if result.top_logprobs[k] is not None else None
            outputs.append(StepOutput(s.req.uid, start, [tok], s.index, finish, lp, top))
            if finish is None:
                keep.append(s)
        self.seqs = keep
        self._room = self._free_room()
        return outputs
