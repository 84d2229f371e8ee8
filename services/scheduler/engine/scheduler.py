"""Which tokens of which sequences run in the next step: continuous batching over the page pool.

Each step takes every running decode (one token each, oldest first), then prompt tokens up to the
per-step prefill budget: first the sequences already part-way through their prompt, then new ones
from the waiting queue, by priority (lower value first), then arrival. A prompt longer than the budget
is prefilled in chunks over several steps (with chunking off it goes whole, one over-budget prompt per
step at most), so a long prompt never stalls running decodes for more than one budget's worth of work.

Pages: a sequence holds pages for the tokens it has computed. A decode that needs a page when none
is left preempts the youngest running sequence (its pages are freed and it goes back to the front
of the waiting queue with all its tokens, to be recomputed, from the prefix cache where possible),
so running out of KV slows requests down and never fails them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from services.scheduler.engine.kv_cache import PagePool, pages_for
from services.scheduler.engine.prefix_cache import PrefixCache
from services.scheduler.engine.sequence import Seq
from shared.pages import extend_digests


@dataclass
class Scheduled:
    seq: Seq
    num_new: int

    @property
    def samples(self) -> bool:
        """This step computes the sequence's last known token, so it yields a new one."""
        return self.seq.num_computed + self.num_new == len(self.seq.tokens)


