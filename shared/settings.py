"""Settings of every process, parsed once at the entry point and passed down.

Each field is a `--kebab-case` flag and an `RSINFER_UPPER_CASE` environment variable; a flag wins over
the environment, the environment over the default. rsinfer/flags.py builds the argparse flags from the
fields (and groups them in `--help`) so that the CLI, the environment and the Helm chart cannot drift apart.
"""

from __future__ import annotations

import os
import secrets
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DEMO_MODEL_NAME = "rsinfer-demo"
PROCESS_START = f"{os.getpid()}.{secrets.token_hex(2)}"


class EnvSettings(BaseSettings):
    """The base of every settings class: fields read from `RSINFER_<NAME>` too, frozen once parsed."""

    model_config = SettingsConfigDict(env_prefix="RSINFER_", extra="ignore", frozen=True)


# -- Secrets from files: a flag's value shows in `ps`, a file's does not -----------------------------------------
class SecretFiles(EnvSettings):
    """`<secret>_file` settings: the secret is read from that file (trailing newline dropped), e.g. a mounted
    Secret or one `rsinfer up` wrote, so that it shows neither in `ps` nor in the environment."""

    redis_password_file: str = Field("", description="file holding the Redis password (instead of --redis-password, "
                                     "which `ps` shows)")

    @model_validator(mode="after")
    def _read_secret_files(self) -> SecretFiles:
        for name in ("redis_password", "api_key", "responses_key"):
            path = getattr(self, f"{name}_file", "")
            if not path:
                continue
            if getattr(self, name, None):
                raise ValueError(f"give {name} or {name}_file, not both")
            object.__setattr__(self, name, Path(path).read_text().rstrip("\r\n"))  # frozen: set once, here
        return self


class RedisSettings(SecretFiles):
    """The Redis every process talks through and the namespace of its keys: all that `rsinfer inspect` needs."""

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis URL every stage talks through")
    redis_password: str | None = Field(None, description="Redis password (overrides one in the URL)")
    redis_tls_ca: str | None = Field(None, description="CA bundle for rediss:// URLs")
    redis_cluster: Literal["auto", "yes", "no"] = Field("auto", description="whether --redis-url is a node of a "
                                                        "Redis Cluster; auto = ask the server")
    namespace: str = Field("rsinfer", description="prefix of every Redis key, so releases can share a Redis")

    def redis_options(self) -> dict:
        """What shared/redis_conn.py connects with: password, CA bundle and cluster mode."""
        opts: dict = {"cluster": self.redis_cluster}
        if self.redis_password:
            opts["password"] = self.redis_password
        if self.redis_tls_ca:
            opts["ssl_ca_certs"] = self.redis_tls_ca
        return opts


class WorkerSettings(EnvSettings):
    """Who a worker is and how long its heartbeat says it lives (its processes and `rsinfer healthcheck`)."""

    worker_id: str = Field("", description="this process's name (e.g. the pod's); its id in heartbeats and "
                           "consumer groups is <name>@<start>, unique per process start (default name: host)")
    heartbeat_ttl_s: float = Field(5.0, description="a worker whose heartbeat is older is dead")

    def name(self) -> str:
        return self.worker_id or socket.gethostname()

    def identity(self) -> str:
        """`<name>@<pid>.<random>`: a process restarted under the same name (a pod's container restart) is
        another worker, so its predecessor's requests are seen as orphaned and its consumer as gone."""
        return f"{self.name()}@{PROCESS_START}"


class CommonSettings(RedisSettings, WorkerSettings):
    log_level: str = Field("INFO", description="logging level")
    heartbeat_interval_s: float = Field(1.0, description="seconds between heartbeats")
    request_ttl_s: int = Field(600, description="TTL of every per-request key, refreshed while it lives")
    reply_maxlen: int = Field(8192, ge=16, description="approximate cap on entries in one reply stream")
    otlp_endpoint: str | None = Field(None, description="OTLP/HTTP collector for traces (e.g. "
                                      "http://otel-collector:4318); none = tracing off")


