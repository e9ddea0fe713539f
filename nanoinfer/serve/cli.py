"""`nanoinfer serve MODEL [options]` (also `python -m nanoinfer serve ...`): the OpenAI-compatible
server. Every LLM option is a --kebab-case flag, generated from nanoinfer.config.Config."""
import argparse
import logging
import os
import signal
import sys
import types
import typing
from dataclasses import MISSING, fields

from nanoinfer.config import Config
from nanoinfer.serve.limits import ServerLimits, prompt_chars_limit
from nanoinfer.serve.option_help import OPTION_HELP
from nanoinfer.serve.chat_reply import TOOL_CALL_PARSERS
from nanoinfer.serve.reasoning import PARSERS


def add_engine_args(parser: argparse.ArgumentParser):
    """One flag per Config option (`max_model_len` -> --max-model-len); bools get --x / --no-x,
    `int | None` options accept "none". Flags not given leave Config's default."""
    hints = {f.name: f.type for f in fields(Config)}  # (the options' annotations are types, not strings)
    group = parser.add_argument_group("engine options (LLM(model, **options))")
    for f in fields(Config):
        if f.name not in Config.option_names():
            continue
        kinds = [t for t in _union_args(hints[f.name]) if t is not type(None)]
        optional = len(kinds) < len(_union_args(hints[f.name]))
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        text = OPTION_HELP.get(f.name, f"(default: {default})")
        if kinds == [bool]:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=text)
        elif typing.get_origin(kinds[0]) is list:  # e.g. --allowed-media-domains a.com b.org
            group.add_argument(flag, nargs="+", default=argparse.SUPPRESS, metavar="VALUE", help=text)
        else:
            group.add_argument(flag, type=_parser(kinds[0], optional), default=argparse.SUPPRESS,
                               metavar=kinds[0].__name__.upper(), help=text)


def _union_args(t) -> tuple:
    return typing.get_args(t) if typing.get_origin(t) in (typing.Union, types.UnionType) else (t,)


def _parser(kind: type, optional: bool):
    def parse(text: str):
        if optional and text.lower() == "none":
            return None
        return kind(text)
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def build_parser() -> argparse.ArgumentParser:
    from nanoinfer import __version__
    parser = argparse.ArgumentParser(prog="nanoinfer", description="nanoinfer: a minimal LLM inference engine")
    parser.add_argument("--version", action="version", version=f"nanoinfer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("model", help="a checkpoint directory or a Hugging Face repo id")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=argparse.SUPPRESS,
                       help="the model name clients use (default: MODEL's directory name for a local checkpoint, "
                            "else MODEL as given; clients may also use MODEL as given)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's and nanoinfer's log level")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGINT/SIGTERM, seconds to let in-flight requests finish; then they are cut "
                            "(a stream gets an error event and [DONE]) and the server exits within a few seconds")
    serve.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) served under their own model names; needs "
                            "--enable-lora (also vLLM's JSON form '{\"name\": ..., \"path\": ...}')")
    serve.add_argument("--allow-runtime-lora-updating", action="store_true",
                       default=os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower() in ("1", "true"),
                       help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's; also "
                            "$VLLM_ALLOW_RUNTIME_LORA_UPDATING=true); needs --enable-lora")
    add_server_limit_args(serve)
    add_data_parallel_args(serve)
    add_engine_args(serve)
    return parser


def add_data_parallel_args(parser: argparse.ArgumentParser):
    group = parser.add_argument_group("data parallel (README: Data-parallel serving)")
    group.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas behind this server, each with its own process, tensor-parallel group "
                            "and devices; requests go to the replica that cached their prefix, or the least loaded")
    group.add_argument("--data-parallel-backend", choices=["mp", "ray"], default="mp",
                       help="mp: replicas are local processes; ray: Ray actors placed on a Ray cluster "
                            "(pip install 'nanoinfer[ray]')")


