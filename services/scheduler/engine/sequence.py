"""A sequence: one choice of one request, the unit the scheduler batches, pages and preempts."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from services.scheduler.engine.base import EngineRequest
from shared.pages import prefix_root

if TYPE_CHECKING:
    from services.scheduler.engine.grammar import SeqGrammar
    from shared.messages import Pooling

UNRESOLVED = -1  # a sampled token still on the device (see `Seq.unresolved`)


@dataclass(eq=False)
class Seq:
    req: EngineRequest
    index: int  # choice
    tokens: list[int]  # prompt, then completion tokens
    prompt_len: int
    max_tokens: int  # completion tokens allowed in all (tokens resumed after a crash count)
    num_computed: int = 0  # leading tokens whose K/V are in `pages`
    pages: list[int] = field(default_factory=list)
    digests: list[bytes] = field(default_factory=list)  # of full pages, for the prefix cache
    forks: int = 0  # sibling choices to spawn from this one's prompt at its first sample
    num_cached_pages: int = 0  # leading pages already named in the prefix cache
    cached_tokens: int = -1  # prompt tokens found in the prefix cache at its first admission
    prompt_logprobs: list[tuple[float, list[tuple[int, float]]]] | None = None  # echo: once delivered
    scores: dict[int, tuple[float, list[tuple[int, float]]]] = field(default_factory=dict)  # by position
    compiling: Future | None = None  # the request's grammar while it compiles (structured outputs)
    grammar: SeqGrammar | None = None  # this choice's matcher once compiled
    # Overlapped steps (paged.py): the token a launched step samples is appended as UNRESOLVED until its
    # results reach the host; `pending_row` is its row in that step's device ids, which the next step reads
    # its input from. `epoch` changes when such a token is withdrawn (preemption), so a late result is ignored.
    unresolved: int = 0
    pending_row: int = -1
    epoch: int = 0
    final: bool = False  # its unresolved token is its last (max_tokens or the context): not scheduled again
    ended: bool = False  # finished, aborted or failed: results still in flight for it are dropped
    host_bound: bool = False  # its sampling reads its tokens on the host (grammar, penalties); set below
    # LoRA (lora.py): the slot of its adapter once bound to it (0: unbound, or the base model), and the first
    # page's parent digest, so its prefix-cache pages are its adapter's and its cache salt's alone.
    adapter_slot: int = 0
    digest_root: bytes = b""
    # A prefill-only embedding (pooling.py): its pooled final hidden state so far on the device (mean pooling:
    # the sum over prompt positions [0, pooled_upto), which a preempted prefill does not add again).
    pool_sum: Any = None
    pooled_upto: int = 0
    pooling: Pooling | None = field(init=False, default=None)  # the request's, read once per step per row
    uid: str = field(init=False, default="")  # the request's, read on every output

    def __post_init__(self) -> None:
        self.uid = self.req.uid
        if self.req.adapter is not None or self.req.cache_salt:
            self.digest_root = prefix_root(self.req.adapter, self.req.cache_salt)
        p = self.req.params
        self.pooling = p.pooling
        self.host_bound = p.guided is not None or (
            p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)

    @property
    def scores_prompt(self) -> bool:
        """Its prefill must also score the prompt's tokens (echo with logprobs); the first choice does it."""
        return (self.req.params.prompt_logprobs is not None and self.index == 0 and self.prompt_logprobs is None
                and not any(self.req.output_ids))

    @property
    def pools_every_token(self) -> bool:
        """A mean-pooled embedding: every prompt token's hidden state is needed, none is read from the cache."""
        p = self.pooling
        return p is not None and p.task == "embed" and p.pooling == "mean"

    @property
    def ready(self) -> bool:
        """Admissible: its grammar (if any) is compiled and its adapter (if any) is in a slot."""
        return (self.compiling is None or self.grammar is not None) and (
            self.req.adapter is None or self.adapter_slot > 0)

    @property
    def completion_len(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def to_compute(self) -> int:
        """Tokens still to run through the model before this sequence can sample."""
        return len(self.tokens) - self.num_computed

    @property
    def is_decode(self) -> bool:
        return self.to_compute == 1

    def withdraw_unresolved(self) -> None:
        """Forget the tokens still on the device (a preempted sequence samples them again, from the same
        position and seed, once it has recomputed its known tokens)."""
        if self.unresolved:
            del self.tokens[-self.unresolved:]
            self.unresolved = 0
            self.pending_row = -1
            self.final = False
            self.epoch += 1
