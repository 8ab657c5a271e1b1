"""`pagedllm bench {throughput,latency,serve,prefix}`: wired into `pagedllm/entrypoints/cli.py`.

Each sub-subcommand sets `func(args) -> int`; the modules are imported when the parser is built but
import nothing heavy themselves until they run (serve needs httpx only when it is used).
"""

from __future__ import annotations

import argparse


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    from pagedllm.benchmarks import latency, prefix, serve, throughput

    bench = subparsers.add_parser("bench", help="benchmark the engine or a running server")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    for name, module, text in (
        ("throughput", throughput, "offline throughput: every request given to LLM.generate at once"),
        ("latency", latency, "latency of one batch and of each decode step"),
        ("serve", serve, "load generator against an OpenAI-compatible server (ours or vLLM's)"),
        ("prefix", prefix, "shared system prompt, two waves, with and without prefix caching"),
    ):
        module.add_cli_args(
            sub.add_parser(
                name,
                help=text,
                description=module.__doc__,
                formatter_class=argparse.RawDescriptionHelpFormatter,
            )
        )
    return bench
