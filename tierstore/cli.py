"""The ``tierstore`` command line: ``serve``, ``stats``, ``demo``, ``bench NAME``, ``trace``."""

from __future__ import annotations

import argparse
import json
import sys

from tierstore import bench


def _build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tierstore", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from tierstore import demo
    from tierstore.replay import download, synth
    from tierstore.service import server

    demo.add_arguments(sub.add_parser("demo", help="run the quick-start demonstration"))

    serve = sub.add_parser("serve", help="run the HTTP service")
    server.add_arguments(serve)

    principals = sub.add_parser("principals", help="make tokens for a principals file")
    principals_sub = principals.add_subparsers(dest="principals", required=True)
    principals_sub.add_parser("token", help="print a new random token and its hashed entry")
    principals_sub.add_parser("hash", help="read a token from stdin, print its hashed entry")
    principals_sub.add_parser("check", help="validate a principals file").add_argument("path")

    stats = sub.add_parser("stats", help="print a running service's per-tier hit rates")
    stats.add_argument("--url", default="http://127.0.0.1:8080")
    stats.add_argument("--auth-token", default=None)
    stats.add_argument("--json", action="store_true")

    trace = sub.add_parser("trace", help="write or download request traces")
    trace_sub = trace.add_subparsers(dest="trace", required=True)
    synth.add_arguments(trace_sub.add_parser(
        "synth", help="write a generated Mooncake-format trace", description=synth.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter))
    download.add_arguments(trace_sub.add_parser(
        "fetch", help="download a public FAST'25 trace into the cache, print its path"))

    bench_parser = sub.add_parser("bench", help="run a benchmark")
    bench_sub = bench_parser.add_subparsers(dest="bench", required=True)
    # Only the benchmark being run is imported (some import SGLang or LMCache, seconds each);
    # `tierstore bench -h` imports them all to list them, other commands none.
    args = sys.argv[1:] if argv is None else argv
    wanted = args[1] if len(args) > 1 and args[0] == "bench" and not args[1].startswith("-") \
        else None
    other = bool(args) and not args[0].startswith("-") and args[0] != "bench"
    for name in bench.names():
        if other or (wanted is not None and name != wanted):
            bench_sub.add_parser(name)
            continue
        module = bench.load(name)
        doc = (module.__doc__ or name).strip().splitlines()[0]
        p = bench_sub.add_parser(name, help=doc, description=module.__doc__)
        p.add_argument("--json", action="store_true", help="print the figures as JSON, last line")
        module.add_arguments(p)
    return parser


def run_bench(name: str, args: argparse.Namespace) -> dict:
    """Run one benchmark by name and print its table (and JSON with ``--json``)."""
    module = bench.load(name)
    result = module.run(args)
    print(module.render(result))
    if getattr(args, "json", False):
        print(json.dumps(result, sort_keys=True))
    return result


def main(argv: list[str] | None = None) -> int:
    args = _build_parser(argv).parse_args(argv)
    if args.command == "bench":
        run_bench(args.bench, args)
        return 0
    if args.command == "demo":
        from tierstore.demo import main as demo_main

        return demo_main(args)
    if args.command == "serve":
        from tierstore.service.server import serve

        return serve(args)
    if args.command == "principals":
        from tierstore.service.principals import cli as principals_cli

        return principals_cli(args.principals, getattr(args, "path", None))
    if args.command == "trace":
        from tierstore.replay import download, synth

        return synth.main(args) if args.trace == "synth" else download.main(args)
    if args.command == "stats":
        from tierstore.client import print_stats

        return print_stats(args.url, args.auth_token, as_json=args.json)
    return 2


if __name__ == "__main__":
    sys.exit(main())
