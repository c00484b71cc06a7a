"""Figures and markdown tables of the serving benchmark's results (the JSONs `python -m jaxmodels bench --json`
writes), for docs/BENCHMARKS.md.

    python -m jaxmodels bench-report nano9b.json nano30b.json --plot docs/figures --markdown tables.md
    python -m jaxmodels bench-report RESULTS.json ... --plot docs/figures --update docs/BENCHMARKS.md

Figures (PNG, matplotlib's Agg renderer; the [bench] extra): decode output tok/s against concurrency, TTFT against
prompt length, and the serving runs' ITL and TTFT percentiles. Tables: per JSON, under its command, commit and
device, decode tok/s against concurrency, TTFT and prefill tok/s against prompt length, and the serving runs. Each
JSON is one series in the figures and one section of the tables, named by its label; transformers' numbers and the
hardware floor stand beside ours where the JSON has them. JSONs written before the prefill sweep and the p90s read
too: a number a JSON lacks shows as "-". `--update PAGE` rewrites only the block between PAGE's two markers
(`BEGIN` and `END`), so a page's prose around its generated tables is kept and its figures are never edited by hand;
name the JSONs in the order of the page's own command (its sections follow it).
"""

import argparse
import json
import math
import os

FIGURES = {"decode": "decode_throughput.png", "prefill": "prefill_ttft.png", "serve": "serve_latency.png"}
PERCENTILES = (50, 90, 99)
BEGIN = "<!-- bench-report: generated from docs/results, do not edit by hand -->"
END = "<!-- end of bench-report -->"


def load(paths) -> list[dict]:
    results = []
    for path in paths:
        with open(path) as f:
            results.append(json.load(f))
    return results


def label_of(results: dict) -> str:
    return results.get("label") or os.path.splitext(os.path.basename(results.get("config", "results")))[0]


def number(value) -> float | None:
    """`value` as a float when it is a finite number; None for the "-", "OOM" and NaN the JSONs hold instead."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def prefill_rows(results: dict) -> list[dict]:
    """The prefill phase's rows, shortest prompt first (one row in JSONs from before the sweep)."""
    rows = results.get("prefill_sweep") or ([results["prefill"]] if "prefill" in results else [])
    return sorted(rows, key=lambda row: row.get("tokens", 0))


def their_prefill_rows(results: dict) -> list[dict]:
    theirs = results.get("transformers", {})
    rows = theirs.get("prefill_sweep") or ([theirs["prefill"]] if "prefill" in theirs else [])
    return sorted((row for row in rows if "tokens" in row), key=lambda row: row["tokens"])


def decode_floor_tok_s(row: dict) -> float | None:
    """Output tok/s at the bandwidth floor (`floor_tok_s`; from `floor_ms` in JSONs written before it)."""
    if "floor_tok_s" in row:
        return number(row["floor_tok_s"])
    floor_ms = number(row.get("floor_ms"))
    return row["batch"] / floor_ms * 1e3 if floor_ms else None


def samplings(results: dict) -> list[str]:
    return list(dict.fromkeys(row.get("sampling", "plain") for row in results.get("decode", [])))


# --------------------------------------------------------------------------------------------------------- figures

def plot(results_json_paths, out_dir: str) -> list[str]:
    """Write the figures of the results in `results_json_paths` into `out_dir`; returns the PNGs' paths."""
    return plot_results(load(results_json_paths), out_dir)


