"""The command line's flags, generated from the settings classes (shared/settings.py): one `--kebab-case` flag per
field, shown in `--help` under the group FLAG_GROUPS gives it, the groups in its order (what a first run needs
first, tuning last). A command shows only the fields of its settings class, so each sees only its own flags.

A field's group is declared here, once, by its name: a field redeclared by several classes (`claim_idle_ms`,
`host`) is one flag in one group. tests/unit/rsinfer/test_flags.py checks that every field has exactly one.
"""

from __future__ import annotations

import argparse
import typing
from typing import Literal

from pydantic_settings import BaseSettings

# (title, what it holds, field names in the order shown): the common ones first
FLAG_GROUPS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("server", "where the API listens and what it serves", (
        "host", "port", "model", "served_model_name", "models", "api_workers")),
    ("model and engine", "how the model runs (the scheduler's engine) and how its output is parsed", (
        "engine", "device", "dtype", "threads", "trust_remote_code", "max_running", "max_kv_tokens",
        "kv_memory_fraction", "page_size", "chunk_size", "prefix_cache", "cuda_graphs", "overlap", "stream_interval",
        "stream_flush_ms", "stream_entry_rate", "step_ms", "tool_call_parser", "reasoning_parser", "default_max_tokens",
        "embedding_pooling", "embedding_normalize", "tensor_parallel_size", "tp_timeout_s")),
    ("limits", "what one connection or request may ask: past a limit a 4xx names it, before anything is queued", (
        "request_timeout_s", "max_queued", "max_connections", "listen_backlog", "max_body_bytes",
        "max_header_bytes", "header_timeout_s", "body_timeout_s", "keep_alive_s", "slow_client_timeout_s",
        "max_json_depth", "max_user_chars", "max_metadata_pairs", "max_metadata_key_chars", "max_metadata_value_chars",
        "max_stop_bytes", "max_stop_total_bytes", "max_stop_token_ids", "max_logit_bias", "max_constraint_bytes",
        "max_tools", "max_tools_bytes", "max_template_kwargs_bytes", "max_tokenize_chars", "max_tokenize_messages",
        "max_detokenize_tokens", "max_request_sequences", "max_request_tokens", "max_request_logprobs",
        "max_response_bytes", "max_pooling_inputs", "max_pooling_input_tokens", "max_score_labels",
        "grammar_mask_budget_ms", "detokenize_budget_mb")),
    ("tenants and API keys", "who may call the API, and each tenant's share", (
        "api_key", "api_key_file", "api_keys_file", "api_keys_check_s", "metrics_open", "quota_lease_s",
        "usage_flush_s", "fair_queueing", "fair_watermark", "fair_max_held", "fair_poll_ms", "slo_tolerance_ms")),
    ("Responses and Batch API", "stored responses, files and batches: how many, how large, how long", (
        "response_ttl_s", "max_stored_response_bytes", "max_stored_responses_per_tenant",
        "max_stored_response_bytes_per_tenant", "max_response_chain", "max_response_items", "responses_key",
        "responses_key_file", "file_ttl_s",
        "max_files_per_tenant", "max_file_bytes_per_tenant", "max_batch_lines", "batch_max_inflight",
        "batch_max_backlog", "batch_priority", "batch_claim_idle_s", "batch_max_running",
        "batch_max_running_per_tenant", "batch_sweep_s")),
    ("storage", "where files and LoRA adapter folders are stored", (
        "storage_url", "storage_endpoint_url", "storage_region", "storage_addressing_style", "storage_part_bytes",
        "storage_cache_dir", "max_file_bytes")),
    ("LoRA adapters", "adapters registered, their bounds, and the engine's slots for them", (
        "lora_modules", "lora_roots", "max_adapters", "max_lora_name_chars", "max_lora_path_chars", "max_loras",
        "max_lora_rank")),
    ("Redis", "the broker every process talks through, and what a request keeps in it", (
        "redis_url", "redis_password", "redis_password_file", "redis_tls_ca", "redis_cluster", "namespace",
        "redis_port", "redis_maxmemory", "request_ttl_s", "reply_maxlen")),
    ("observability and logging", "logs, traces, metrics, heartbeats and liveness", (
        "log_level", "otlp_endpoint", "metrics_port", "worker_id", "heartbeat_interval_s", "heartbeat_ttl_s",
        "liveness_file")),
    ("streams and shutdown", "open streams, reattaching to them, draining and stopping", (
        "sse_ping_s", "resume_window_s", "broker_outage_s", "grace_period_s", "admin_socket", "drain_timeout_s")),
    ("advanced", "how the stages read, claim and route work", (
        "batch_size", "claim_idle_ms", "max_deliveries", "reply_shard_keys", "prefix_routing",
        "prefix_routing_load_tokens", "prefix_routing_max_skew")),
)
GROUP_OF: dict[str, str] = {name: title for title, _, names in FLAG_GROUPS for name in names}
UNGROUPED = "other"  # a field FLAG_GROUPS misses (the test fails; the flag still works)


def flag_parser(settings_cls: type[BaseSettings], parser: argparse.ArgumentParser) -> None:
    """Add one `--flag` per settings field, in its group; unset flags stay None so the environment can fill
    them."""
    fields = settings_cls.model_fields
    sections = [(title, about, [n for n in names if n in fields]) for title, about, names in FLAG_GROUPS]
    sections.append((UNGROUPED, "", [n for n in fields if n not in GROUP_OF]))
    for title, about, names in sections:
        if names:
            group = parser.add_argument_group(title, about or None)
            for name in names:
                _add_flag(group, name, fields[name])


def _add_flag(group, name: str, field) -> None:
    flag = "--" + name.replace("_", "-")
    unset = field.default is None or field.default == ""  # its description says what unset means
    default = "" if unset else f", default {field.default!r}"
    help_text = f"{field.description or ''} (env RSINFER_{name.upper()}{default})"
    if _is_bool(field.annotation):
        group.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif isinstance(field.json_schema_extra, dict) and "nargs" in field.json_schema_extra:
        # several values after one flag (`--lora-modules a=/x b=/y`), joined by spaces as in the environment
        group.add_argument(flag, dest=name, default=None, help=help_text, nargs=field.json_schema_extra["nargs"],
                           action=_JoinValues)
    else:
        choices = _choices(field.annotation)
        group.add_argument(flag, dest=name, default=None, help=help_text, choices=choices,
                           metavar=None if choices else _metavar(field.annotation))


def _is_bool(annotation: object) -> bool:
    """bool, or an optional bool (unset: a default that depends on the machine)."""
    return annotation is bool or set(typing.get_args(annotation)) == {bool, type(None)}


class _JoinValues(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, " ".join(values))


def _metavar(annotation: object) -> str:
    """A short placeholder by type (`--max-body-bytes N`), so most flags fit beside their help."""
    kinds = set(typing.get_args(annotation)) - {type(None)} or {annotation}
    return "N" if kinds == {int} else "X" if kinds == {float} else "TEXT"


def _choices(annotation: object) -> list[str] | None:
    if typing.get_origin(annotation) is Literal:
        return list(typing.get_args(annotation))
    return None


def settings_from_args(settings_cls: type[BaseSettings], args: argparse.Namespace) -> BaseSettings:
    given = {k: v for k, v in vars(args).items() if k in settings_cls.model_fields and v is not None}
    return settings_cls(**given)