class StorageSettings(EnvSettings):
    """Where file contents (Batch API input, output and error files) and LoRA adapter folders live
    (shared/storage.py): mixed into the settings of the API, which stores files, and of the scheduler, which
    fetches adapters. Every process that shares files must name the same store."""

    storage_url: str = Field("", description="object storage: file:///dir (a directory every process that "
                             "shares files can read and write) or s3://bucket/prefix; empty = "
                             "$RSINFER_CACHE/storage, else ~/.cache/rsinfer/storage (one machine only)")
    storage_endpoint_url: str | None = Field(None, description="S3-compatible server (MinIO, Ceph, ...) for s3:// "
                                             "URLs, e.g. http://minio:9000; none = AWS (or $AWS_ENDPOINT_URL_S3). "
                                             "Credentials: the standard AWS variables, profiles or roles")
    storage_region: str | None = Field(None, description="S3 region; none = $AWS_REGION / $AWS_DEFAULT_REGION")
    storage_addressing_style: Literal["auto", "path", "virtual"] = Field(
        "auto", description="S3 bucket addressing: path (http://host/bucket/key, what most S3-compatible "
        "servers want), virtual (http://bucket.host/key) or auto")
    storage_part_bytes: int = Field(8 << 20, ge=5 << 20, description="S3 multipart part size: uploads larger "
                                    "go up in parts of this size, each upload holding one in memory")
    storage_cache_dir: str = Field("", description="local directory adapter folders are fetched into from "
                                   "the store; empty = $RSINFER_CACHE/storage-cache, else "
                                   "~/.cache/rsinfer/storage-cache")
    max_file_bytes: int = Field(512 << 20, ge=1, description="most bytes of one stored file: an upload "
                                "past it is refused with a 413 and leaves nothing; also the cap of one "
                                "adapter folder fetched from the store")

    @field_validator("storage_url")
    @classmethod
    def _storage_url_parses(cls, url: str) -> str:
        from shared.storage_url import parse_storage_url

        parse_storage_url(url)
        return url


class AdapterSettings(EnvSettings):
    """The LoRA adapter registry (shared/adapter_registry.py): mixed into the settings of the API, which registers
    adapters (`POST /v1/load_lora_adapter`), and of the scheduler, which serves them; `--lora-modules` registers some at
    start (either process may be given them)."""

    lora_modules: str = Field("", json_schema_extra={"nargs": "+"}, description="LoRA adapters registered at "
                              "start, separated by spaces: `name=path` (a PEFT folder every scheduler and API "
                              "process can read, or an s3:// or file:// URL inside --storage-url's store), or "
                              "vLLM's JSON form {\"name\": ..., \"path\": ..., \"base_model_name\": ...}; "
                              "a scheduler registers them on its model")
    max_adapters: int = Field(256, ge=1, le=100_000, description="most LoRA adapters registered at once, every "
                              "model together: a load past it is refused with a 400")
    max_lora_name_chars: int = Field(128, ge=1, le=200, description="longest LoRA adapter name (`lora_name`, and "
                                     "what requests send as `model`)")
    max_lora_path_chars: int = Field(1024, ge=1, le=4096, description="longest `lora_path` of a LoRA adapter")
    lora_roots: str = Field("", json_schema_extra={"nargs": "+"}, description="directories local LoRA adapter "
                            "folders may be loaded from by POST /v1/load_lora_adapter, separated by spaces: "
                            "a folder outside them is refused (400 `lora_path`); empty: no local folder, only URLs "
                            "in the object store (--storage-url). --lora-modules paths are the operator's own and "
                            "load wherever they are")

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules_parse(cls, text: str) -> str:
        from shared.adapter_registry import parse_lora_modules

        parse_lora_modules(text)  # a ValueError naming the entry: the process does not start
        return text

    @field_validator("lora_roots")
    @classmethod
    def _lora_roots_absolute(cls, text: str) -> str:
        relative = [root for root in text.split() if not root.startswith("/")]
        if relative:
            raise ValueError(f"--lora-roots: {relative[0]!r} is not an absolute path")
        return text


# -- Worker liveness (shared/liveness.py): a local file, so that a Redis outage never fails a liveness probe --
class LivenessSettings(EnvSettings):
    liveness_file: str = Field("", description="file a stage worker touches while its loop moves, which `rsinfer "
                               "healthcheck` reads; empty = <temp dir>/rsinfer-<namespace>-<role>-<name>.alive")


