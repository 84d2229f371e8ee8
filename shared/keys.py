"""Every Redis key rsinfer uses, built in one place (docs/design.md, "Redis keys").

No other module spells a key. A namespace prefix lets several releases share one Redis.

On a Redis Cluster a command that names several keys must find them in one hash slot. Every key of a request
carries its uid as hash tag (`{<uid>}`): its record, reply stream and abort flags share a slot, and the API makes
the uids its reply hub shard reads together fall in that shard's slot, the slot of its control stream's tag
(shared/slots.py). Stage streams have no tag: each model's streams spread over the cluster by their names. The keys
of prefix-aware routing (a scheduler's own stream, the pages it caches, who has a stream) carry a tag in the slot of
the model's schedule stream (`routing_tag`), so that one XREADGROUP reads a scheduler's own stream and the shared
one, and one script ends a departed scheduler's stream and its set together. The keys of fair queueing (a tenant's
parked jobs, the model's queue count) carry a tag in the slot of the model's tokenize stream (`fair_tag`), for the
same reasons: the tokenizers read parked jobs as lanes of the tokenize group, and one script counts a model's
queue across its tenants.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.slots import slot_tag

TOKENIZER_GROUP = "tokenizer"
SCHEDULER_GROUP = "scheduler"
DETOKENIZER_GROUP = "detokenizer"

STAGES = ("tokenizer", "scheduler", "detokenizer")
ROLES = (*STAGES, "api")


@dataclass(frozen=True)
class Keys:
    namespace: str = "rsinfer"

    def tokenize(self, model: str) -> str:
        return f"{self.namespace}:tokenize:{model}"

    def schedule(self, model: str) -> str:
        return f"{self.namespace}:schedule:{model}"

    def routing_tag(self, model: str) -> str:
        """Hash tag in the slot of the model's (untagged) schedule stream: every routing key of the model has it."""
        return slot_tag(self.schedule(model))

    def scheduler_stream(self, model: str, scheduler_id: str) -> str:
        """One scheduler's own stream of schedule jobs, beside the shared one (same group `scheduler`): the
        tokenizer routes there the jobs whose prefix that scheduler caches
        (docs/design.md, "Prefix-aware routing")."""
        return f"{self.namespace}:schedule:{model}:{{{self.routing_tag(model)}}}:{scheduler_id}"

    def cached_pages(self, model: str, scheduler_id: str) -> str:
        """Set of the hex digests of the full KV pages a scheduler's prefix cache holds."""
        return f"{self.namespace}:pages:{model}:{{{self.routing_tag(model)}}}:{scheduler_id}"

    def routed(self, model: str) -> str:
        """Set of the ids of the model's schedulers that have a stream of their own (live or not yet drained)."""
        return f"{self.namespace}:routed:{model}:{{{self.routing_tag(model)}}}"

    def prefix_routing(self, model: str) -> str:
        """Flag (a tokenizer's id, expiring with its heartbeat) set while a tokenizer of the model routes by prefix:
        the model's schedulers join prefix routing once they see it (services/scheduler/lanes.py `SchedulerLanes`)."""
        return f"{self.namespace}:routing:{model}:{{{self.routing_tag(model)}}}"

    # -- fair queueing (services/tokenizer/holding.py, shared/queued.py): every key of one model carries `fair_tag`
    def fair_tag(self, model: str) -> str:
        """Hash tag in the slot of the model's (untagged) tokenize stream."""
        return slot_tag(self.tokenize(model))

    def parked(self, model: str, tenant: str) -> str:
        """Stream of a tenant's tokenized jobs (ScheduleJob) parked by a tokenizer whose hold was full, read in
        that tenant's turns by any tokenizer (the `tokenizer` group: a lane of the tokenize stream)."""
        return f"{self.namespace}:parked:{model}:{{{self.fair_tag(model)}}}:{tenant}"

    def parked_tenants(self, model: str) -> str:
        """Set of the tenants of the model that have a parked stream (removed with the stream once drained)."""
        return f"{self.namespace}:parked-tenants:{model}:{{{self.fair_tag(model)}}}"

    def queued(self, model: str) -> str:
        """Sorted set of the model's queued jobs (admitted, not yet started by a scheduler): member = "<uid>
        <tenant>", score = its deadline, past which it no longer counts (its process died)."""
        return f"{self.namespace}:queued-jobs:{model}:{{{self.fair_tag(model)}}}"

    def queued_tenants(self, model: str) -> str:
        """Hash of the model's tenants with jobs queued: `c:<tenant>` -> how many, `w:<tenant>` -> its key's
        `weight` (its share of the queue); `~exp` -> when the two keys expire (shared/queued.py)."""
        return f"{self.namespace}:queued-by-tenant:{model}:{{{self.fair_tag(model)}}}"

    def detokenize(self, model: str) -> str:
        return f"{self.namespace}:detokenize:{model}"

    def reply(self, uid: str) -> str:
        return f"{self.namespace}:reply:{{{uid}}}"

    def abort(self, uid: str) -> str:
        return f"{self.namespace}:abort:{{{uid}}}"

    def aborts(self, model: str) -> str:
        """Stream of abort notifications of a model's requests (`uid`, `reason`, `choice`): its schedulers
        read it once per step instead of every running request's flag."""
        return f"{self.namespace}:aborts:{model}"

    def choice_stop(self, uid: str, index: int) -> str:
        """A choice of an n > 1 request ended by a stop string: its scheduler stops generating it."""
        return f"{self.namespace}:abort:{{{uid}}}:{index}"

    def request(self, uid: str) -> str:
        return f"{self.namespace}:req:{{{uid}}}"

    def response(self, uid: str) -> str:
        """A stored response of the Responses API (services/api/responses_api/response_store.py), a hash under the
        request's hash tag: `tenant` (its owner, read before anything else), `meta` (the fields its object echoes, how
        its answers are parsed, the response it continues), `input` (its own input items) and, once it ended,
        `final` (its final object), each JSON."""
        return f"{self.namespace}:response:{{{uid}}}"

    def file(self, file_id: str) -> str:
        """A stored file's metadata (hash: filename, purpose, bytes, created_at); its contents are in the object
        store (shared/storage.py) under `files/<id>`."""
        return f"{self.namespace}:file:{{{file_id}}}"

    def batch(self, batch_id: str) -> str:
        """A batch of the Batch API (hash: status, endpoint, files, counts, timestamps;
        services/api/batch_api/batches.py)."""
        return f"{self.namespace}:batch:{{{batch_id}}}"

    def batches(self) -> str:
        """Every batch by creation time (sorted set: batch id -> created_at), for an admin's GET /v1/batches."""
        return f"{self.namespace}:batches"

    def tenant_batches(self, tenant: str) -> str:
        """One tenant's batches by creation time (sorted set: batch id -> created_at), for its GET /v1/batches."""
        return f"{self.namespace}:batches:{{t:{tenant}}}"

    def batch_work(self, tenant: str = "") -> str:
        """Stream of one tenant's batches to run (`batch`: its id; open mode's tenant "" has the plain name), read
        by every API process's batch runner in the `batch` consumer group, in turns across tenants: a runner
        that dies leaves its entry pending, and another claims it. An entry is deleted once acknowledged."""
        return f"{self.namespace}:batch-work" + (f":{tenant}" if tenant else "")

    def batch_tenants(self) -> str:
        """Set of the tenants that have created batches: whose `batch_work` streams the runners read. No TTL:
        bounded by the keys file's tenants."""
        return f"{self.namespace}:batch-tenants"

    def tenant_files(self, tenant: str) -> str:
        """Sorted set of one tenant's stored files (file id -> the unix time its metadata expires): its
        GET /v1/files and its --max-files-per-tenant; an expired member is removed at the next count."""
        return f"{self.namespace}:files:{{t:{tenant}}}"

    def tenant_file_bytes(self, tenant: str) -> str:
        """Hash of the bytes of each of `tenant_files` (file id -> bytes) and their sum (`_total`), for
        --max-file-bytes-per-tenant; same hash tag, so one script keeps both."""
        return f"{self.namespace}:file-bytes:{{t:{tenant}}}"

    def inflight(self) -> str:
        """Sorted set of the requests in flight: member = uid, score = its deadline (unix s). Entered with the
        record (`RequestStore.create`), left when the record turns terminal (`RequestStore.set_status`); what
        `rsinfer inspect` and an operator list without SCAN."""
        return f"{self.namespace}:inflight"

    def request_pattern(self) -> str:
        return f"{self.namespace}:req:*"

    def uid_of_request_key(self, key: str) -> str:
        return key.removeprefix(f"{self.namespace}:req:").removeprefix("{").removesuffix("}")

    def worker(self, role: str, worker_id: str) -> str:
        return f"{self.namespace}:worker:{role}:{worker_id}"

    def workers(self) -> str:
        """Sorted set of `role:id` scored by last heartbeat: lists workers without SCAN."""
        return f"{self.namespace}:workers"

    def models(self) -> str:
        """Hash of declared models, field `<role>:<model>` = JSON of what that stage reports of the model.
        No TTL: a declaration is configuration, not liveness, so a model stays known at zero workers."""
        return f"{self.namespace}:models"

    def adapters(self) -> str:
        """Hash of the LoRA adapters clients may name as `model`: field = the adapter's name, value = the JSON of
        its `AdapterRecord` (shared/adapter_registry.py). No TTL: a registration is configuration, bounded by
        --max-adapters."""
        return f"{self.namespace}:adapters"

    def dead(self) -> str:
        return f"{self.namespace}:dead"

    def control(self, pod: str, shard: int, tag: str) -> str:
        """Stream that wakes a blocked reply reader (one shard of an API process's hub) when a request starts;
        `tag` puts it in the slot of the reply streams that shard reads."""
        return f"{self.namespace}:ctl:{{{tag}}}:{pod}:{shard}"

    # -- tenants (services/api/multitenancy/tenancy.py): every key of one tenant's quota carries the tag
    # `{t:<tenant>}`, so the admission script's keys share a hash slot on a cluster
    def quota_slots(self, tenant: str) -> str:
        """Sorted set of the tenant's concurrency leases: member = the lease id (a request uid), score = the unix
        time it expires at unless its API process refreshes it (a crashed process's leases expire)."""
        return f"{self.namespace}:quota:{{t:{tenant}}}:slots"

    def quota_window(self, tenant: str) -> str:
        """Hash of the tenant's current one-minute window: `w` (its index, unix minutes), `req` (requests admitted
        in it), `tok` (prompt and generated tokens counted in it). Expires two minutes after its last write."""
        return f"{self.namespace}:quota:{{t:{tenant}}}:window"

    def stored_responses(self, tenant: str) -> str:
        """Sorted set of a tenant's stored responses: member = the uid, score = the unix time it expires at (a
        reservation not yet written expires sooner); pruned as it is read
        (services/api/responses_api/response_store.py)."""
        return f"{self.namespace}:stored:{{t:{tenant}}}"

    def stored_response_bytes(self, tenant: str) -> str:
        """Hash of the bytes of a tenant's stored responses: field = the uid, and `#total` their sum."""
        return f"{self.namespace}:stored:{{t:{tenant}}}:bytes"

    def usage(self) -> str:
        """Hash of every tenant's usage since the counters began: field `<tenant>:<counter>` (requests,
        prompt_tokens, cached_tokens, generated_tokens). No TTL: accounting, bounded by the keys file's tenants."""
        return f"{self.namespace}:usage"

    def stage_stream(self, stage: str, model: str) -> str:
        return {"tokenizer": self.tokenize, "scheduler": self.schedule,
                "detokenizer": self.detokenize}[stage](model)
