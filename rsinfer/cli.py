"""`rsinfer` command line: one subcommand per process, flags generated from the settings classes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from rsinfer.command_settings import DrainCommand, ProbeSettings, UpSettings
from rsinfer.flags import flag_parser, settings_from_args
from shared.settings import (
    ApiSettings,
    CommonSettings,
    DetokenizerSettings,
    RedisSettings,
    SchedulerSettings,
    TokenizerSettings,
)

SERVICES = {
    "api": (ApiSettings, "the OpenAI-compatible HTTP API"),
    "tokenizer": (TokenizerSettings, "tokenizer worker (consumer group 'tokenizer')"),
    "scheduler": (SchedulerSettings, "scheduler worker: the engine (consumer group 'scheduler')"),
    "detokenizer": (DetokenizerSettings, "detokenizer worker (consumer group 'detokenizer')"),
    "up": (UpSettings, "everything on one machine, with an embedded redis-server"),
}


def build_parser() -> argparse.ArgumentParser:
    # No abbreviated flags: a renamed flag must fail loudly where a chart or script still uses the old one.
    parser = argparse.ArgumentParser(prog="rsinfer", description="LLM serving over Redis Streams",
                                     allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (cls, help_text) in SERVICES.items():
        # the usage line names no flag: with a hundred of them it would fill screens before the first group
        flag_parser(cls, sub.add_parser(name, help=help_text, description=help_text, allow_abbrev=False,
                                        usage="%(prog)s [flags]"))

    demo = sub.add_parser("demo-model", help="write a random-weight demo checkpoint to DIR", allow_abbrev=False)
    demo.add_argument("dir")
    demo.add_argument("--shape", default="tiny", choices=["tiny", "qwen3-0.6b"])
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])

    adapter = sub.add_parser("demo-adapter", allow_abbrev=False,
                             help="write a random PEFT LoRA adapter of the demo model (or --model) to each DIR")
    adapter.add_argument("dir", nargs="+", help="one folder per adapter, each of its own weights (seed, seed+1...)")
    adapter.add_argument("--model", default=None, help="the base checkpoint's folder (default: the demo model)")
    adapter.add_argument("--rank", type=int, default=8, help="the adapter's rank (r); lora_alpha is twice it")
    adapter.add_argument("--targets", nargs="+", default=["q_proj", "v_proj"], metavar="PROJ",
                         help="the projections it adapts, in every layer")
    adapter.add_argument("--seed", type=int, default=0)

    insp = sub.add_parser("inspect", help="in-flight requests and stage backlogs, read from Redis",
                          allow_abbrev=False, usage="%(prog)s [uid] [--watch [SECONDS]] [--all] [--port PORT] [flags]")
    insp.add_argument("uid", nargs="?", help="show this request's record instead")
    insp.add_argument("--all", action="store_true", help="list every request record Redis still keeps (finished "
                      "ones too, until they expire), found by SCAN, instead of the index of those in flight")
    insp.add_argument("--port", type=int, default=None, help="next to several `rsinfer up`: the one on this port")
    insp.add_argument("--watch", nargs="?", type=float, const=2.0, default=None, metavar="SECONDS",
                      help="show the overview again every SECONDS (default 2) until Ctrl-C")
    flag_parser(RedisSettings, insp)

    health = sub.add_parser("healthcheck", help="liveness: exit 0 if this worker's loop moves (a local file; "
                            "Redis is not asked); with --ready, also its heartbeat in Redis is fresh",
                            allow_abbrev=False, usage="%(prog)s --role ROLE [--ready] [flags]")
    flag_parser(ProbeSettings, health)
    health.add_argument("--role", required=True, choices=["tokenizer", "scheduler", "detokenizer"])
    health.add_argument("--max-stall-s", type=float, default=60.0, metavar="SECONDS",
                        help="fail when the loop has not moved for this long")
    health.add_argument("--ready", action="store_true",
                        help="readiness: also fail while Redis is unreachable or this worker's heartbeat is stale")
    health.add_argument("--port", type=int, default=None, help="next to several `rsinfer up`: the one on this port")

    drain = sub.add_parser("drain", help="take this pod's API out of service (its preStop hook)",
                           allow_abbrev=False, usage="%(prog)s [--wait SECONDS] [flags]")
    flag_parser(DrainCommand, drain)
    drain.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                       help="seconds to keep the hook running after it")

    spec = sub.add_parser("asyncapi", help="write the message contract as AsyncAPI 3.0 (docs/asyncapi.yaml)",
                          allow_abbrev=False)
    spec.add_argument("--output", default="-", help="file to write; - for stdout")

    hk = sub.add_parser("hash-key", help="a keys-file entry's `key_hash` (salted PBKDF2) of a key read from stdin "
                        "(never from argv, which `ps` shows)", allow_abbrev=False)
    hk.add_argument("--new", action="store_true", help="make a new random key instead: print it, then its hash")
    hk.add_argument("--iterations", type=int, default=600_000, help="PBKDF2 iterations (100000 to 5000000)")
    hk.add_argument("--sha256", action="store_true", help="print the unsalted `key_sha256` form instead")

    bench = sub.add_parser("bench", help="load generator against a running API", allow_abbrev=False)
    from rsinfer.bench import add_bench_args

    add_bench_args(bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _warn_of_secret_flags(args)
    tool = TOOLS.get(args.command)
    if tool is not None:
        return tool(args)
    settings = settings_from_args(SERVICES[args.command][0], args)
    if args.command == "up":
        from rsinfer.up import run_up

        return run_up(settings)
    return serve(args.command, settings)


def serve(cmd: str, settings: CommonSettings) -> int:
    """Run one stage's process (api, tokenizer, scheduler or detokenizer) until it stops."""
    from rsinfer.logs import setup_logging

    setup_logging(settings.log_level, cmd, settings.identity())
    if cmd != "api":  # a crashed predecessor's liveness file must not pass the startup probe (shared/liveness.py)
        from shared.liveness import Liveness, liveness_path

        Liveness(liveness_path(settings.liveness_file, settings.namespace, cmd, settings.name()), cmd, "").clear()
    elif settings.api_workers > 1:  # a supervisor of API processes, which imports nothing of the app
        from rsinfer.api_workers import run_workers

        return run_workers(settings)
    return _exit_now(_stage_main(cmd)(settings) or 0)