class StageSettings(CommonSettings, LivenessSettings):
    """What tokenizer, scheduler and detokenizer share: the model they serve and how they consume."""

    model: str | None = Field(None, description="local HF checkpoint folder or hub id; none = demo model")
    served_model_name: str | None = Field(None, description="name clients use; default: folder name")
    batch_size: int = Field(64, ge=1, description="most stream entries taken in one read")
    # Short: a live worker's held entries are touched every claim_idle_ms / 3 by a task of their own, however
    # long a step runs (StageWorker.keep_alive), so only a dead or frozen peer's entries get this old.
    claim_idle_ms: int = Field(3_000, ge=100, description="claim a dead peer's entries after this idle")
    trust_remote_code: bool = Field(False, description="allow model code from the checkpoint")
    grace_period_s: float = Field(20.0, ge=0, description="on SIGTERM, how long in-flight work may finish "
                                  "before the rest is handed to a peer")
    metrics_port: int = Field(0, ge=0, le=65535, description="serve this worker's Prometheus metrics on this "
                              "port; 0 = off")
    max_deliveries: int = Field(5, ge=1, description="an entry claimed after this many deliveries is poison: "
                                "it goes to the dead-letter stream and its client gets an error (each delivery "
                                "ended with its worker failing or gone)")


class TokenizerSettings(StageSettings):
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "none"] = Field(
        "auto", description="format of the model's tool calls; auto = the one its chat template writes")
    reasoning_parser: Literal["auto", "qwen3", "none"] = Field(
        "auto", description="how the model marks its thinking; auto = qwen3 when the template has <think>")
    default_max_tokens: int | None = Field(None, ge=0, description="completion tokens of a request that sets no "
                                           "max_tokens (chat, Responses, completions' null); unset: the "
                                           "checkpoint's generation_config.json max_new_tokens if it has one (the "
                                           "demo model's: 256), else up to the context; 0 = up to the context")
    # An entry is handled within milliseconds, and a dead one's entries stall every stream behind them.
    claim_idle_ms: int = Field(1_000, ge=100, description="claim a dead peer's entries after this idle")
    prefix_routing: bool = Field(False, description="send each job to the scheduler whose prefix cache holds the "
                                 "most of its prompt, through its own stream; no hit: the shared schedule stream")
    prefix_routing_load_tokens: float = Field(64.0, ge=0, description="prefix routing: cached tokens a request costs")
    prefix_routing_max_skew: float = Field(2.0, ge=0, description="prefix routing: most requests a scheduler chosen "
                                           "for its cache holds over the least loaded one; past it: the shared stream")
    # Fair queueing (services/tokenizer/fair.py): the backlog is held here, in tenants' lanes, instead of in the
    # schedule stream, which the schedulers read first come first served.
    fair_queueing: bool | None = Field(None, description="hold tokenized jobs and release them to the schedulers "
                                       "in turns per tenant (weighted by the key's `weight`), only while the schedule "
                                       "stream's backlog is below --fair-watermark; off: forward each job at once; "
                                       "unset: on for the jobs that carry a tenant (the API has keys)")
    fair_watermark: int = Field(4, ge=1, le=10_000, description="fair queueing: release held jobs while fewer than "
                                "this many schedule entries (every scheduler stream together) wait for a scheduler")
    fair_max_held: int = Field(512, ge=1, le=100_000, description="fair queueing: most jobs one tokenizer holds in "
                               "memory; past it, a tenant over its share of them has its jobs parked in Redis (read "
                               "back in its turns), and reading goes on")
    fair_poll_ms: int = Field(10, ge=1, le=1000, description="fair queueing: how often the schedule stream's "
                              "backlog is looked at while jobs are held")


class DetokenizerSettings(StageSettings):
    # As the tokenizer's: one held detokenize entry is a step of every request of one scheduler.
    claim_idle_ms: int = Field(1_000, ge=100, description="claim a dead peer's entries after this idle")


