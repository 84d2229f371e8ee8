"""The paged engine: continuous batching over a paged KV cache behind the scheduler's Engine interface.

Each `step()` plans a batch (decodes, prompt chunks, new requests), runs it as one packed forward,
samples a token for every sequence whose known tokens are all computed, and returns what it produced.
A request with n > 1 choices is prefilled once; its choices then share the prompt's pages.

Overlapped steps (on by default on CUDA, as mini-sglang's overlap loop, SGLang's overlap scheduler and
vLLM's async scheduling do): `step()` launches step k+1 on the device before it waits for step k's results,
and returns step k's outputs while k+1 runs, so scheduling, metadata, planning and the worker's handling of
the outputs happen while the GPU computes. A sequence's token sampled by a step still in flight is an
UNRESOLVED entry of its tokens; the next step reads it on the device (the sampled ids stay there) and
the host learns it one call later. Whatever the results could change is honoured within one step:
max_tokens and the context are known on the host, so a sequence whose in-flight token is its last is not
scheduled again; one that stops on EOS or a stop token, or is aborted, has computed one token too many,
which is dropped; a sequence whose next step needs the token on the host (grammar, penalties) waits for
it (that step does not overlap). Outputs are the same tokens as without overlap, one call later.
"""

from __future__ import annotations

import logging
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch

from services.scheduler.engine.attention import RowSpec
from services.scheduler.engine.base import EngineRequest, RequestRejected, StepOutput, allowed_completion
from services.scheduler.engine.config import EngineConfig, make_backend, make_lora
from services.scheduler.engine.cuda_graph import DeviceTokens
from services.scheduler.engine.grammar import GrammarCache, GrammarError, SeqGrammar
from services.scheduler.engine.kv_cache import KVCache, PagePool, pages_for
from services.scheduler.engine.lora import AdapterSource
from services.scheduler.engine.model_geometry import attention_geometry, max_context
from services.scheduler.engine.model_runner import ModelRunner
from services.scheduler.engine.pooling import check_pooling, embedding, float32_bytes, scores, truncatable
from services.scheduler.engine.prefix_cache import PrefixCache
from services.scheduler.engine.sampling import SampleOut, Sampler, SampleRow
from services.scheduler.engine.scheduler import BatchScheduler, Scheduled
from services.scheduler.engine.sequence import UNRESOLVED, Seq
from services.scheduler.engine.transfer import DeviceResult, to_device
from services.scheduler.engine.warm_up import run_warm_up
from shared.messages import SamplingParams

log = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.02  # an idle step waits this long for a compiling grammar instead of spinning


@dataclass
class _InFlight:
    """A launched step: the sequences it samples for, in the sampler's row order, where each one's token
    goes, and the epoch each had (a preemption since withdraws the token)."""

    seqs: list[Seq]
    token_index: list[int]
    epochs: list[int]
    out: SampleOut | None  # None: no sequence samples (the step only ended prefill-only requests)
    deferred: list[Seq]  # sequences whose pages are named once the previous step's tokens are known
    pooled: list[Seq]  # prefill-only requests the step ended (pooling.py), their results in `pooled_out`
    pooled_out: DeviceResult | None = None

    def results(self) -> list[DeviceResult]:
        return [r for r in (self.out.transfer if self.out is not None else None, self.pooled_out) if r is not None]