class BatchScheduler:
    def __init__(self, pool: PagePool, page_size: int, max_running: int, prefill_budget: int,
                 chunked: bool = True):
        self.pool = pool
        self.cache: PrefixCache | None = pool.cache
        self.page_size = page_size
        self.max_running = max_running
        self.prefill_budget = prefill_budget
        self.chunked = chunked
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []  # in arrival order
        self.watermark = max(1, pool.usable // 100)  # pages kept back from admission for decodes
        self.preemptions = 0
        self.prefix_hit_tokens = 0

    # ---- the step plan

    def schedule(self) -> list[Scheduled]:
        """Plan one step; rows with one new token come first (the attention backends rely on it)."""
        while True:
            batch = self._schedule_decodes()
            budget = self.prefill_budget
            for seq in [s for s in self.running if not s.is_decode]:
                budget -= self._schedule_prefill(seq, budget, batch)
            self._admit(budget, batch)
            if batch or not any(not s.final for s in self.running):
                batch.sort(key=lambda sc: sc.num_new != 1)
                return batch
            # Running sequences hold every page and none can advance: free the youngest.
            self._preempt(self.running[-1])

    def _schedule_decodes(self) -> list[Scheduled]:
        """Every running decode, oldest first; a decode that needs a page when none is left preempts the
        youngest (possibly itself). O(running): preemption takes from the tail, so the sequences preempted
        in this call are those not yet reached, kept in a set rather than searched for in `running`."""
        batch = []
        gone: set[Seq] = set()
        for seq in [s for s in self.running if s.is_decode and not s.final]:
            while seq not in gone and not self._grow(seq, 1):
                victim = self.running[-1]
                self._preempt(victim)
                gone.add(victim)
            if seq not in gone:
                batch.append(Scheduled(seq, 1))
        return batch

    def _schedule_prefill(self, seq: Seq, budget: int, batch: list[Scheduled]) -> int:
        n = self._chunk(seq, budget, batch)
        n = min(n, self._capacity(seq))
        if n <= 0 or not self._grow(seq, n):
            return 0
        batch.append(Scheduled(seq, n))
        return n

    def _chunk(self, seq: Seq, budget: int, batch: list[Scheduled]) -> int:
        if self.chunked:
            return min(seq.to_compute, budget)
        first_prefill = all(sc.seq.is_decode for sc in batch)
        return seq.to_compute if seq.to_compute <= budget or first_prefill else 0

    def next_waiting(self) -> Seq | None:
        """The waiting sequence to admit next: lowest priority value first, then the earliest TTFT deadline (an
        SLO; none is last), then queue order (a preempted sequence is at the front); one whose grammar is still
        compiling is passed over."""
        return min((s for s in self.waiting if s.ready), key=lambda s: (s.req.priority, s.req.ttft_due), default=None)

    def _admit(self, budget: int, batch: list[Scheduled]) -> None:
        while budget > 0 and len(self.running) < self.max_running:
            seq = self.next_waiting()
            if seq is None:
                return
            hit = self._match_prefix(seq)
            n = self._chunk(seq, budget, batch)
            if n <= 0 or not self._grow(seq, n, reserve=self.watermark if self.running else 0):
                self._unmatch(seq, hit)
                return
            self.waiting.remove(seq)
            self.running.append(seq)
            self.prefix_hit_tokens += hit * self.page_size
            if seq.cached_tokens < 0:
                seq.cached_tokens = hit * self.page_size
            batch.append(Scheduled(seq, n))
            budget -= n

    # ---- pages

    def _capacity(self, seq: Seq) -> int:
        """Most new tokens this sequence can take with its own pages plus every available one."""
        return (len(seq.pages) + self.pool.available()) * self.page_size - seq.num_computed

    def _grow(self, seq: Seq, n: int, reserve: int = 0) -> bool:
        """Pages for the sequence's next n tokens, if the pool has them and `reserve` more (an admission leaves
        the running decodes a reserve, the watermark); False, and nothing taken, if not."""
        need = pages_for(seq.num_computed + n, self.page_size) - len(seq.pages)
        if reserve and self.pool.available() - need < reserve:
            return False
        if need <= 0:
            return True
        pages = self.pool.alloc(need)
        if pages is None:
            return False
        seq.pages.extend(pages)
        return True

    def _match_prefix(self, seq: Seq) -> int:
        """Share the cached pages of the sequence's longest cached prefix; always leave a token to run."""
        # scoring the prompt, or mean-pooling it, computes all of it
        if self.cache is None or seq.pages or seq.scores_prompt or seq.pools_every_token:
            return 0
        limit = (len(seq.tokens) - 1) // self.page_size
        extend_digests(seq.digests, seq.tokens, self.page_size, limit, seq.digest_root)
        hit = self.cache.match(seq.digests[:limit])
        self.pool.share(hit)
        seq.pages = list(hit)
        seq.num_computed = len(hit) * self.page_size
        seq.num_cached_pages = len(hit)
        return len(hit)

    def _unmatch(self, seq: Seq, hit: int) -> None:
        if hit:
            self._free(seq)

    def _free(self, seq: Seq) -> None:
        self.pool.release(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.num_cached_pages = 0

    def _preempt(self, seq: Seq) -> None:
        if self.running and self.running[-1] is seq:
            self.running.pop()
        else:
            self.running.remove(seq)
        seq.withdraw_unresolved()  # its token still in flight is sampled again after the recompute
        self._free(seq)
        self.waiting.appendleft(seq)
        self.preemptions += 1

    # ---- after the forward

    def computed(self, batch: list[Scheduled]) -> None:
        """Record the step's tokens as computed (their K/V are written by the launched step) and name the newly
        full pages in the prefix cache, but a sequence's whose token is still in flight: its pages are named once
        that token is known (`name_pages`, after the previous step's results)."""
        for sc in batch:
            sc.seq.num_computed += sc.num_new
        self.name_pages([sc.seq for sc in batch if not sc.seq.unresolved])

    def name_pages(self, seqs: list[Seq]) -> None:
        """Name the newly full pages of each sequence in the prefix cache; every computed token must be known
        on the host (a page is named by its tokens), so an overlapped step names its pages after the previous
        step's tokens have arrived."""
        if self.cache is None:
            return
        for seq in seqs:
            full = seq.num_computed // self.page_size
            if full <= seq.num_cached_pages:
                continue  # no page filled up since it was last named
            extend_digests(seq.digests, seq.tokens, self.page_size, full, seq.digest_root)
            for i in range(seq.num_cached_pages, full):
                self._name_page(seq, i)
            seq.num_cached_pages = max(seq.num_cached_pages, full)

    def _name_page(self, seq: Seq, i: int) -> None:
        """Name the sequence's newly full page i; if another sequence computed the same prefix first,
        read that page instead, so that whoever holds a cached page holds its whole cached prefix."""
        assert self.cache is not None
        page = self.cache.insert(seq.digests[i], seq.pages[i])
        if page != seq.pages[i]:
            self.pool.share([page])
            self.pool.release([seq.pages[i]])
            seq.pages[i] = page

    def fork(self, parent: Seq, count: int) -> list[Seq]:
        """Sibling choices of a just-prefilled sequence, sharing its prompt's full pages.

        The partial last page is not shared (the parent appends to it): each sibling recomputes that
        tail (fewer than page_size tokens) together with its first sampled token in its next step.
        """
        full = parent.prompt_len // self.page_size
        children = []
        for k in range(1, count + 1):
            child = Seq(parent.req, parent.index + k, parent.tokens[:parent.prompt_len], parent.prompt_len,
                        parent.max_tokens, num_computed=full * self.page_size,
                        pages=parent.pages[:full], digests=parent.digests[:full],
                        num_cached_pages=min(parent.num_cached_pages, full), compiling=parent.compiling,
                        grammar=parent.grammar.fresh() if parent.grammar else None,
                        adapter_slot=parent.adapter_slot)
            self.pool.share(child.pages)
            children.append(child)
        self.running.extend(children)
        return children

    def finish(self, seq: Seq) -> None:
        if seq in self.running:
            self.running.remove(seq)
        seq.ended = True
        seq.unresolved = 0
        self._free(seq)

    def drop(self, uid: str, index: int | None = None) -> list[Seq]:
        """Remove every sequence of a request (abort), or its choice `index` only, freeing their pages."""

        def ours(s: Seq) -> bool:
            return s.uid == uid and index in (None, s.index)

        gone = [s for s in self.running if ours(s)] + [s for s in self.waiting if ours(s)]
        self.running = [s for s in self.running if not ours(s)]
        self.waiting = deque(s for s in self.waiting if not ours(s))
        for seq in gone:
            seq.ended = True
            self._free(seq)
        return gone