def plot_results(results_list: list[dict], out_dir: str) -> list[str]:
    """The figures of results already loaded: each figure whose phase some of them measured."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise SystemExit(f"plotting needs matplotlib (pip install 'jaxmodels[bench]'): {e}")
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for phase, draw in (("decode", draw_decode), ("prefill", draw_prefill), ("serve", draw_serve)):
        if not any(phase in results for results in results_list):
            continue
        figure = Figure(figsize=(11 if phase == "serve" else 7, 4.5), layout="constrained")
        FigureCanvasAgg(figure)  # PNGs through Agg, with no pyplot state and no display
        draw(figure, results_list)
        path = os.path.join(out_dir, FIGURES[phase])
        figure.savefig(path, dpi=120)
        written.append(path)
    return written


def draw_decode(figure, results_list) -> None:
    ax = figure.add_subplot()
    markers = "osD^v<>"
    for i, results in enumerate(results_list):
        color, label, rows = f"C{i % 10}", label_of(results), results.get("decode", [])
        kinds = samplings(results)
        for k, sampling in enumerate(kinds):
            mine = sorted((row["batch"], row["tok_s"]) for row in rows if row.get("sampling", "plain") == sampling)
            name = label if len(kinds) == 1 else f"{label} ({sampling})"
            series(ax, mine, color=color, marker=markers[k % len(markers)], linestyle="-", label=name)
        first = {}
        for row in rows:
            first.setdefault(row["batch"], row)
        floor = sorted((batch, decode_floor_tok_s(row)) for batch, row in first.items())
        series(ax, floor, color=color, linestyle=":", label=f"{label}: floor")
        theirs = sorted((row["batch"], number(row.get("tok_s")))
                        for row in results.get("transformers", {}).get("decode", []))
        series(ax, theirs, color=color, marker="x", linestyle="--", label=f"{label}: transformers")
    measured_ticks(ax)
    ax.set_xlabel("concurrency (requests decoding together)")
    ax.set_ylabel("output tok/s")
    ax.set_title("Decode throughput against concurrency")
    finish(ax)


def draw_prefill(figure, results_list) -> None:
    ax = figure.add_subplot()
    for i, results in enumerate(results_list):
        color, label = f"C{i % 10}", label_of(results)
        rows = prefill_rows(results)
        series(ax, [(row["tokens"], number(row.get("ttft_ms"))) for row in rows], color=color, marker="o",
               linestyle="-", label=label)
        series(ax, [(row["tokens"], number(row.get("floor_ms"))) for row in rows], color=color, linestyle=":",
               label=f"{label}: floor")
        series(ax, [(row["tokens"], number(row.get("ttft_ms"))) for row in their_prefill_rows(results)],
               color=color, marker="x", linestyle="--", label=f"{label}: transformers")
    measured_ticks(ax)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("time to first token (ms)")
    ax.set_title("TTFT against prompt length (one prompt)")
    finish(ax)


def draw_serve(figure, results_list) -> None:
    """Grouped bars: one group per serving run of each JSON, one bar per percentile."""
    runs = [(f"{label_of(results)}\n{arrivals(run)}", run)
            for results in results_list for run in results.get("serve", [])]
    width = 0.8 / len(PERCENTILES)
    for ax, metric, title in zip(figure.subplots(1, 2), ("itl", "ttft"),
                                 ("Inter-token latency", "Time to first token")):
        for k, q in enumerate(PERCENTILES):
            heights = [number(run.get(f"{metric}_p{q}_ms")) for _, run in runs]
            xs = [j + (k - (len(PERCENTILES) - 1) / 2) * width for j in range(len(runs))]
            ax.bar(xs, [h if h is not None else 0.0 for h in heights], width, label=f"p{q}", color=f"C{k}")
        ax.set_xticks(range(len(runs)), [name for name, _ in runs], fontsize=8, rotation=35, ha="right")
        ax.set_yscale("log")  # all-at-once TTFTs are seconds, paced ones tens of ms
        ax.set_ylabel("ms")
        ax.set_title(f"{title} (serving runs)")
        finish(ax)


def arrivals(run: dict) -> str:
    return f"{run['rate']:g} arrivals/s" if number(run.get("rate")) else "all at once"


def series(ax, points, **style) -> None:
    """A line through the points whose value is a number (none: no line, no legend entry)."""
    points = [(x, y) for x, y in points if y is not None and y > 0]
    if points:
        ax.plot(*zip(*points), **style)


def measured_ticks(ax) -> None:
    """Log axes (sizes double, and floors sit orders of magnitude away), ticked at the sizes measured."""
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    sizes = sorted({float(x) for line in ax.get_lines() for x in line.get_xdata()})
    if sizes:
        ax.set_xticks(sizes, [f"{x:g}" for x in sizes])
        ax.set_xticks([], minor=True)


def finish(ax) -> None:
    ax.grid(True, which="major", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)


# ---------------------------------------------------------------------------------------------------------- tables

def markdown(results_json_paths, figures: list[str] | None = None) -> str:
    """The markdown tables of the results in `results_json_paths`, one section per JSON; `figures` (paths as the
    markdown should link them) are embedded first."""
    return markdown_results(load(results_json_paths), figures)


def links_from(markdown_path: str, paths) -> list[str]:
    """`paths` as a markdown file at `markdown_path` links them (relative to its directory)."""
    base = os.path.dirname(os.path.abspath(markdown_path))
    return [os.path.relpath(os.path.abspath(path), base) for path in paths]


def markdown_results(results_list: list[dict], figures: list[str] | None = None) -> str:
    parts = [f"![{os.path.splitext(os.path.basename(path))[0].replace('_', ' ')}]({path})" for path in figures or []]
    parts += [section(results) for results in results_list]
    return "\n\n".join(parts) + "\n"


def section(results: dict) -> str:
    """The run's heading and provenance, then its tables (each phase measured): decode against concurrency (B),
    prefill against prompt length (prompt tokens), the serving runs (requests); the first column names the phase."""
    parts = [f"### {label_of(results)}", provenance_line(results)]
    if results.get("decode"):
        parts.append(decode_table(results))
    if prefill_rows(results):
        parts.append(prefill_table(results))
    if results.get("serve"):
        parts.append(serve_table(results))
    return "\n\n".join(parts)


def provenance_line(results: dict) -> str:
    command = f"`{results['command']}`" if results.get("command") else "command not recorded"
    where = [f"at {results.get('commit', 'an unrecorded commit')}"]
    if results.get("device"):
        count = results.get("device_count", 1)
        where.append(f"on {results['device']}" + (f" x {count}" if count > 1 else ""))
    if results.get("jax_version"):
        where.append(f"jax {results['jax_version']}")
    if results.get("date"):
        where.append(results["date"])
    weights = f"{results['weights']} weights, " if results.get("weights") else ""
    cut_off = (f"; the run was cut off after its {results['cut_off_after']} phase" if results.get("cut_off_after")
               else "")
    return f"{command} {', '.join(where)} ({weights}{results.get('dtype', '?')} activations{cut_off})"


def cell(value, spec: str) -> str:
    if isinstance(value, str):
        return value
    value = number(value)
    return "-" if value is None else format(value, spec)


def render(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def decode_table(results: dict) -> str:
    theirs = {row["batch"]: row for row in results.get("transformers", {}).get("decode", [])}
    with_sampling = samplings(results) != ["plain"]
    header = ["B", *(["sampling"] if with_sampling else []), "tok/s", "transformers tok/s", "floor tok/s",
              "ms / step", "host share", "% of floor"]
    rows = []
    for row in sorted(results["decode"], key=lambda row: row["batch"]):
        their = theirs.get(row["batch"], {})
        rows.append([str(row["batch"]), *([row.get("sampling", "plain")] if with_sampling else []),
                     cell(row.get("tok_s"), ",.0f"), cell(their.get("tok_s", their.get("error")), ",.0f"),
                     cell(decode_floor_tok_s(row), ",.0f"), cell(row.get("step_ms"), ".2f"),
                     cell(row.get("host_share"), ".1%"), cell(row.get("of_floor"), ".1%")])
    return render(header, rows)


def prefill_table(results: dict) -> str:
    theirs = {row["tokens"]: row for row in their_prefill_rows(results)}
    header = ["prompt tokens", "TTFT ms", "tok/s", "transformers TTFT ms", "transformers tok/s", "floor TTFT ms",
              "% of floor"]
    rows = []
    for row in prefill_rows(results):
        their = theirs.get(row["tokens"], {})
        rows.append([str(row["tokens"]), cell(row.get("ttft_ms"), ",.1f"), cell(row.get("tok_s"), ",.0f"),
                     cell(their.get("ttft_ms", their.get("error")), ",.1f"),
                     cell(their.get("tok_s", their.get("error")), ",.0f"), cell(row.get("floor_ms"), ",.1f"),
                     cell(row.get("of_floor"), ".1%")])
    return render(header, rows)


def serve_table(results: dict) -> str:
    header = ["requests", "tokens in / out", "arrivals", "output tok/s",
              *(f"TTFT p{q} ms" for q in PERCENTILES), *(f"ITL p{q} ms" for q in PERCENTILES), "preemptions"]
    rows = []
    for run in results["serve"]:
        lengths = f"{run['in_tokens']} / {run['out_tokens']}" if "in_tokens" in run else "-"
        rows.append([str(run["requests"]), lengths, arrivals(run), cell(run.get("out_tok_s"), ",.0f"),
                     *(cell(run.get(f"ttft_p{q}_ms"), ",.1f") for q in PERCENTILES),
                     *(cell(run.get(f"itl_p{q}_ms"), ",.2f") for q in PERCENTILES),
                     cell(run.get("preemptions"), ".0f")])
    return render(header, rows)


# ------------------------------------------------------------------------------------------------------------- CLI

def main(argv=None, prog: str | None = None) -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", metavar="RESULTS.json", help="JSONs of `python -m jaxmodels bench`")
    parser.add_argument("--plot", metavar="DIR", help="write the figures (PNG) here")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--markdown", metavar="OUT.md",
                        help="write the tables here, with the figures of --plot embedded (default: print them)")
    output.add_argument("--update", metavar="PAGE.md",
                        help=f"replace the tables between PAGE's markers ({BEGIN} ... {END}), keeping the rest")
    args = parser.parse_args(argv)
    results_list = load(args.results)
    if args.update:
        page = read_page_with_markers(args.update, parser)  # before plotting: a page without markers fails at once
    figures = plot_results(results_list, args.plot) if args.plot else []
    for path in figures:
        print(f"figure: {path}")
    target = args.update or args.markdown
    if target is None:
        print(markdown_results(results_list))
        return
    tables = markdown_results(results_list, links_from(target, figures))  # figures linked from where they are read
    with open(target, "w") as f:
        f.write(spliced(page, tables) if args.update else tables)
    print(f"tables: {target}" + (" (between its markers)" if args.update else ""))


def read_page_with_markers(path: str, parser: argparse.ArgumentParser) -> str:
    try:
        with open(path) as f:
            page = f.read()
    except OSError as error:
        parser.error(f"--update {path}: {error.strerror}")
    if page.count(BEGIN) != 1 or page.count(END) != 1 or page.index(BEGIN) > page.index(END):
        parser.error(f"--update {path}: the page needs the line {BEGIN} and, after it, {END}, once each")
    return page


def spliced(page: str, tables: str) -> str:
    """`page` with the text between its markers replaced by `tables` (a blank line on each side)."""
    head, rest = page.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    return f"{head}{BEGIN}\n\n{tables.strip()}\n\n{END}{tail}"