class SchedulerSettings(StageSettings, StorageSettings, AdapterSettings):
    batch_size: int = Field(16, ge=1, description="most new requests taken in one read")
    # Its keep-alive touches held entries every third of this (StageWorker.keep_alive); a claim costs a resume,
    # which recomputes the request's prefix, so longer than the tokenizer's (2 s gave no better soak than 3 s).
    claim_idle_ms: int = Field(3_000, ge=100, description="claim a dead peer's entries after this idle")
    stream_interval: int = Field(1, ge=1, description="engine steps whose tokens one delta per choice carries")
    stream_flush_ms: float = Field(40.0, ge=0, le=1000, description="most ms a choice's tokens may wait to merge "
                                   "into one delta (a choice's first token and end go at once; 0 = a delta per step)")
    stream_entry_rate: float = Field(5_000.0, ge=0, description="deltas per second this scheduler aims at over all "
                                     "its choices: a token waits choices / rate s, at most --stream-flush-ms (0 = "
                                     "always that long)")
    engine: Literal["paged", "simple", "synthetic"] = Field("paged", description="engine behind the scheduler; "
                                                            "synthetic: pseudo-random tokens, no model, to "
                                                            "measure the plumbing alone")
    step_ms: float = Field(20.0, ge=0, description="synthetic engine: milliseconds each step takes (it "
                           "computes nothing; one token per running sequence per step)")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="where the model runs")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field("auto", description="weights dtype")
    threads: int = Field(0, ge=0, description="torch CPU threads; 0 = half the cores, at least 1")
    max_running: int = Field(64, ge=1, description="most requests in the running batch")
    max_kv_tokens: int = Field(0, ge=0, description="KV cache size in tokens; 0 = from memory fraction")
    kv_memory_fraction: float = Field(0.85, gt=0, le=1, description="share of the GPU memory left after "
                                      "the warm-up (weights, workspace, CUDA graphs, peak activations) that "
                                      "the KV cache takes; on CPU, of half the available RAM")
    page_size: int = Field(16, ge=1, description="tokens per KV page")
    chunk_size: int = Field(512, ge=16, description="most prompt tokens prefilled in one step")
    prefix_cache: bool = Field(True, description="reuse KV pages of shared prompt prefixes")
    cuda_graphs: bool | None = Field(None, description="replay decode steps from CUDA graphs; unset: on wherever "
                                     "the engine runs on CUDA with flashinfer attention")
    overlap: bool | None = Field(None, description="launch each engine step on the device before the previous "
                                 "one's tokens are read back, so the host's work hides behind the GPU's; "
                                 "unset: on CUDA")
    # -- bounds on what one request may cost the pipeline (issue 18)
    detokenize_budget_mb: float = Field(256.0, gt=0, description="approximate bytes (MiB) the model's detokenize "
                                        "stream may hold: MAXLEN ~ this over the mean entry size (at least 1,000 "
                                        "steps); reached only if no detokenizer reads for minutes")
    grammar_mask_budget_ms: float = Field(20.0, gt=0, description="CPU time one constrained choice's token mask "
                                          "may take in an engine step (a mask costs ~25 µs at 1k tokens, ~200 µs at "
                                          "152k); a request whose grammar takes longer fails with a 400, checked "
                                          "on its first masks before it joins the batch and at every step")
    # -- LoRA adapters in the paged engine (services/scheduler/engine/lora.py): slots of stacked weights on the
    # device, loaded and evicted at run time; their memory comes out of the KV cache's.
    max_loras: int = Field(0, ge=0, le=256, description="LoRA adapters resident at once (slots of stacked "
                           "weights allocated at start); a request whose adapter has no slot waits for one; "
                           "0 = no adapters (a request naming one is refused)")
    max_lora_rank: int = Field(16, ge=1, le=512, description="highest LoRA rank served: every slot is sized "
                               "for it, and an adapter of a higher rank is refused when it loads")
    # -- tensor parallelism (services/scheduler/engine/tp_group.py): one process per device, one unit
    tensor_parallel_size: int = Field(1, ge=1, le=64, description="devices one scheduler shards the model over "
                                      "(Megatron-style tensor parallelism; this process is rank 0 and starts the "
                                      "others); 1 = none")
    tp_timeout_s: float = Field(30.0, gt=0, le=3600, description="a collective of a tensor-parallel step that does "
                                "not complete within this many seconds (a hung rank) takes the group down")