class PagedEngine:
    def __init__(self, model: torch.nn.Module, eos_ids: set[int], config: EngineConfig,
                 adapters: AdapterSource | None = None):
        geometry = attention_geometry(model)  # refuses unsupported architectures with the reason
        param = next(model.parameters())
        self.config = config
        self.eos_ids = set(eos_ids)
        self.dtype = param.dtype
        self.max_context = max_context(model)
        text_config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.hidden_size = int(text_config.hidden_size)  # what an embedding has (pooling.py)
        self.truncation = truncatable(model.config)
        self.kv = KVCache(geometry.kv_shape(config.page_size), config.num_pages, param.dtype, param.device)
        backend = make_backend(config.backend, self.kv, model, param.dtype)
        cache = PrefixCache() if config.prefix_cache else None
        # torch attention reads whole pages (flashinfer reads only kv_len): keep their tails finite
        zero = self.kv.zero_pages if backend.name == "torch" else None
        self.pool = PagePool(config.num_pages, cache, shuffle_seed=config.shuffle_pages, on_alloc=zero)
        self.prefix_page_size = config.page_size if cache is not None else 0
        self.scheduler = BatchScheduler(self.pool, config.page_size, config.max_running,
                                        config.prefill_budget, config.chunked_prefill)
        self.runner = ModelRunner(model, backend, config.page_size)
        self.lora = self.runner.lora = make_lora(config, model, backend, adapters)
        on_cuda = param.device.type == "cuda"
        graphs = config.cuda_graphs
        if graphs is None:  # the default: on CUDA wherever flashinfer serves the attention
            graphs = on_cuda and backend.name == "flashinfer"
            if on_cuda and not graphs:
                log.info("CUDA graphs off: they need flashinfer attention (this engine uses %s)", backend.name)
        if graphs:  # on a device or backend that cannot, capture fails with a warning saying why
            from services.scheduler.engine.cuda_graph import DecodeGraphs

            self.runner.graphs = DecodeGraphs.capture(self.runner, self.kv, config.max_running,
                                                      pages_for(self.max_context, config.page_size))
        self.overlap = on_cuda if config.overlap is None else config.overlap
        self.sampler = Sampler(self.eos_ids, param.device, config.seed,
                               flashinfer=getattr(backend, "flashinfer", None))
        self._inflight: _InFlight | None = None
        self.steps = 0
        self._pending: list[StepOutput] = []  # outputs due without a forward (resumed, finished)
        self.grammars: GrammarCache | None = None  # structured outputs; set by the factory
        # What room() answers: the scheduler asks from its event loop while a step runs in its thread (it reads
        # new requests then), so room is computed only by whoever mutates the queues (the step thread in a step;
        # add and abort, between steps) and published as one int, never read off the queues.
        self._room = self._free_room()
        log.info("paged engine: %s attention, %d pages x %d tokens, context %d", backend.name,
                 self.pool.usable, config.page_size, self.max_context)

    def warm_up(self) -> float:
        """Run every batch shape once (kernels compile, buffers are allocated) and leave the engine as it
        was; the seconds it took. The factory calls it before the worker reports ready."""
        return run_warm_up(self.runner, self.sampler, self.kv, self.config, self.max_context)

    # ---- Engine interface

    def add(self, req: EngineRequest) -> int:
        """Queue a request and return its max_tokens (an omitted one resolved); raise RequestRejected if
        it can never be served."""
        p = req.params
        prompt = list(req.input_ids)
        max_tokens = self._validate(req, prompt)
        if req.adapter is not None:
            if self.lora is None:
                raise RequestRejected(f"no LoRA adapter named '{req.adapter}' (this engine serves none: "
                                      "--max-loras is 0)", code="model_not_found", param="model")
            self.lora.check(req.adapter)  # refuses unknown and bad adapters; starts loading the others
        compiling = self._compile(p)
        resumed = [list(o) for o in req.output_ids]
        if not any(resumed):  # fresh: one sequence prefills the prompt and forks the rest at its first sample
            seq = Seq(req, 0, prompt, len(prompt), self.scheduler.next_arrival(), max_tokens, forks=p.n - 1,
                      compiling=compiling)
            self.scheduler.waiting.append(seq)
            self._room = self._free_room()
            return max_tokens
        for i in range(p.n):
            prior = resumed[i] if i < len(resumed) else []
            seq = Seq(req, i, prompt + prior, len(prompt), self.scheduler.next_arrival(), max_tokens,
                      compiling=compiling)
            done = self._finish_reason(seq, prior[-1], seq.completion_len, len(seq.tokens)) if prior else None
            if done:
                self._pending.append(StepOutput(req.uid, len(prior), [], i, done))
            else:
                self.scheduler.waiting.append(seq)
        self._room = self._free_room()
        return max_tokens

    def _compile(self, p: SamplingParams) -> Future | None:
        """Start (or find) the compile of the request's grammar; it waits in the queue until it is ready."""
        if p.guided is None:
            return None
        if self.grammars is None:
            raise RequestRejected("structured outputs are not available on this engine", param=p.guided.param)
        return self.grammars.get(p.guided)

    def _prepare_grammars(self) -> list[StepOutput]:
        """Give each waiting sequence whose grammar just compiled its matcher (replaying the tokens it
        already has, after a preemption or a crash); fail the requests whose grammar did not compile."""
        failed: dict[str, str] = {}
        for seq in self.scheduler.waiting:
            if seq.grammar is not None or seq.compiling is None or not seq.compiling.done():
                continue
            try:
                guided = seq.req.params.guided
                assert guided is not None
                seq.grammar = SeqGrammar(seq.compiling.result(), guided.after, seq.tokens[seq.prompt_len:],
                                         guided.think)
            except (GrammarError, RuntimeError, ValueError) as e:
                failed.setdefault(seq.uid, f"structured output: {e}")
        outputs = []
        for uid, error in failed.items():
            seqs = [s for s in self.scheduler.waiting if s.uid == uid][:1]
            outputs += self._fail(seqs, error, 400, self._guided_param(seqs))
        return outputs

    def _prepare_adapters(self) -> list[StepOutput]:
        """Bind waiting sequences to their loaded adapters (lora.py); fail the requests whose adapter failed."""
        if self.lora is None:
            return []
        outputs = []
        for seq, error, status in self.lora.prepare(self.scheduler.waiting, self.scheduler.running):
            if not seq.ended:
                outputs += self._fail([seq], error, status, "model" if status < 500 else None)
        return outputs

    @staticmethod
    def _guided_param(seqs: list[Seq]) -> str | None:
        guided = seqs[0].req.params.guided if seqs else None
        return (guided.param or None) if guided is not None else None

    def _wait_for_grammars(self) -> None:
        """Nothing to run: wait a little for a grammar compiling or an adapter loading instead of spinning."""
        compiling = {s.compiling for s in self.scheduler.waiting
                     if not s.ready and s.compiling is not None and not s.compiling.done()}
        if self.lora is not None:
            compiling.update(self.lora.loading())
        if compiling:
            wait_futures(compiling, timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)  # type: ignore[arg-type]

    def _validate(self, req: EngineRequest, prompt: list[int]) -> int:
        """Refuse what can never be served; return max_tokens, resolving an omitted one."""
        p = req.params
        if not prompt:
            raise RequestRejected("the prompt is empty: at least one input token is needed")
        vocab = self.runner.vocab_size
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise RequestRejected(f"input token ids must be in [0, {vocab})")
        if p.n < 1:
            raise RequestRejected("n must be at least 1")
        if p.pooling is not None:
            if p.n != 1:
                raise RequestRejected("a prefill-only request has one choice", param="n")
            check_pooling(p.pooling, vocab, self.hidden_size, self.truncation)
        max_tokens = allowed_completion(len(prompt), p, self.max_context, self.pool.usable * self.config.page_size)
        return max_tokens if p.max_tokens is not None else self._default_max_tokens(p, len(prompt))

    def _default_max_tokens(self, p: SamplingParams, prompt_len: int) -> int:
        """An omitted max_tokens: up to the context, as far as the KV pool can ever hold the request. That
        is all n choices side by side (they share the prompt's full pages) where they fit, else one
        choice alone (the others wait their turn, preempted); never less than min_tokens (which
        `allowed_completion` checked fits one choice alone)."""
        ps, usable = self.config.page_size, self.pool.usable
        context_left = self.max_context - prompt_len
        alone = usable * ps - prompt_len
        shared = prompt_len // ps
        together = (shared + (usable - shared) // p.n) * ps - prompt_len
        return max(p.min_tokens, min(context_left, together if together >= 1 else alone))

    def abort(self, uid: str, index: int | None = None) -> bool:
        before = len(self._pending)
        self._pending = [o for o in self._pending if not (o.uid == uid and index in (None, o.index))]
        dropped = bool(self.scheduler.drop(uid, index))
        self._room = self._free_room()
        return dropped or len(self._pending) != before

    def room(self) -> int:
        """New requests to pull now (safe to call while a step runs in another thread: see `_room`)."""
        return self._room

    def _free_room(self) -> int:
        """None while some wait, or when the free pages are down to the reserve; else the free running slots.
        Only on the thread that mutates the queues."""
        s = self.scheduler
        if any(q.ready for q in s.waiting) or self.pool.available() <= s.watermark + len(s.running):
            return 0
        return max(0, s.max_running - len(s.running))

    def has_work(self) -> bool:
        flight = self._inflight  # a step in flight whose sequences all ended has nothing left to say
        return bool(self.scheduler.running or self.scheduler.waiting or self._pending or
                    (flight is not None and (flight.pooled or any(not s.ended for s in flight.seqs))))

    def stats(self) -> dict:
        s, ps = self.scheduler, self.config.page_size
        return {
            "dtype": str(self.dtype).removeprefix("torch."),  # what --dtype auto chose, in the heartbeat
            "running": len({q.uid for q in s.running}),
            "waiting": len({q.uid for q in s.waiting}),
            "running_sequences": len(s.running),
            "kv_used_tokens": self.pool.used() * ps,
            "kv_total_tokens": self.pool.usable * ps,
            "free_pages": self.pool.available(),
            "total_pages": self.pool.usable,
            "cached_pages": len(self.pool.cache) if self.pool.cache else 0,
            "prefix_hit_tokens": s.prefix_hit_tokens,
            "preemptions": s.preemptions,
            "steps": self.steps,
            **(self.lora.stats() if self.lora is not None else {"lora_slots": 0}),
        }

    def prefix_changes(self) -> tuple[list[bytes], list[bytes]]:
        return self.pool.cache.take_changes() if self.pool.cache is not None else ([], [])

    def prefix_digests(self) -> list[bytes]:
        return self.pool.cache.digests() if self.pool.cache is not None else []

    def resident_adapters(self) -> list[str]:
        return self.lora.resident() if self.lora is not None else []

    def pooling_card(self) -> dict:
        """What the API checks a prefill-only request against before it queues it (services/api/prefill.py)."""
        return {"vocab_size": self.runner.vocab_size, "hidden_size": self.hidden_size,
                "matryoshka_dimensions": self.truncation or None}

    def evict_adapter(self, name: str) -> bool:
        """Unload LoRA adapter `name` (lora.py `LoraManager.evict`); True if it was known."""
        return self.lora.evict(name) if self.lora is not None else False

    def close(self) -> None:
        if self._inflight is not None:  # let the device finish what it was given; its results are dropped
            for result in self._inflight.results():
                result.wait()
            self._inflight = None
        for seq in list(self.scheduler.running) + list(self.scheduler.waiting):
            self.scheduler.drop(seq.uid)
        self._pending.clear()
        self._room = self._free_room()
        if self.grammars is not None:
            self.grammars.close()
        if self.lora is not None:
            self.lora.close()

    # ---- the step

    def step(self) -> list[StepOutput]:
        try:
            return self._step()
        finally:
            self._room = self._free_room()

    def _step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        outputs += self._prepare_grammars()
        outputs += self._prepare_adapters()
        batch = self.scheduler.schedule()
        if self._inflight is not None and (not batch or self._needs_host_tokens(batch)):
            outputs += self._resolve()
            batch = [sc for sc in batch if not sc.seq.ended]  # they stopped on the token just read
        self._room = self._free_room()  # what a read during this step's forward may take
        if not batch:
            if not outputs:
                self._wait_for_grammars()
            return outputs
        self.steps += 1
        try:
            launched = self._launch(batch)
        except Exception as exc:  # a failed forward fails its batch, frees its pages, and the loop goes on
            log.exception("engine step failed; failing %d sequences", len(batch))
            if self._inflight is not None:
                outputs += self._resolve()
            return outputs + self._fail([sc.seq for sc in batch if not sc.seq.ended], f"engine error: {exc}")
        if self._inflight is not None:
            outputs += self._resolve()  # the previous step, while this one runs
        self.scheduler.name_pages([s for s in launched.deferred if not s.ended])
        self._inflight = launched
        if not self.overlap:
            outputs += self._resolve()
        return outputs

    @staticmethod
    def _needs_host_tokens(batch: list[Scheduled]) -> bool:
        """Whether a sequence of the batch needs the token still in flight on the host before its step is
        launched: a grammar's mask and penalties are computed from the tokens so far."""
        return any(sc.seq.unresolved and sc.seq.host_bound for sc in batch)

    def _launch(self, batch: list[Scheduled]) -> _InFlight:
        """Queue the batch's forward and sampling on the device and append each sampling sequence's token
        as UNRESOLVED; nothing here waits for the device."""
        # the sequences that sample (before _forward records the batch as computed)
        sampling = [sc.seq for sc in batch if sc.seq.num_computed + sc.num_new == len(sc.seq.tokens)]
        logits, deferred = self._forward(batch)
        pooled: list[Seq] = []
        pooled_out = None
        if any(s.pooling is not None for s in sampling):
            sampling, logits, pooled, pooled_out = self._pool(sampling, logits)
        if not sampling:
            self._end_pooled(pooled)
            return _InFlight([], [], [], None, deferred, pooled, pooled_out)
        seqs, logit_rows = sampling, list(range(len(sampling)))
        if any(seq.forks for seq in sampling):  # n > 1: the siblings sample from their parent's logits
            seqs, logit_rows = [], []
            for j, seq in enumerate(sampling):
                group = [seq]
                if seq.forks:
                    group += self.scheduler.fork(seq, seq.forks)
                    seq.forks = 0
                seqs.extend(group)
                logit_rows.extend([j] * len(group))
        rows = [SampleRow(s.req.params, s.index, len(s.tokens) - s.prompt_len, s.tokens, s.prompt_len, s.grammar)
                for s in seqs]
        if len(logit_rows) != logits.shape[0]:
            (index,) = to_device([logit_rows], torch.int64, logits.device)
            logits = logits.index_select(0, index)
        out = self.sampler.launch(logits, rows)
        at, context = [], self.max_context
        for k, seq in enumerate(seqs):
            tokens = seq.tokens
            tokens.append(UNRESOLVED)
            seq.unresolved += 1
            seq.pending_row = k
            n = len(tokens)
            seq.final = n - seq.prompt_len >= seq.max_tokens or n >= context
            at.append(n - 1)
        self._end_pooled(pooled)
        return _InFlight(seqs, at, [s.epoch for s in seqs], out, deferred, pooled, pooled_out)

    def _pool(self, sampling: list[Seq], logits: torch.Tensor
              ) -> tuple[list[Seq], torch.Tensor, list[Seq], DeviceResult]:
        """Take the prefill-only sequences out of those that sample: the sequences that still sample and their
        logits, and the others with their results (an embedding, or scores from their logits row) on their way
        to the host, one transfer for all."""
        keep = [j for j, s in enumerate(sampling) if s.pooling is None]
        pooled = [s for s in sampling if s.pooling is not None]
        values = []
        for j, seq in enumerate(sampling):
            p = seq.pooling
            if p is not None:
                values.append(embedding(p, seq.pool_sum, seq.prompt_len) if p.task == "embed" else scores(p, logits[j]))
        if keep and len(keep) != len(sampling):
            (index,) = to_device([keep], torch.int64, logits.device)
            logits = logits.index_select(0, index)
        return [sampling[j] for j in keep], logits, pooled, DeviceResult(values)

    def _end_pooled(self, pooled: list[Seq]) -> None:
        """The prefill-only sequences' pages go back once their step is launched (the device runs the steps in
        order, so a later step that takes a page writes it after this one has read it)."""
        for seq in pooled:
            seq.pool_sum = None
            self.scheduler.finish(seq)

    def _forward(self, batch: list[Scheduled]) -> tuple[torch.Tensor, list[Seq]]:
        """Logits of the sampling rows, and the sequences whose new pages cannot be named yet; a sequence
        that scores its prompt also gets the logits of each prompt position it computes (they score the next
        prompt token)."""
        rows, ids, sample_idx, scored = [], [], [], []
        patch_pos, patch_rows = [], []
        deferred, pooled = [], []  # pooled: (row, its first packed index) of the prefill-only rows
        for sc in batch:
            seq, n = sc.seq, sc.num_new
            c, tokens = seq.num_computed, seq.tokens
            rows.append(RowSpec(seq.pages, c, n))
            first = len(ids)
            if seq.pooling is not None:
                pooled.append((sc, first))
            if n == 1:
                ids.append(tokens[c])
            else:
                ids.extend(tokens[c:c + n])
            ends = c + n == len(tokens)
            if seq.unresolved:
                deferred.append(seq)
                if ends:
                    assert seq.unresolved == 1 and ids[-1] == UNRESOLVED and self._inflight is not None
                    patch_pos.append(len(ids) - 1)  # read on the device from the step in flight
                    patch_rows.append(seq.pending_row)
                    ids[-1] = 0
            if ends:  # it samples
                sample_idx.append(len(ids) - 1)
            if seq.req.params.prompt_logprobs is not None and seq.scores_prompt:
                positions = range(seq.num_computed, min(seq.num_computed + sc.num_new, seq.prompt_len - 1))
                scored.append((seq, [first + p - seq.num_computed for p in positions], positions))
        extra = [i for _, idx, _ in scored for i in idx]
        pending = DeviceTokens(patch_pos, patch_rows, self._inflight.out.ids) if patch_pos else None
        logits = self._run_model(rows, ids, sample_idx + extra, pending, batch=batch, pooled=pooled)
        if scored:
            self._score_prompts(scored, logits[len(sample_idx):])
        self.scheduler.advance(batch)
        self.scheduler.name_pages([sc.seq for sc in batch if not sc.seq.unresolved] if deferred else
                                  [sc.seq for sc in batch])
        return logits[:len(sample_idx)], deferred

    def _run_model(self, rows: list[RowSpec], ids: list[int], keep: list[int], pending: DeviceTokens | None, *,
                   batch: list[Scheduled], pooled: list[tuple[Scheduled, int]]) -> torch.Tensor:
        """The packed forward's logits at `keep`; the embeddings among the rows (`pooled`) add the hidden states
        they pool to their sequences, on the device."""
        adapters = None  # the rows' adapter slots, when some row has one (a base-only step runs the model as is)
        if self.lora is not None and any(sc.seq.adapter_slot for sc in batch):
            adapters = [sc.seq.adapter_slot for sc in batch]
        hidden_idx, spans = _hidden_rows(pooled) if pooled else ([], [])
        if not hidden_idx:
            return self.runner.forward(rows, ids, keep, pending, adapters)
        logits, hidden = self.runner.forward_hidden(rows, ids, keep, hidden_idx, device_tokens=pending,
                                                     adapters=adapters)
        _add_pooled(spans, hidden)
        return logits

    @staticmethod
    def _score_prompts(scored: list, logits: torch.Tensor) -> None:
        lp = torch.log_softmax(logits, -1)
        at = 0
        for seq, idx, positions in scored:
            rows = lp[at:at + len(idx)]
            at += len(idx)
            k = min(seq.req.params.prompt_logprobs or 0, rows.shape[-1])
            nxt = torch.tensor([seq.tokens[p + 1] for p in positions], device=rows.device, dtype=torch.long)
            chosen = rows.gather(-1, nxt[:, None])[:, 0].tolist()
            tops = rows.topk(k, -1) if k else None
            for j, p in enumerate(positions):  # by position: a preempted prefill scores the same again
                top = list(zip(tops.indices[j].tolist(), tops.values[j].tolist(), strict=True)) if tops else []
                seq.scores[p] = (chosen[j], top)

    def _resolve(self) -> list[StepOutput]:
        """Wait for the step in flight and turn its tokens into outputs (the step's one host sync)."""
        flight, self._inflight = self._inflight, None
        assert flight is not None
        outputs = _pooled_outputs(flight) if flight.pooled else []
        if flight.out is None:
            return outputs
        result = flight.out.result()
        refused = []
        with_logprobs = bool(flight.out.want)
        for k, (seq, at, epoch, tok) in enumerate(zip(flight.seqs, flight.token_index, flight.epochs, result.ids,
                                                      strict=True)):
            if seq.ended or seq.epoch != epoch:
                continue  # aborted, stopped or preempted since the step was launched: its token is dropped
            out = self._accept(seq, at, tok)
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

    def _accept(self, seq: Seq, at: int, tok: int) -> StepOutput | None:
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
            finish = self._finish_reason(seq, tok, produced, at + 1)
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
            outputs += self._fail([seq], seq.grammar.refusal, 400, self._guided_param([seq]))
        return outputs

    def _finish_reason(self, seq: Seq, tok: int, produced: int, length: int) -> str | None:
        """Why the sequence ends with `tok`, its `produced`-th completion token and its `length`-th token."""
        p = seq.req.params
        if produced >= p.min_tokens and ((tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids):
            return "stop"
        if seq.grammar is not None and seq.grammar.done:
            return "stop"
        if produced >= seq.max_tokens or length >= self.max_context:
            return "length"
        return None

    def _fail(self, seqs: list[Seq], error: str, status: int = 500, param: str | None = None) -> list[StepOutput]:
        outputs, failed = [], set()
        for seq in seqs:
            if seq.uid not in failed:  # the whole request fails, with every choice
                failed.add(seq.uid)
                for s in self.scheduler.drop(seq.uid):
                    for index in range(s.index, s.index + s.forks + 1):  # unforked choices fail too
                        outputs.append(StepOutput(s.uid, s.completion_len, [], index, "error", error=error,
                                                  error_status=status, error_param=param))
        return outputs


def _hidden_rows(rows: list[tuple[Scheduled, int]]) -> tuple[list[int], list[tuple[Seq, int, int, int]]]:
    """The packed token indices whose final hidden states the embeddings of these rows pool (pooling.py), and per
    such sequence (seq, its first index in them, how many, the prompt position pooled up to after this step):
    last pooling reads its last prompt token, mean pooling every position of the chunk not summed before."""
    idx: list[int] = []
    spans = []
    for sc, first in rows:
        seq = sc.seq
        p = seq.pooling
        if p is None or p.task != "embed":
            continue
        c, n = seq.num_computed, sc.num_new
        if p.pooling == "mean":
            positions = range(max(c, seq.pooled_upto), c + n)
        elif c + n == len(seq.tokens):
            positions = range(c + n - 1, c + n)
        else:
            continue
        if positions:
            spans.append((seq, len(idx), len(positions), c + n))
            idx.extend(first + q - c for q in positions)
    return idx, spans


def _add_pooled(spans: list[tuple[Seq, int, int, int]], hidden: torch.Tensor) -> None:
    """Add each sequence's hidden states of the step to its pooled state, on the device."""
    for seq, at, k, upto in spans:
        part = hidden[at:at + k].sum(0)
        mean = seq.pools_every_token
        seq.pool_sum = part if seq.pool_sum is None or not mean else seq.pool_sum + part
        seq.pooled_upto = upto


def _pooled_outputs(flight: _InFlight) -> list[StepOutput]:
    """The prefill-only requests' one output each: finished, with their embedding or scores."""
    assert flight.pooled_out is not None
    outputs = []
    for seq, values in zip(flight.pooled, flight.pooled_out.wait(), strict=True):
        p = seq.pooling
        assert p is not None
        out = StepOutput(seq.uid, 0, [], 0, "stop", cached_tokens=max(seq.cached_tokens, 0))
        if p.task == "embed":
            out.embedding = float32_bytes(values)
        else:
            out.scores = values
        outputs.append(out)
    return outputs
