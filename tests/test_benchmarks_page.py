"""docs/BENCHMARKS.md against its sources: current results in a page a user reads in minutes, each section naming the
commit it was measured at, and the serving tables exactly what `python -m jaxmodels bench-report` makes of the JSONs
in docs/results/ (so nobody edits a figure by hand)."""

import os
import re
import shlex

from jaxmodels.benchmark_report import BEGIN, END, FIGURES, links_from, load, markdown_results

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "BENCHMARKS.md")
MAX_LINES = 400


def read_page() -> str:
    with open(PAGE) as f:
        return f.read()


def test_the_page_has_at_most_400_lines():
    assert len(read_page().splitlines()) <= MAX_LINES


def test_every_section_names_a_commit():
    sections = re.split(r"^## ", read_page(), flags=re.M)[1:]
    assert sections
    assert [section.splitlines()[0] for section in sections if not re.search(r"\bcommits?\b|\bat [0-9a-f]{7}\b",
                                                                               section)] == []


def test_the_serving_tables_are_bench_reports_of_the_results():
    """The block between the markers is bench-report's markdown of the JSONs its regeneration command names, in that
    order, with the figures of its --plot directory linked from docs/."""
    text = read_page()
    command = re.search(r"`(python -m jaxmodels bench-report [^`]*)`", text.replace("\n", " "))
    assert command, "the page shows no bench-report command"
    words = shlex.split(command.group(1))
    jsons = [os.path.join(ROOT, word) for word in words if word.endswith(".json")]
    plot_dir = words[words.index("--plot") + 1]
    assert os.path.join(ROOT, words[words.index("--update") + 1]) == PAGE
    assert jsons and sorted(jsons) == sorted(
        os.path.join(ROOT, "docs", "results", name) for name in os.listdir(os.path.join(ROOT, "docs", "results")))
    figures = links_from(PAGE, [os.path.join(ROOT, plot_dir, name) for name in FIGURES.values()])
    generated = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert generated.strip() == markdown_results(load(jsons), figures).strip()
    for figure in figures:
        assert os.path.getsize(os.path.join(os.path.dirname(PAGE), figure)) > 0


def test_every_result_names_its_command_commit_and_device():
    for name in os.listdir(os.path.join(ROOT, "docs", "results")):
        (results,) = load([os.path.join(ROOT, "docs", "results", name)])
        assert results["command"].startswith("python -m jaxmodels bench ")
        assert re.fullmatch(r"[0-9a-f]{7,}", results["commit"]), (name, results["commit"])
        assert results["device"] and results["jax_version"]
