"""Command line: `python -m jaxmodels demo`."""

import argparse


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m jaxmodels")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="build a small random Nemotron-H checkpoint and serve it")
    demo.add_argument("--requests", type=int, default=8)
    demo.add_argument("--max-new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from jaxmodels.demo import run_demo

        run_demo(num_requests=args.requests, max_new_tokens=args.max_new_tokens)


if __name__ == "__main__":
    main()