def add_server_limit_args(parser: argparse.ArgumentParser):
    """What one request may ask (serve/limits.py) and who may reach the server."""
    group = parser.add_argument_group("limits and exposure")
    defaults = ServerLimits()
    group.add_argument("--max-n", type=int, default=defaults.max_n, help="most samples (n) a request may ask for")
    group.add_argument("--max-seqs-per-request", type=int, default=defaults.max_seqs_per_request,
                       help="most sequences one request may make: its prompts x n (completions) or inputs "
                            "(embeddings)")
    group.add_argument("--max-prompt-chars", type=int, default=argparse.SUPPRESS,
                       help="longer text prompts (and rendered chats) get a 400 before they are tokenized "
                            "(default: max_model_len x the characters of the vocabulary's longest token, "
                            "which no prompt that fits max_model_len can exceed)")
    group.add_argument("--max-logprobs", type=int, default=defaults.max_logprobs,
                       help="most logprobs / top_logprobs a request may ask for; -1: no limit (then logprobs=-1 "
                            "returns the whole vocabulary)")
    group.add_argument("--max-request-body-bytes", type=int, default=defaults.max_request_body_bytes,
                       help="larger request bodies get a 413")
    group.add_argument("--max-schema-depth", type=int, default=defaults.max_schema_depth,
                       help="deepest nesting (objects and arrays) of a request's JSON schema, tools, "
                            "structured_outputs or response_format; deeper gets a 400")
    group.add_argument("--max-schema-bytes", type=int, default=defaults.max_schema_bytes,
                       help="largest JSON schema, regex, grammar, choice list or tools list of a request, "
                            "as JSON text; larger gets a 400")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="accept a chat_template in requests (rendered in a sandbox process with time and "
                            "memory limits); without it such requests get a 400")
    group.add_argument("--chat-template-timeout", type=float, default=5.0,
                       help="seconds a chat template may take to render before its request gets a 400")
    group.add_argument("--chat-template-sandbox-renders", type=int, default=4,
                       help="request templates (--trust-request-chat-template) rendering at once, each in its own "
                            "sandbox process; more wait for one to finish")
    group.add_argument("--max-chat-template-chars", type=int, default=1 << 22,
                       help="most characters a chat template render may write")
    group.add_argument("--allowed-hosts", default=None,
                       help="comma-separated Host names the server answers to, '*' for any (default: localhost, "
                            "the --host address, and for a wildcard --host this machine's names and IP addresses)")
    group.add_argument("--enable-docs", action="store_true", help="serve /docs and /openapi.json")
    group.add_argument("--reasoning-parser", choices=PARSERS, default=None,
                       help="return the <think> ... </think> part of chat replies as reasoning_content "
                            "(none: it stays in content)")
    group.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default="hermes",
                       help="the model's tool-call syntax, parsed for tool_choice auto: hermes (Qwen's "
                            "<tool_call>{json}</tool_call>) or llama3_json")
    group.add_argument("--api-key", default=argparse.SUPPRESS,
                       help="require `Authorization: Bearer KEY` on every route but /health, /version and /metrics "
                            "(default: $NANOINFER_API_KEY, else none)")
    group.add_argument("--header-timeout", type=float, default=10.0,
                       help="seconds a connection has to send its request headers before it is closed")
    group.add_argument("--request-body-timeout", type=float, default=60.0,
                       help="seconds a request has to send its whole body once its headers are in; then its "
                            "connection is closed")
    group.add_argument("--timeout-keep-alive", type=int, default=5,
                       help="seconds an idle keep-alive connection stays open (uvicorn's setting)")


