"""What the fusions of a per-op table compute: each named fusion's instruction and fused computation, read from an
XLA dump of the optimized HLO. A profile names kernels (`loop_multiply_fusion_45`); the dump says which arrays they
read and write (there: a bf16[2688,3712] product of a weight and a broadcast row, written to memory).

    XLA_FLAGS="--xla_dump_to=/tmp/dump --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*run.*" \\
        python3 -m jaxmodels bench ... --profile /tmp/prof > bench.log
    python3 bench/lab/hlo_fusions.py /tmp/dump --table bench.log --top 12     # the table's first 12 ops
    python3 bench/lab/hlo_fusions.py /tmp/dump --names loop_multiply_fusion_45,input_reduce_fusion_121

Fusion numbers are per module: a module is shown when it defines every name asked for (`--param` narrows the choice
to modules with a parameter of that shape, e.g. `s32[1]` for a one-sequence decode step's batch).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

OP_ROW = re.compile(r"^\| `([^`]+)` \| ([^|]+) \|")
MAX_LINE = 240


def profile_to_hlo_name(name: str) -> str:
    """A profiled kernel's name -> its HLO instruction name: the trace writes `fusion.45` as `fusion_45`."""
    return re.sub(r"_(\d+)$", r".\1", name)


def names_from_table(log: str, top: int) -> list[str]:
    """The first `top` fusions of the per-op table (`| op | category | ...`) in a benchmark log."""
    names = []
    for line in log.splitlines():
        match = OP_ROW.match(line)
        if match and "fusion" in match.group(1) and match.group(1) not in names:
            names.append(match.group(1))
    return names[:top]


def instruction(text: str, name: str) -> str | None:
    match = re.search(rf"^\s*(?:ROOT )?%{re.escape(name)} = .*$", text, re.MULTILINE)
    return match.group(0).strip() if match else None


def computation(text: str, called: str) -> list[str]:
    """The lines of computation `called` (from its header to its closing brace)."""
    start = re.search(rf"^%{re.escape(called)} .*\{{$", text, re.MULTILINE)
    if not start:
        return []
    lines = []
    for line in text[start.start():].splitlines():
        lines.append(line.strip())
        if line.startswith("}"):
            break
    return lines


def short(line: str) -> str:
    """Metadata and backend configs dropped: the op, its shape and operands."""
    line = re.sub(r", (metadata|backend_config|frontend_attributes)=.*$", "", line)
    return line if len(line) <= MAX_LINE else line[:MAX_LINE] + " ..."


def describe(text: str, names: list[str]) -> str:
    out = []
    for profiled in names:
        name = profile_to_hlo_name(profiled)
        line = instruction(text, name)
        out.append(f"### {profiled}")
        if line is None:
            out.append("(not in this module)\n")
            continue
        out.append(short(line))
        called = re.search(r"calls=%([\w.\-]+)", line)
        if called:
            out += ["    " + short(body) for body in computation(text, called.group(1))]
        out.append("")
    return "\n".join(out)


def modules(dump: pathlib.Path, names: list[str], param: str | None):
    for path in sorted(dump.glob("*after_optimizations.txt")):
        text = path.read_text()
        if all(instruction(text, profile_to_hlo_name(n)) is not None for n in names):
            if param is None or re.search(rf"= {re.escape(param)}\S* parameter\(", text):
                yield path, text


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dump", type=pathlib.Path, help="the --xla_dump_to directory")
    parser.add_argument("--names", help="comma-separated kernel names as the profile prints them")
    parser.add_argument("--table", type=pathlib.Path, help="a benchmark log with a per-op table")
    parser.add_argument("--top", type=int, default=12, help="how many of the table's fusions")
    parser.add_argument("--param", help="only modules with a parameter of this shape, e.g. s32[1]")
    args = parser.parse_args(argv)
    names = args.names.split(",") if args.names else []
    if args.table:
        names += names_from_table(args.table.read_text(), args.top)
    if not names:
        parser.error("no fusions named: pass --names or --table")
    found = list(modules(args.dump, names, args.param))
    if not found:
        print(f"no module of {args.dump} defines all of {names}", file=sys.stderr)
        return 1
    for path, text in found:
        print(f"## {path.name}\n\n{describe(text, names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
