"""`nanoinfer serve MODEL [options]` (also `python -m nanoinfer serve ...`): the OpenAI-compatible
server. Every LLM option is a --kebab-case flag, generated from nanoinfer.config.Config."""
import argparse
import logging
import signal
import sys
import types
import typing
from dataclasses import MISSING, fields

from nanoinfer.config import Config


def add_engine_args(parser: argparse.ArgumentParser):
    """One flag per Config option (`max_model_len` -> --max-model-len); bools get --x / --no-x,
    `int | None` options accept "none". Flags not given leave Config's default."""
    hints = typing.get_type_hints(Config)
    group = parser.add_argument_group("engine options (LLM(model, **options))")
    for f in fields(Config):
        if f.name not in Config.option_names():
            continue
        kinds = [t for t in _union_args(hints[f.name]) if t is not type(None)]
        optional = len(kinds) < len(_union_args(hints[f.name]))
        flag = "--" + f.name.replace("_", "-")
        default = None if f.default is MISSING else f.default
        if kinds == [bool]:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=f"(default: {default})")
        else:
            group.add_argument(flag, type=_parser(kinds[0], optional), default=argparse.SUPPRESS,
                               metavar=kinds[0].__name__.upper(), help=f"(default: {default})")


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
    parser = argparse.ArgumentParser(prog="nanoinfer", description="nanoinfer: a minimal LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    serve.add_argument("model", help="a checkpoint directory or a Hugging Face repo id")
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on")
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--served-model-name", default=argparse.SUPPRESS,
                       help="the model name clients use (default: MODEL as given)")
    serve.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                       help="uvicorn's and nanoinfer's log level")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="on SIGINT/SIGTERM, seconds to let in-flight requests finish before aborting them")
    add_engine_args(serve)
    return parser


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    from nanoinfer.serve.app import build_app
    from nanoinfer.serve.engine_client import EngineClient

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    options = {name: getattr(args, name) for name in Config.option_names() if hasattr(args, name)}
    try:
        engine = EngineClient(args.model, options, args.log_level)  # builds the LLM in the engine process
    except (ValueError, TypeError) as e:
        print(f"nanoinfer serve: {e}", file=sys.stderr)
        return 2
    try:
        app = build_app(engine, getattr(args, "served_model_name", args.model))
        # uvicorn shuts down gracefully on SIGINT / SIGTERM (the app's lifespan stops the engine),
        # then re-raises the signal to the handler found at start: this one, status 0.
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: sys.exit(0))
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=args.shutdown_timeout)
    finally:
        engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2