def _exit_now(code: int) -> int:
    """End a stage's process once it stopped, without the interpreter's teardown: a scheduler that stopped in
    a few milliseconds otherwise spends a second freeing torch's and transformers' objects, which a rolling
    restart or a scale-down waits for. Logs are flushed first; under coverage (`make coverage`), whose data is
    written at exit, the process exits as usual."""
    coverage = sys.modules.get("coverage")
    if coverage is not None and coverage.Coverage.current() is not None:
        return code
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _stage_main(cmd: str) -> Callable[[Any], int | None]:
    """The stage's `run`, imported only for the stage this process runs."""
    if cmd == "api":
        from services.api.main import run
    elif cmd == "tokenizer":
        from services.tokenizer.main import run
    elif cmd == "scheduler":
        from services.scheduler.main import run
    else:
        from services.detokenizer.main import run
    return run


def _warn_of_secret_flags(args: argparse.Namespace) -> None:
    for secret in ("api_key", "redis_password"):
        if getattr(args, secret, None):
            flag, env = "--" + secret.replace("_", "-"), f"RSINFER_{secret.upper()}"
            print(f"rsinfer: warning: {flag} on the command line shows in `ps`; use {env} or {flag}-file",
                  file=sys.stderr)


# ---- the subcommands that are not a process of the deployment


def _demo_model(args: argparse.Namespace) -> int:
    from shared.demo_model import make_model

    print(make_model(args.dir, shape=args.shape, seed=args.seed, dtype=args.dtype))
    return 0


def _demo_adapter(args: argparse.Namespace) -> int:
    from rsinfer.demo_adapter import make_adapter

    try:
        for k, out in enumerate(args.dir):
            print(make_adapter(out, args.model, rank=args.rank, targets=args.targets, seed=args.seed + k))
    except (ValueError, OSError) as e:
        print(f"rsinfer demo-adapter: {e}", file=sys.stderr)
        return 2
    return 0