def serve(args: argparse.Namespace) -> int:
    from nanoinfer.serve import http_server
    from nanoinfer.serve.app import build_app
    from nanoinfer.serve.chat_renderer import ChatRenderer
    from nanoinfer.serve.http_guards import default_allowed_hosts
    from nanoinfer.serve.lora_modules import parse_lora_modules

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        limits = ServerLimits(max_n=args.max_n, max_request_body_bytes=args.max_request_body_bytes,
                              max_logprobs=args.max_logprobs, max_schema_depth=args.max_schema_depth,
                              max_schema_bytes=args.max_schema_bytes, max_seqs_per_request=args.max_seqs_per_request,
                              max_prompt_chars=getattr(args, "max_prompt_chars", None))
        from nanoinfer.structured.schema_limits import configure as configure_schema_limits
        configure_schema_limits(args.max_schema_depth, args.max_schema_bytes)  # (StructuredOutputsParams' too)
        if args.chat_template_sandbox_renders < 1 or not args.request_body_timeout > 0:
            raise ValueError("--chat-template-sandbox-renders must be >= 1 and --request-body-timeout > 0")
        lora_modules = parse_lora_modules(args.lora_modules)
        if (lora_modules or args.allow_runtime_lora_updating) and not getattr(args, "enable_lora", False):
            raise ValueError("--lora-modules and --allow-runtime-lora-updating need --enable-lora")
        _check_port_free(args.host, args.port)  # before minutes of model loading
    except (ValueError, OSError) as e:
        print(f"nanoinfer serve: {e}", file=sys.stderr)
        return 2
    options = {name: getattr(args, name) for name in Config.option_names() if hasattr(args, name)}
    options.setdefault("disable_log_stats", False)  # the server logs statistics unless told not to (vLLM)
    try:
        engine = _start_engines(args, options)  # builds the LLM in the engine process(es)
    except (ValueError, TypeError) as e:
        print(f"nanoinfer serve: {e}", file=sys.stderr)
        return 2
    renderer = None
    try:
        from nanoinfer.multimodal.media import MediaLoader
        media = MediaLoader(options.get("allowed_local_media_path"), options.get("allowed_media_domains"),
                            options.get("max_image_pixels"))
        renderer = ChatRenderer(engine.tokenizer, args.trust_request_chat_template, args.chat_template_timeout,
                                args.max_chat_template_chars, media=media,
                                max_prompt_chars=prompt_chars_limit(limits, engine.tokenizer, engine.max_model_len),
                                sandbox_renders=args.chat_template_sandbox_renders)
        # a local checkpoint is served under its directory's name (clients may also use the path given)
        default_name = os.path.basename(os.path.normpath(args.model)) if os.path.isdir(args.model) else args.model
        allowed = default_allowed_hosts(args.host) if args.allowed_hosts is None else \
            [h.strip() for h in args.allowed_hosts.split(",") if h.strip()]
        app = build_app(engine, getattr(args, "served_model_name", default_name), limits=limits, renderer=renderer,
                        allowed_hosts=allowed, enable_docs=args.enable_docs, model_aliases=(args.model,),
                        api_key=getattr(args, "api_key", None) or os.environ.get("NANOINFER_API_KEY"),
                        reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
                        lora_modules=lora_modules, allow_lora_updating=args.allow_runtime_lora_updating)
        _log_start(engine, args)
        # uvicorn shuts down gracefully on SIGINT / SIGTERM (the app's lifespan stops the engine),
        # then re-raises the signal to the handler found at start: this one, status 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: sys.exit(0))
        http_server.run(app, engine, args.host, args.port, args.log_level, args.shutdown_timeout,
                        args.header_timeout, args.timeout_keep_alive, args.request_body_timeout)
    finally:
        if renderer is not None:
            renderer.close()
        engine.close()
    return 0


def _start_engines(args: argparse.Namespace, options: dict):
    """One engine process, or --data-parallel-size replicas behind a router."""
    from nanoinfer.data_parallel.devices import check_data_parallel_size
    from nanoinfer.process.engine_client import EngineClient
    if check_data_parallel_size(args.data_parallel_size) == 1 and args.data_parallel_backend == "mp":
        return EngineClient(args.model, options, args.log_level)
    from nanoinfer.serve.replicas import ReplicaSet
    return ReplicaSet(args.model, options, args.log_level, args.data_parallel_size, args.data_parallel_backend)


def _log_start(engine, args):
    info = engine.summary
    logging.getLogger("nanoinfer.serve").info(
        "serving %s on http://%s:%d: dtype %s, max_model_len %d, tensor_parallel_size %s, data_parallel_size %s, "
        "KV cache %s blocks x %s tokens = %s tokens, at most %s sequences at once (%sx max_model_len) per replica",
        engine.model, args.host, args.port, info.get("dtype"), engine.max_model_len, info.get("tensor_parallel_size"),
        info.get("data_parallel_size", 1), info.get("kv_blocks"),
        info.get("block_size"), info.get("kv_tokens"), info.get("max_num_seqs"), info.get("max_concurrency"))


def _check_port_free(host: str, port: int):
    import socket
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2
