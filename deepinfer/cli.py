"""`deepinfer generate | chat | serve | pull`; `python server.py` is `deepinfer serve`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from deepinfer.args import (
    Environ,
    add_engine_args,
    add_flag,
    add_help_flags,
    add_serve_config_args,
    config_from_args,
)
from deepinfer.config import Config
from deepinfer.errors import ConfigError, DeepInferError
from deepinfer.request import SamplingParams


def build_parser(environ: Environ = None) -> argparse.ArgumentParser:
    """The `deepinfer` parser; every flag's default may come from `DEEPINFER_<FLAG>` in
    `environ` (default: the process environment)."""
    parser = argparse.ArgumentParser(prog="deepinfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="complete one prompt and print it", add_help=False)
    add_help_flags(gen)
    gen.add_argument("prompt", help="the text to complete (with --chat, the user's message)")
    add_flag(
        gen, "--chat", environ, action="store_true", help="wrap the prompt as one user message"
    )
    _add_sampling_args(gen, environ)
    add_engine_args(gen, environ)
    chat = sub.add_parser("chat", help="an interactive conversation, streamed", add_help=False)
    add_help_flags(chat)
    add_flag(chat, "--system", environ, default=None, help="system prompt")
    _add_sampling_args(chat, environ)
    add_engine_args(chat, environ)
    serve = sub.add_parser(
        "serve", help="the OpenAI/Anthropic compatible HTTP server", add_help=False
    )
    add_help_flags(serve)
    add_serve_args(serve, environ)
    sub.add_parser("pull", help="fetch a known model (`deepinfer pull --help`)", add_help=False)
    return parser


def add_serve_args(parser: argparse.ArgumentParser, environ: Environ = None) -> None:
    """The flags of `deepinfer serve` (and `python server.py`)."""
    add_flag(
        parser,
        "--log-level",
        environ,
        default="info",
        choices=list(LOG_LEVELS),
        help="logging level of the server",
    )
    add_serve_config_args(parser, environ)


LOG_LEVELS = ("debug", "info", "warning", "error")


def _add_sampling_args(p: argparse.ArgumentParser, environ: Environ) -> None:
    add_flag(p, "--max-tokens", environ, type=int, default=256, help="most tokens an answer has")
    add_flag(p, "--temperature", environ, type=float, default=0.0, help="0: greedy")
    add_flag(p, "--top-p", environ, type=float, default=1.0, help="nucleus sampling's mass")
    add_flag(p, "--sample-seed", environ, type=int, default=None, help="per-request sampling seed")
    add_flag(
        p,
        "--reasoning-effort",
        environ,
        choices=["low", "medium", "high"],
        default=None,
        help='a line added to the system prompt ("Reasoning effort: high.")',
    )


def _sampling(ns: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, seed=ns.sample_seed
    )


async def _generate(config: Config, ns: argparse.Namespace) -> None:
    from deepinfer.engine.async_engine import AsyncEngine
    from deepinfer.text.recipe import ChatMessage

    params = _sampling(ns)
    prompt = [ChatMessage("user", ns.prompt)] if ns.chat else ns.prompt
    async with AsyncEngine(config) as engine:
        async for out in engine.generate(prompt, params, reasoning_effort=ns.reasoning_effort):
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")


async def _chat(config: Config, ns: argparse.Namespace) -> None:
    from deepinfer.engine.async_engine import AsyncEngine
    from deepinfer.text.recipe import ChatMessage

    history = [ChatMessage("system", ns.system)] if ns.system else []
    async with AsyncEngine(config) as engine:
        while True:
            line = await asyncio.to_thread(_read_line, "> ")
            if line is None or line.strip() in {"/exit", "/quit"}:
                return
            history.append(ChatMessage("user", line))
            parts = []
            gen = engine.generate(history, _sampling(ns), reasoning_effort=ns.reasoning_effort)
            async for out in gen:
                parts.append(out.text)
                sys.stdout.write(out.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            history.append(ChatMessage("assistant", "".join(parts)))


def _read_line(prompt: str) -> str | None:
    try:
        return input(prompt)
    except EOFError:
        return None


def _run(coro_fn, config: Config, ns: argparse.Namespace) -> None:  # type: ignore[no-untyped-def]
    try:
        import uvloop

        uvloop.run(coro_fn(config, ns))
    except ImportError:
        asyncio.run(coro_fn(config, ns))


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["pull"]:
        from deepinfer.pull import run_pull

        return run_pull(args[1:])
    try:
        ns = build_parser().parse_args(args)
        _configure_logging(ns)
        config = config_from_args(ns)
        if ns.command == "serve" and config.experts.node_rank > 0:
            if config.tensor_parallel.tensor_parallel > 1:
                from deepinfer.engine.build_tensor_parallel import run_node as run_tp_node

                run_tp_node(config)  # another machine's tensor-parallel ranks: no API here
            else:
                from deepinfer.engine.build_experts import run_node

                run_node(config)  # another machine's expert-parallel ranks: no API here
        elif ns.command == "serve":
            from deepinfer.api.server import serve

            serve(config)
        elif ns.command == "generate":
            _run(_generate, config, ns)
        else:
            _run(_chat, config, ns)
    except (ConfigError, DeepInferError) as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


def _configure_logging(ns: argparse.Namespace) -> None:
    if ns.command == "serve":
        fmt = "%(asctime)s %(levelname)s %(name)s: %(message)s"
        logging.basicConfig(level=ns.log_level.upper(), format=fmt)
    else:
        logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")


if __name__ == "__main__":
    sys.exit(main())
