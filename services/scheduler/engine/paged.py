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
from typing import TYPE_CHECKING

import torch

from services.scheduler.engine.base import EngineRequest, StepOutput
from services.scheduler.engine.config import EngineConfig, make_backend, make_lora
from services.scheduler.engine.grammar import GrammarCache
from services.scheduler.engine.intake import ModelLimits, RequestIntake
from services.scheduler.engine.kv_cache import KVCache, PagePool, pages_for
from services.scheduler.engine.launch import InFlight, StepLauncher
from services.scheduler.engine.lora_weights import AdapterSource
from services.scheduler.engine.model_geometry import attention_geometry, max_context
from services.scheduler.engine.model_runner import ModelRunner
from services.scheduler.engine.pooling import truncatable
from services.scheduler.engine.prefix_cache import PrefixCache
from services.scheduler.engine.resolve import StepResolver
from services.scheduler.engine.sampling import Sampler
from services.scheduler.engine.scheduler import BatchScheduler, Scheduled
from services.scheduler.engine.warm_up import run_warm_up

if TYPE_CHECKING:
    from services.scheduler.engine.tp_group import TensorParallelGroup

log = logging.getLogger(__name__)


class PagedEngine:
    """The Engine interface (base.py) over the step's parts: requests in (intake.py), a step launched
    (launch.py) and its results read (resolve.py), one step late when steps overlap."""

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
        self.launcher = StepLauncher(self.scheduler, self.runner, self.sampler, self.max_context, self.lora is not None)
        self.resolver = StepResolver(self.scheduler, self.eos_ids, self.max_context)
        limits = ModelLimits(self.runner.vocab_size, self.hidden_size, self.truncation, self.max_context,
                             config.page_size)
        self.intake = RequestIntake(self.scheduler, self.pool, limits, self.lora, self.resolver)
        self._inflight: InFlight | None = None
        self.group: TensorParallelGroup | None = None  # tensor parallelism: this is rank 0 (join)
        self.steps = 0
        self._pending: list[StepOutput] = []  # outputs due without a forward (resumed, finished)
        # What room() answers: the scheduler asks from its event loop while a step runs in its thread (it reads
        # new requests then), so room is computed only by whoever mutates the queues (the step thread in a step;
        # add and abort, between steps) and published as one int, never read off the queues.
        self._room = self._free_room()
        log.info("paged engine: %s attention, %d pages x %d tokens, context %d", backend.name,
                 self.pool.usable, config.page_size, self.max_context)

    def join(self, group: TensorParallelGroup) -> None:
        """Run as rank 0 of a tensor-parallel group (tp_group.py): each forward is broadcast to the other ranks,
        and the pages cleared here are cleared there."""
        self.group = self.runner.tp = group
        self.kv.on_zero = group.note_zero

    def warm_up(self) -> float:
        """Run every batch shape once (kernels compile, buffers are allocated) and leave the engine as it
        was; the seconds it took. The factory calls it before the worker reports ready."""
        return run_warm_up(self.runner, self.sampler, self.kv, self.config, self.max_context)

    @property
    def grammars(self) -> GrammarCache | None:
        """Structured outputs (grammar.py); set by the factory, None where the engine serves none."""
        return self.intake.grammars

    @grammars.setter
    def grammars(self, grammars: GrammarCache | None) -> None:
        self.intake.grammars = grammars

    # ---- Engine interface

    def add(self, req: EngineRequest) -> int:
        """Queue a request and return its max_tokens (an omitted one resolved); raise RequestRejected if
        it can never be served."""
        max_tokens, ended = self.intake.add(req)
        self._pending += ended
        self._room = self._free_room()
        return max_tokens

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
            **(self.group.stats() if self.group is not None else {}),
        }

    def prefix_changes(self) -> tuple[list[bytes], list[bytes]]:
        return self.pool.cache.take_changes() if self.pool.cache is not None else ([], [])

    def prefix_digests(self) -> list[bytes]:
        return self.pool.cache.digests() if self.pool.cache is not None else []

    def resident_adapters(self) -> list[str]:
        return self.lora.resident() if self.lora is not None else []

    def pooling_card(self) -> dict:
        """What the API checks a prefill-only request against before it queues it
        (services/api/pooling_api/prefill.py)."""
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
        if self.group is not None:
            self.group.stop()

    # ---- the step

    def step(self) -> list[StepOutput]:
        try:
            return self._step()
        finally:
            self._room = self._free_room()

    def _step(self) -> list[StepOutput]:
        outputs, self._pending = self._pending, []
        outputs += self.intake.prepare_grammars()
        outputs += self.intake.prepare_adapters()
        batch = self.scheduler.schedule()
        if self._inflight is not None and (not batch or self._needs_host_tokens(batch)):
            outputs += self._resolve()
            batch = [sc for sc in batch if not sc.seq.ended]  # they stopped on the token just read
        self._room = self._free_room()  # what a read during this step's forward may take
        if not batch:
            if not outputs:
                self.intake.wait_for_grammars()
            return outputs
        self.steps += 1
        try:
            launched = self.launcher.launch(batch, self._inflight)
        except Exception as exc:  # a failed forward fails its batch, frees its pages, and the loop goes on
            log.exception("engine step failed; failing %d sequences", len(batch))
            if self._inflight is not None:
                outputs += self._resolve()
            return outputs + self.resolver.fail([sc.seq for sc in batch if not sc.seq.ended], f"engine error: {exc}")
        if self._inflight is not None:
            outputs += self._resolve()  # the previous step, while this one runs
        self.scheduler.name_pages([s for s in launched.deferred if not s.ended])
        self._inflight = launched
        if not self.overlap:
            outputs += self._resolve()
        return outputs

    def _resolve(self) -> list[StepOutput]:
        """Wait for the step in flight and turn its tokens into outputs (the step's one host sync)."""
        flight, self._inflight = self._inflight, None
        assert flight is not None
        return self.resolver.resolve(flight, flight.out.result() if flight.out is not None else None)

    @staticmethod
    def _needs_host_tokens(batch: list[Scheduled]) -> bool:
        """Whether a sequence of the batch needs the token still in flight on the host before its step is
        launched: a grammar's mask and penalties are computed from the tokens so far."""
        return any(sc.seq.unresolved and sc.seq.host_bound for sc in batch)