def _bench(args: argparse.Namespace) -> int:
    from rsinfer.bench import run_bench

    return run_bench(args)


def _asyncapi(args: argparse.Namespace) -> int:
    from rsinfer.contract import asyncapi_yaml

    text = asyncapi_yaml()
    if args.output == "-":
        sys.stdout.write(text)
    else:
        with open(args.output, "w") as f:
            f.write(text)
    return 0


def _hash_key(args: argparse.Namespace) -> int:
    """docs/operator-guide.md, "Tenants": the entry's `key_hash:` (or `key_sha256:`) line; a key too short is
    refused."""
    import hashlib
    import secrets

    from services.api.multitenancy.tenants import PBKDF2_ITERATIONS, SaltedHash, key_problem

    if not PBKDF2_ITERATIONS[0] <= args.iterations <= PBKDF2_ITERATIONS[1]:
        print(f"rsinfer hash-key: --iterations: {PBKDF2_ITERATIONS[0]} to {PBKDF2_ITERATIONS[1]}", file=sys.stderr)
        return 2
    key = "sk-" + secrets.token_urlsafe(36) if args.new else sys.stdin.readline().rstrip("\r\n")
    problem = key_problem(key, "the key")
    if problem:
        print(f"rsinfer hash-key: {problem}", file=sys.stderr)
        return 2
    if args.new:
        print(f"key: {key}")
    if args.sha256:
        print(f"key_sha256: {hashlib.sha256(key.encode()).hexdigest()}")
    else:
        print(f"key_hash: {SaltedHash.of(key, args.iterations)}")
    return 0


def _drain(args: argparse.Namespace) -> int:
    from rsinfer import local, operator_commands

    given = {k: v for k, v in vars(args).items() if k in DrainCommand.model_fields and v is not None}
    if not (given.keys() & {"port", "admin_socket"}) and not os.environ.get("RSINFER_PORT"):
        try:  # next to `rsinfer up`: the only one running (in a pod: none, and the default port)
            stack = local.pick(None)
        except local.StackError as e:
            print(f"drain failed: {e}")
            return 1
        if stack is not None:
            given["port"] = stack["port"]
    return operator_commands.drain(DrainCommand(**given), args.wait)


def _healthcheck(args: argparse.Namespace) -> int:
    from rsinfer import local, operator_commands

    try:
        settings, stack = _next_to_up(ProbeSettings, args)
    except local.StackError as e:
        print(f"unhealthy: {e}")
        return 1
    if stack and not settings.liveness_file and args.role in stack.get("liveness", {}):
        settings = settings.model_copy(update={"liveness_file": stack["liveness"][args.role]})
    return operator_commands.healthcheck(settings, args)


def _inspect(args: argparse.Namespace) -> int:
    from rsinfer import local, operator_commands

    logging.disable(logging.WARNING)  # it reports what goes wrong itself, in one line (a lost Redis, say)
    try:
        settings, _ = _next_to_up(RedisSettings, args)
    except local.StackError as e:
        print(f"rsinfer inspect: {e}")
        return 1
    try:
        return asyncio.run(operator_commands.inspect(settings, args))
    except KeyboardInterrupt:  # the end of a --watch
        return 0


def _next_to_up(cls: type, args: argparse.Namespace) -> tuple[Any, dict | None]:
    """A tool's settings and the local `rsinfer up` it runs next to (rsinfer/local.py: the one on --port, or
    the only one running): without a Redis URL, that stack's Redis. local.StackError when it cannot be told."""
    from rsinfer import local

    given = {k: v for k, v in vars(args).items() if k in cls.model_fields and v is not None}
    if given.get("redis_url") or os.environ.get("RSINFER_REDIS_URL"):
        return cls(**given), None
    stack = local.pick(args.port)
    return cls(**given, **local.overrides(given, stack)), stack


TOOLS: dict[str, Callable[[argparse.Namespace], int]] = {
    "demo-model": _demo_model, "demo-adapter": _demo_adapter, "bench": _bench, "asyncapi": _asyncapi,
    "drain": _drain, "hash-key": _hash_key, "healthcheck": _healthcheck, "inspect": _inspect,
}


if __name__ == "__main__":
    sys.exit(main())