# -- Draining (services/api/edge/admin.py): a pod-local control socket, never an HTTP route -----------------------
class DrainSettings(EnvSettings):
    admin_socket: str = Field("", description="UNIX socket `rsinfer drain` (the preStop hook) talks to; empty = "
                              "<temp dir>/rsinfer-api-<port>/control.sock (a 0700 directory)")
    drain_timeout_s: float = Field(120.0, gt=0, description="a drain not followed by SIGTERM within this many "
                                   "seconds is undone: the process goes back in service")


class TenantSettings(EnvSettings):
    """Named keys, their policies and the tenants' quotas (services/api/multitenancy/tenancy.py; docs/operator-guide.md,
    "Tenants")."""

    api_key_file: str = Field("", description="file holding the bearer key clients must send (instead of "
                              "--api-key, which `ps` shows; or RSINFER_API_KEY)")
    api_keys_file: str = Field("", description="YAML or JSON file of API keys, each with its tenant and policy "
                               "(docs/operator-guide.md, \"Tenants\"); re-read when it changes, so keys rotate "
                               "without a restart")
    api_keys_check_s: float = Field(1.0, gt=0, le=60, description="how often (seconds) --api-keys-file is "
                                    "looked at for a change; a change is honoured within this")
    metrics_open: bool = Field(True, description="/metrics needs no key; false: an admin key")
    quota_lease_s: float = Field(30.0, ge=3, le=3600, description="the concurrency slot of a route answered within "
                                 "its handler (the tokenizer routes) lives this long past its API process's last "
                                 "refresh (every third of it), so a crashed process's free themselves; a request's "
                                 "slot ends with the request (its deadline at the latest)")
    usage_flush_s: float = Field(2.0, gt=0, le=60, description="how often each API process looks at the records of "
                                 "requests whose clients left, to release their tenants' quota leases once they "
                                 "ended (one pipeline for all of them)")


