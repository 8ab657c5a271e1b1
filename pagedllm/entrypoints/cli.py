"""`pagedllm serve | generate | chat | bench` — vLLM's command line, same flag names."""

from __future__ import annotations

import argparse
import logging
import sys
import time

from pagedllm.engine import fork_server

_T0 = time.monotonic()  # the start-up timeline's "server modules" line counts from here

# The rest of pagedllm (torch, transformers, the server) is imported inside the functions: `serve`
# starts its engine's fork server before those imports (main), so that they overlap.


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=None, help="default: the model's generation_config")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--sampling-seed", type=int, default=None)


def _check_sampling_args(args: argparse.Namespace) -> None:
    """Reject bad sampling flags before the model loads (ValueError naming the field)."""
    from pagedllm.sampling_params import SamplingParams

    SamplingParams.from_optional(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.sampling_seed,
    )


def _sampling_params(llm, args: argparse.Namespace):
    params = llm.get_default_sampling_params()
    params.max_tokens = args.max_tokens
    for name in ("temperature", "top_p", "top_k"):
        if getattr(args, name) is not None:
            setattr(params, name, getattr(args, name))
    params.seed = args.sampling_seed
    params.__post_init__()  # validate the overrides
    return params


def _make_llm(args: argparse.Namespace):
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.llm import LLM

    engine_args = EngineArgs.from_cli_args(args)
    kwargs = {k: v for k, v in vars(engine_args).items() if k != "model"}
    return LLM(engine_args.model, **kwargs)


def cmd_generate(args: argparse.Namespace) -> int:
    _check_sampling_args(args)
    llm = _make_llm(args)
    params = _sampling_params(llm, args)
    prompt = args.prompt
    if args.chat:
        outs = llm.chat([{"role": "user", "content": prompt}], params, use_tqdm=False)
    else:
        outs = llm.generate(prompt, params, use_tqdm=False)
    print(outs[0].outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive chat: tokens stream to the terminal as they are generated."""
    from pagedllm.entrypoints.chat_utils import render_chat
    from pagedllm.sampling_params import RequestOutputKind

    _check_sampling_args(args)
    llm = _make_llm(args)
    engine = llm.llm_engine
    tok = engine.get_tokenizer()
    history: list[dict[str, str]] = []
    if args.system_prompt:
        history.append({"role": "system", "content": args.system_prompt})
    turn = 0
    print("Chatting with the model. /exit (or Ctrl-D) ends the chat; Ctrl-C stops an answer.", flush=True)
    while True:
        try:
            line = input("> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D, or Ctrl-C at the prompt: leave quietly
            print()
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        history.append({"role": "user", "content": line})
        text = render_chat(tok, history)
        params = _sampling_params(llm, args)
        params.output_kind = RequestOutputKind.DELTA
        rid = f"chat-{turn}"
        turn += 1
        engine.add_request(rid, {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}, params)
        reply = []
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    delta = out.outputs[0].text
                    reply.append(delta)
                    sys.stdout.write(delta)
                    sys.stdout.flush()
        except KeyboardInterrupt:
            # Ctrl-C stops this answer (as in vLLM's chat), not the program: the partial reply stays.
            engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
            sys.stdout.write(" [stopped]")
        print()
        history.append({"role": "assistant", "content": "".join(reply)})


def cmd_serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.api_server import run_server

    # The start-up timeline (scripts/gpu_cold_start.py): the frontend's own imports (torch among them,
    # mostly in build_parser) since this module was imported.
    logging.getLogger("pagedllm.entrypoints.cli").info("start-up: server modules import took %.2f s",
                                                       time.monotonic() - _T0)
    run_server(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    import pagedllm
    from pagedllm.benchmarks.cli import add_bench_parser
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.entrypoints.openai.api_server import make_arg_parser

    parser = argparse.ArgumentParser(prog="pagedllm", description="pagedllm: LLM inference and serving")
    parser.add_argument("-v", "--version", action="version", version=pagedllm.__version__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    make_arg_parser(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="generate a completion for one prompt")
    EngineArgs.add_cli_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="wrap the prompt in the chat template (default on)")
    _add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat in the terminal")
    EngineArgs.add_cli_args(p)
    p.add_argument("--system-prompt", default=None)
    _add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    add_bench_parser(sub)
    from pagedllm.rag.cli import add_rag_parser

    add_rag_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pagedllm import bytecode_cache

    bytecode_cache.install()  # PAGEDLLM_BYTECODE_CACHE=1: before the rest of pagedllm imports
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["serve"] and not {"-h", "--help"} & set(argv):
        fork_server.start_early()  # its torch / transformers imports run beside ours (engine/fork_server.py)
    from pagedllm.entrypoints.openai.cli_args import expand_config_args

    try:
        argv = expand_config_args(argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
