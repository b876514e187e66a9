"""`tokenmill serve`: the OpenAI-compatible server (and the web chat page at /)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.catalog import DEFAULT_MODEL, resolve_model
from tokenmill.cli.common import (
    add_kv_cache_dtype_arg,
    add_parallel_args,
    add_quantization_args,
    parallel_options,
)
from tokenmill.engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from tokenmill.engine.speculative import SpeculativeConfig
from tokenmill.errors import TokenmillError
from tokenmill.parsers.reasoning import REASONING_PARSERS
from tokenmill.parsers.tool_calls import TOOL_PARSERS

if TYPE_CHECKING:
    from tokenmill.server.model_registry import ModelRegistry
    from tokenmill.server.model_sources import EngineBuilder

GiB = 1 << 30


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine knobs shared by every command that runs the batching engine."""
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "fp32", "bf16", "fp16"],
        help="activation and dense-weight dtype (default: auto, bf16 where the CPU multiplies it "
        "natively (AVX-512, AMX), else fp32)",
    )
    add_quantization_args(p)
    p.add_argument(
        "--models-dir", default=None, help="model cache (default: ~/.cache/tokenmill/models)"
    )
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length limit (default: the model's)",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=float,
        default=None,
        help="GiB for the KV cache (default: a quarter of free RAM, rounded down to a power of "
        "two, at most 4)",
    )
    p.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV cache block (default: 16)"
    )
    add_kv_cache_dtype_arg(p)
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="most sequences in one batch (default: 64)"
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="token budget of one step; longer prompts are prefilled in chunks (default: "
        "%(default)s)",
    )
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="disable automatic prefix caching"
    )
    p.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=["fcfs", "priority", "fair"],
        help="fcfs: in arrival order; priority: by the requests' priority, then arrival; fair: "
        "tenants (an --api-keys-file key's tenant, else the request's user field) share the "
        "steps' tokens by virtual token counters, so one tenant's flood cannot starve another "
        "(default: fcfs)",
    )
    p.add_argument(
        "--max-running-per-tenant",
        type=int,
        default=None,
        metavar="N",
        help="with --scheduling-policy fair: at most N of one tenant's requests run at once, the "
        "rest wait while other tenants' are admitted (default: no limit)",
    )
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM takes it: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 4}\' drafts '
        'from earlier text of the same request, \'{"model": ALIAS_OR_PATH, '
        '"num_speculative_tokens": 4}\' with a draft model of the same vocabulary (default: '
        "off)",
    )
    add_parallel_args(p)


def engine_options(args: argparse.Namespace) -> dict:
    try:  # checked here, so that a bad combination is an error before the model loads
        SchedulerConfig(
            policy=args.scheduling_policy, max_running_per_tenant=args.max_running_per_tenant
        )
    except ValueError as exc:
        raise TokenmillError(str(exc)) from None
    return {
        "dtype": args.dtype,
        "quantization": args.quantization,
        "dense_min_tokens": args.dense_min_tokens,
        "batch_invariant": args.batch_invariant,
        "models_dir": args.models_dir,
        "max_model_len": args.max_model_len,
        **parallel_options(args),
        "kv_cache_memory": int(args.kv_cache_memory * GiB) if args.kv_cache_memory else None,
        "block_size": args.block_size,
        "kv_cache_dtype": args.kv_cache_dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": not args.no_prefix_caching,
        "policy": args.scheduling_policy,
        "max_running_per_tenant": args.max_running_per_tenant,
        # checked here, so that a bad config is an error before the model loads
        "speculative_config": SpeculativeConfig.parse(args.speculative_config),
    }