class ApiSettings(CommonSettings, StorageSettings, AdapterSettings, DrainSettings, TenantSettings):
    host: str = Field("0.0.0.0", description="address the API listens on")
    port: int = Field(8000, ge=0, le=65535, description="HTTP port")
    api_key: str | None = Field(None, description="bearer key clients must send; none = open")
    request_timeout_s: float = Field(600.0, gt=0, description="deadline of every request")
    max_queued: int = Field(1024, ge=1, description="backlog of a model past which requests get 429")
    reply_shard_keys: int = Field(256, ge=8, description="reply streams per XREAD connection")
    grace_period_s: float = Field(20.0, ge=0, description="on SIGTERM, how long open streams may finish")
    api_workers: int = Field(1, ge=1, le=64, description="API processes on the port, each with its own reply "
                             "hub (SO_REUSEPORT), to use a pod's cores; a supervisor process starts them again "
                             "if they die (rsinfer/api_workers.py)")
    slow_client_timeout_s: float = Field(30.0, gt=0, description="abort a stream whose client accepts "
                                         "nothing for this long")
    broker_outage_s: float | None = Field(None, gt=0, description="how long open streams wait out an unreachable "
                                          "Redis before they end with broker_unavailable (one restarted with its "
                                          "AOF resumes them); default 10 s, 30 s on a cluster (a failover)")
    sse_ping_s: float = Field(15.0, gt=0, description="seconds between keep-alive comments on an idle stream")
    resume_window_s: float = Field(5.0, ge=0, description="a stream whose client went away is aborted only "
                                   "if no client reattaches within this many seconds; 0 = at once")
    models: str = Field("", description="served names of models to accept requests for even while they have "
                        "no worker (comma-separated); stage workers declare theirs in Redis too")
    slo_tolerance_ms: float = Field(250.0, ge=0, le=60_000, description="SLO-aware admission: a request with a "
                                    "time-to-first-token target is refused (503) when it is not expected to start "
                                    "within the target plus this, and ended (503) if no first token came by then")
    # -- Limits at the HTTP edge: what one connection or request may ask of an API process and of the broker;
    # past any of them a 400 (413 for a body, 431 for headers) names the field and the limit before anything
    # is queued (services/api/answer/limits.py; the HTTP server's in services/api/edge/http.py).
    max_body_bytes: int = Field(16 << 20, ge=1024, description="largest request body, counted as it arrives "
                                "whatever the framing (chunked too): 413 past it")
    max_header_bytes: int = Field(64 << 10, ge=1024, description="largest request head (request line and "
                                  "headers): 431 past it")
    header_timeout_s: float = Field(15.0, gt=0, description="a connection must send a request's whole head "
                                    "within this many seconds of opening (or of its first byte, when kept "
                                    "alive), else it is closed (408)")
    body_timeout_s: float = Field(30.0, gt=0, description="longest wait for the next bytes of a request body: "
                                  "408 past it")
    keep_alive_s: int = Field(120, ge=1, description="an idle kept-alive connection is closed after this many seconds")
    max_connections: int = Field(4096, ge=1, description="open connections (streams included) past which new "
                                 "requests get 503 with Retry-After")
    listen_backlog: int = Field(4096, ge=1, description="connections waiting to be accepted (at most somaxconn)")
    max_json_depth: int = Field(64, ge=2, description="deepest nesting of objects and lists in a request body")
    max_user_chars: int = Field(256, ge=1, description="longest `user`, `safety_identifier` and a "
                                "response's `prompt_cache_key` (OpenAI's limit)")
    max_metadata_pairs: int = Field(16, ge=0, description="most `metadata` pairs (OpenAI's limit)")
    max_metadata_key_chars: int = Field(64, ge=1, description="longest `metadata` key (OpenAI's limit)")
    max_metadata_value_chars: int = Field(512, ge=1, description="longest `metadata` value (OpenAI's limit)")
    max_stop_bytes: int = Field(256, ge=1, description="longest stop string, in UTF-8 bytes")
    max_stop_total_bytes: int = Field(4096, ge=1, description="most UTF-8 bytes of a request's stop strings "
                                      "together (at most 16 strings)")
    max_stop_token_ids: int = Field(256, ge=0, description="most `stop_token_ids` of a request")
    max_logit_bias: int = Field(1024, ge=0, description="most `logit_bias` entries of a request")
    max_constraint_bytes: int = Field(256 << 10, ge=1, description="largest structured-output constraint: a "
                                      "regex, a grammar, a JSON schema (as compact JSON) or guided_choice's list")
    max_tools: int = Field(128, ge=0, description="most `tools` of a chat request (OpenAI's limit)")
    max_tools_bytes: int = Field(1 << 20, ge=1, description="largest `tools` list, as compact JSON")
    max_template_kwargs_bytes: int = Field(64 << 10, ge=1, description="largest `chat_template_kwargs`, as "
                                           "compact JSON")
    max_tokenize_chars: int = Field(1 << 20, ge=1, description="most characters of text one /tokenize may ask "
                                    "for: its prompt, or its messages' contents together")
    max_tokenize_messages: int = Field(4096, ge=1, description="most `messages` of one /tokenize")
    max_detokenize_tokens: int = Field(1 << 18, ge=1, description="most `tokens` of one /detokenize")
    max_request_sequences: int = Field(128, ge=1, description="most sequences one request runs: prompts x "
                                       "choices per prompt (best_of or n)")
    max_request_tokens: int = Field(1 << 18, ge=1, description="most completion tokens one request may ask "
                                    "for: sequences x max_tokens, an omitted max_tokens counting as the "
                                    "model's context")
    max_request_logprobs: int = Field(1 << 18, ge=1, description="most logprob entries one request may ask "
                                      "for: sequences x max_tokens x (1 + top_logprobs), when logprobs are asked")
    max_response_bytes: int = Field(16 << 20, ge=1024, description="largest non-stream answer (its text and "
                                    "logprobs as they arrive): past it the request is aborted with a 400 "
                                    "(stream it instead)")
    # -- prefill-only requests: POST /v1/embeddings and POST /v1/score (shared/messages.py Pooling)
    max_pooling_inputs: int = Field(128, ge=1, description="most inputs of one /v1/embeddings request, and items "
                                    "of one /v1/score request (each is one prefill; --max-request-sequences "
                                    "bounds them too)")
    max_pooling_input_tokens: int = Field(8192, ge=1, description="most tokens of one embedding input or one "
                                          "score prompt (query and item), as OpenAI's 8192; the model's context "
                                          "bounds them too")
    max_score_labels: int = Field(256, ge=1, description="most `label_token_ids` of a /v1/score request")
    embedding_pooling: Literal["auto", "last", "mean"] = Field("auto", description="how /v1/embeddings pools the "
                                                               "final hidden states: the last token's, or the mean "
                                                               "over every token (computed whole, not from the prefix "
                                                               "cache); auto: as the model's sentence-transformers "
                                                               "config says, else last")
    embedding_normalize: bool | None = Field(None, description="L2-normalize embeddings; unset: as the model's "
                                             "sentence-transformers config says, else normalized (as vLLM's pooling "
                                             "models do)")

    # -- The Responses API (services/api/responses_api/): what one stored response may hold, and for how long.
    response_ttl_s: int = Field(86400, ge=60, description="how long a stored response (`store`, the default) is "
                                "kept after it was created or last ended: for GET, cancel, input_items and "
                                "previous_response_id")
    max_stored_response_bytes: int = Field(4 << 20, ge=1024, description="largest stored response (its input, "
                                           "its conversation and its output, as JSON): a request past it is a "
                                           "400; an output past it is not stored (its reply stream still is, "
                                           "for --request-ttl-s); a conversation read through "
                                           "previous_response_id is bounded by it too")
    max_stored_responses_per_tenant: int = Field(10_000, ge=1, description="most stored responses of one tenant "
                                                 "(every tenant's own; in open mode, of everyone) until they "
                                                 "expire or are deleted: past it `store` is a 400")
    max_stored_response_bytes_per_tenant: int = Field(256 << 20, ge=1024, description="most bytes of one "
                                                      "tenant's stored responses together (their input and "
                                                      "output, as JSON): past it `store` is a 400")
    max_response_chain: int = Field(256, ge=1, description="most responses one conversation chains through "
                                    "previous_response_id (each stores only its own input and output; the "
                                    "conversation is read link by link)")
    max_response_items: int = Field(1024, ge=1, description="most items of a response's conversation: its "
                                    "input and the conversation of its previous_response_id")
    responses_key: str | None = Field(None, description="key sealing reasoning items' `encrypted_content` (32 "
                                      "bytes as base64, e.g. `openssl rand -base64 32`): the same for every API "
                                      "process; unset: each makes its own at start, with a warning")
    responses_key_file: str = Field("", description="file holding --responses-key (instead of the flag, which "
                                    "`ps` shows)")
    # -- The Batch API (services/api/batch_api/batches.py, services/api/batch_api/files.py).
    file_ttl_s: int = Field(30 * 86400, ge=60, description="how long an uploaded or a batch's output file is kept")
    max_batch_lines: int = Field(50_000, ge=1, description="most requests in one batch's input file (OpenAI's)")
    batch_max_inflight: int = Field(8, ge=1, description="most requests of one batch running at once: the "
                                    "share of the engines a batch may take")
    batch_max_backlog: int = Field(2, ge=0, description="a batch feeds its next request only while its model "
                                   "has at most this many requests queued, so interactive requests do not "
                                   "wait behind it")
    batch_priority: int = Field(1000, description="`priority` of a batch's requests (lower runs first): behind "
                                "interactive ones (0) when both wait for the engine")
    batch_claim_idle_s: float = Field(30.0, gt=0, description="a batch whose runner (an API process) has not "
                                      "touched it for this long is taken over by another")
    batch_max_running: int = Field(4, ge=1, description="most batches one API process runs at once, taken in "
                                   "turns across tenants")
    batch_max_running_per_tenant: int = Field(2, ge=1, description="most batches of one tenant one API process "
                                              "runs (or holds parked) at once")
    batch_sweep_s: float = Field(3600.0, gt=0, description="how often each API process deletes what ended "
                                 "batches and expired files left in the object store")
    max_files_per_tenant: int = Field(10_000, ge=1, description="most files one tenant stores at once (its "
                                      "uploads and its batches' output and error files): past it a 403")
    max_file_bytes_per_tenant: int = Field(16 << 30, ge=1, description="most bytes one tenant's stored files "
                                           "hold together: past it a 403 (an output file past it fails its batch)")

    def model_names(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(m.strip() for m in self.models.split(",") if m.strip()))