def add_parser(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(
        name,
        help="serve models over the OpenAI API",
        description="Serve MODELs over an OpenAI-compatible HTTP API, with a chat page at /. "
        "Each model has its own engine, KV cache and prefix cache; a request picks one by its "
        "`model` field (the first MODEL when it names none).",
    )
    p.add_argument(
        "model",
        nargs="*",
        default=[],
        help="catalog aliases, GGUF files or HF directories, loaded at the start and kept "
        f"loaded (default: {DEFAULT_MODEL}, or none with --load-on-demand)",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default: 127.0.0.1, this machine only)",
    )
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients use, with one MODEL (default: the name MODEL is given by)",
    )
    add_model_registry_args(p)
    p.add_argument(
        "--api-key",
        default=None,
        help="require this key as a Bearer token on /v1/* (default: $TOKENMILL_API_KEY)",
    )
    p.add_argument(
        "--api-keys-file",
        type=Path,
        default=None,
        metavar="JSON",
        help='more keys, each with its tenant: a JSON object {"KEY": "TENANT", ...}; any of '
        "them (or --api-key) is accepted, and the fair policy shares by their tenants",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=16 << 20,
        help="largest request body (default: 16 MiB)",
    )
    p.add_argument(
        "--max-queue-len",
        type=int,
        default=None,
        help="most waiting requests; beyond it the server answers 503 with Retry-After "
        "(default: no limit)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a request may take from arrival to its last token (default: no limit)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="the model's tool-call format, for requests with tools (default: the one its chat "
        "template uses)",
    )
    p.add_argument(
        "--reasoning-parser",
        default=None,
        choices=sorted(REASONING_PARSERS),
        help="split a <think> model's reasoning (gpt-oss: its harmony analysis channel) into "
        "reasoning_content; output constraints start after it (default: none, the reasoning "
        "stays in content)",
    )
    p.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        help="origins allowed by CORS (default: none, CORS off)",
    )
    p.add_argument(
        "--protect-health", action="store_true", help="require the API key on /health too"
    )
    p.add_argument(
        "--protect-metrics", action="store_true", help="require the API key on /metrics too"
    )
    p.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="refuse requests with fields the API does not know, as OpenAI does (default: "
        "ignore them with a warning, as vLLM does: clients send vendor fields such as "
        "llama.cpp's cache_prompt)",
    )
    p.add_argument(
        "--embedding-pooling",
        default="last",
        choices=["last", "mean"],
        help="how /v1/embeddings pools a generative model's final hidden states (L2-normalized "
        "after): its last token or the mean of its tokens (default: last; an encoder pools as "
        "its sentence-transformers config says)",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="decode through compiled graphs, built on a background thread once the server "
        "listens while eager steps serve (minutes of every core the first time, seconds once "
        "cached; outputs are the same either way; /health tells which runs), at each batch size "
        "where they time faster than eager steps; not loaded again where an earlier run timed "
        "them no faster at any batch size. Default: on; --no-compile stays eager. Off "
        "with --tensor-parallel-size above 1, whose steps run eagerly",
    )
    p.add_argument(
        "--wait-for-kernels",
        action="store_true",
        help="on a first start, wait for tokenmill's CPU kernels to build (~30-90 s, once per "
        "machine) before loading the model. By default the server answers at once on PyTorch's "
        "kernels meanwhile and reloads the model onto tokenmill's between two steps: answers "
        "before that swap can differ from later ones and do not keep batch invariance",
    )
    add_engine_args(p)
    add_data_parallel_args(p)
    p.set_defaults(run=run)


def add_model_registry_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--load-on-demand",
        action="store_true",
        help="load any catalog alias (pulled first if need be) or cached model (tokenmill list) "
        "that a request names, within --max-loaded-models and --memory-budget; requests for it "
        "wait while it loads (at most --load-timeout). Never a path a request names",
    )
    p.add_argument(
        "--keep-alive",
        default=None,
        metavar="DURATION",
        help="how long a model stays loaded after its last request, as Ollama's keep_alive: "
        "seconds or a duration (300, 5m, 1h30m), 0 to unload at once, negative to keep it; "
        "requests may set their own (keep_alive). Default: MODELs stay loaded, models loaded "
        "on demand 5m",
    )
    p.add_argument(
        "--max-loaded-models",
        type=int,
        default=None,
        metavar="N",
        help="most models loaded at once; loading one more first unloads the least recently "
        "used idle model that is not kept loaded (default: no limit)",
    )
    p.add_argument(
        "--memory-budget",
        default=None,
        metavar="SIZE",
        help="memory the loaded models may take together: bytes with a unit (8GiB, 512MiB) or "
        "a fraction of the system's memory (0.5). A model is charged its weights' size on disk "
        "plus its KV pool (--kv-cache-memory, else the default budget of the free memory when "
        "it loads), or what its load added to the server's resident memory if that is more; a "
        "model that cannot fit is refused with a message saying so (default: no budget; a load "
        "is still refused when the system lacks the free memory)",
    )
    p.add_argument(
        "--load-timeout",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="how long a request waits for its model to load (or for room to load it) before "
        "a 503 asks it to retry; the load goes on (default: 300)",
    )


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    from tokenmill.engine.router import ROUTER_POLICIES

    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="run N engine replicas as Ray actors behind this one endpoint (needs Ray: pip "
        "install 'tokenmill[ray]'; default: 1, one engine in this process)",
    )
    p.add_argument(
        "--router",
        default="prefix",
        choices=ROUTER_POLICIES,
        help="how requests are spread over the replicas: prefix sends a request to the replica "
        "whose prefix cache holds most of its prompt, weighed against that replica's load; "
        "least-load to the least busy; round-robin in turn (default: prefix)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="join this Ray cluster (HOST:PORT of its head, or 'auto') instead of starting a "
        "local Ray instance; MODEL must be a path that every node can read",
    )
    p.add_argument(
        "--pd-disaggregation",
        action="store_true",
        help="prefill/decode disaggregation: replica 0 prefills every prompt and hands its KV "
        "blocks, through Ray's object store, to the replica that decodes it (one of the others; "
        "needs --data-parallel-size 2 or more)",
    )
    p.add_argument(
        "--threads-per-replica",
        type=int,
        default=None,
        help="torch threads (and Ray CPUs) of each replica (default: this machine's cores "
        "divided by the data-parallel size)",
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from tokenmill.engine.data_parallel import import_ray
    from tokenmill.server.app import ServerConfig, build_app
    from tokenmill.server.listening import ListeningServer
    from tokenmill.server.model_sources import EngineBuilder

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.pd_disaggregation and args.data_parallel_size < 2:
        raise TokenmillError(
            "--pd-disaggregation needs --data-parallel-size 2 or more (one prefill replica, the "
            "rest decode)"
        )
    if args.data_parallel_size != 1:
        if args.tensor_parallel_size != 1:
            raise TokenmillError(
                "--data-parallel-size and --tensor-parallel-size do not combine yet: pick one"
            )
        import_ray()  # before the model is fetched: say what to install first
    options = dict(
        max_queue_len=args.max_queue_len,
        compile=args.compile,
        defer_compile=True,  # started by ListeningServer once the socket is open
        serve_while_building=not args.wait_for_kernels,
        embedding_pooling=args.embedding_pooling,
        **engine_options(args),
    )
    data_parallel = {}
    if args.data_parallel_size != 1:
        data_parallel = dict(
            num_replicas=args.data_parallel_size,
            router=args.router,
            ray_address=args.ray_address,
            num_threads=args.threads_per_replica,
            pd_disaggregation=args.pd_disaggregation,
        )
    builder = EngineBuilder(options, data_parallel, progress=sys.stderr.isatty())
    registry = _model_registry(args, builder)
    api_key = args.api_key or os.environ.get("TOKENMILL_API_KEY")
    app = build_app(
        registry,
        ServerConfig(
            registry.default_model or "",
            api_key=api_key,
            api_keys=_read_api_keys(args.api_keys_file),
            max_body_bytes=args.max_request_bytes,
            protect_health=args.protect_health,
            protect_metrics=args.protect_metrics,
            allowed_origins=args.allowed_origins,
            request_timeout=args.request_timeout,
            tool_call_parser=args.tool_call_parser,
            reasoning_parser=args.reasoning_parser,
            strict_request_fields=args.strict_request_fields,
        ),
    )
    for entry in registry.entries.values():
        engine = entry.engine
        assert engine is not None  # loaded by _model_registry
        what = "embeddings only" if engine.embeddings_only else f"{engine.num_kv_blocks} KV blocks"
        if args.data_parallel_size > 1:
            what += f", {args.data_parallel_size} replicas, {args.router} router"
        print(
            f"tokenmill: serving {entry.name} ({engine.model_path.name}, {engine.max_model_len} "
            f"tokens of context, {what}) at http://{args.host}:{args.port}",
            file=sys.stderr,
            flush=True,
        )
    if args.load_on_demand:
        print("tokenmill: loading cached and catalog models on demand", file=sys.stderr, flush=True)
    # uvicorn drains in-flight requests on SIGTERM/SIGINT, then re-raises the signal to the handler
    # that was installed before it started: make that one a no-op so shutdown ends with exit code 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=10,
        lifespan="off",
    )  # no startup/shutdown hooks: the engine is ready before uvicorn starts
    server = ListeningServer(config, on_listening=registry.start_compile)
    try:
        server.run()
    finally:
        registry.shutdown()
    return 0 if server.started else 1


def _model_registry(args: argparse.Namespace, builder: EngineBuilder) -> ModelRegistry:
    """The registry of the server's models, the MODELs loaded (one after the other, each one
    refused with a message if it does not fit)."""
    from tokenmill.errors import InvalidRequestError
    from tokenmill.server.memory import parse_memory_size
    from tokenmill.server.model_registry import (
        FOREVER,
        ON_DEMAND_KEEP_ALIVE,
        ModelRegistry,
        parse_keep_alive,
    )
    from tokenmill.server.model_sources import CachedModels

    names = args.model or ([] if args.load_on_demand else [DEFAULT_MODEL])
    if args.served_model_name and len(names) != 1:
        raise TokenmillError("--served-model-name names one MODEL: give exactly one")
    try:
        keep_alive = None if args.keep_alive is None else parse_keep_alive(args.keep_alive)
        budget = None if args.memory_budget is None else parse_memory_size(args.memory_budget)
    except (InvalidRequestError, ValueError) as exc:
        raise TokenmillError(f"--keep-alive / --memory-budget: {exc}") from None
    finder = None
    if args.load_on_demand:
        on_demand = ON_DEMAND_KEEP_ALIVE if keep_alive is None else keep_alive
        finder = CachedModels(builder, on_demand, args.models_dir)
    registry = ModelRegistry(finder, args.max_loaded_models, budget, args.load_timeout)
    try:
        for name in names:
            path = resolve_model(name, models_dir=args.models_dir, progress=sys.stderr.isatty())
            served = args.served_model_name or name
            size = path.stat().st_size if path.is_file() else _dir_size(path)
            kept = FOREVER if keep_alive is None else keep_alive
            registry.load_now(builder.source(served, path, size, kept))
    except BaseException:
        registry.shutdown()
        raise
    return registry


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _read_api_keys(path: Path | None) -> dict[str, str]:
    """The keys file's {key: tenant} map; SystemExit saying what is wrong with the file."""
    if path is None:
        return {}
    try:
        keys = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise SystemExit(f"tokenmill serve: cannot read --api-keys-file {path}: {exc}") from None
    if not isinstance(keys, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in keys.items()
    ):
        raise SystemExit(
            f'tokenmill serve: --api-keys-file {path} must hold a JSON object {{"KEY": "TENANT"}}'
        )
    return keys
