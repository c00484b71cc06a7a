"""The README and the docs pages against the code: the commands they show name real subcommands and flags, the
README's test command is the one CI runs, and every environment switch, CLI flag and HTTP route the code has is
documented somewhere in docs/.

The CLI's help comes from `jaxmodels.__main__.main([command, "--help"])` in this process (each command's parser
prints its help and exits before touching a device), which is much faster than a process per command.
"""

import contextlib
import functools
import glob
import io
import os
import re
import shlex

import pytest

from jaxmodels.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
# docs/BENCHMARKS.md is a record of measurements, written by the benchmarks' runs, not a page of instructions.
DOC_PAGES = sorted(path for path in glob.glob(os.path.join(ROOT, "docs", "*.md"))
                   if os.path.basename(path) != "BENCHMARKS.md")
PAGES = [README, *DOC_PAGES]
MAX_README_LINES = 120
SHELL_LANGUAGES = ("bash", "sh", "shell")
SEPARATORS = ("&&", "||", ";", "|", "&")
FLAG = re.compile(r"\[?(--[a-z][a-z0-9-]*)")
# Paths into the repository that a page names in code spans or links.
REPO_PATH = re.compile(r"(?<![\w./-])((?:bench|tools|jaxmodels|pallas_kernels|sharding|bridge|tests|docs|\.ci)"
                       r"/[\w./-]*[\w])")


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def page_id(path: str) -> str:
    return os.path.relpath(path, ROOT)


def shell_blocks(text: str) -> list[str]:
    """The bodies of the ```bash (sh, shell) fenced blocks of a markdown text."""
    return [body for language, body in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.M | re.S)
            if language in SHELL_LANGUAGES]


def shell_lines(block: str) -> list[str]:
    """The block's commands, backslash-continued lines joined."""
    return [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def inline_commands(text: str) -> list[str]:
    """Code spans in the prose that hold a `python -m jaxmodels ...` command."""
    return re.findall(r"`([^`\n]*python3? -m jaxmodels [^`\n]*)`", text)


def jaxmodels_calls(line: str) -> list[tuple[str, list[str]]]:
    """(subcommand, its --flags) of each `python -m jaxmodels SUB ...` in a shell line, also inside a quoted command
    (`bash -c '...'`); comments are left out."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    tokens = list(lexer)
    calls = []
    for i, token in enumerate(tokens):
        if " " in token:  # a quoted command
            calls += jaxmodels_calls(token)
        if os.path.basename(token) in ("python", "python3") and tokens[i + 1: i + 3] == ["-m", "jaxmodels"] \
                and len(tokens) > i + 3:
            flags = []
            for arg in tokens[i + 4:]:
                if arg in SEPARATORS:
                    break
                match = FLAG.match(arg)
                if match:
                    flags.append(match.group(1))
            calls.append((tokens[i + 3], flags))
    return calls


def documented_calls(path: str) -> list[tuple[str, list[str]]]:
    text = read(path)
    lines = [line for block in shell_blocks(text) for line in shell_lines(block)] + inline_commands(text)
    return [call for line in lines for call in jaxmodels_calls(line)]


@functools.lru_cache(maxsize=None)
def help_text(argv: tuple[str, ...]) -> str:
    """`python -m jaxmodels *argv --help`'s output; fails the test where the command does not exist."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()) as err:
        with pytest.raises(SystemExit) as exited:
            main([*argv, "--help"])
    assert exited.value.code == 0, f"python -m jaxmodels {' '.join(argv)} --help: {err.getvalue()[-500:]}"
    return out.getvalue()


def help_argv(command: str, flags: list[str]) -> tuple[str, ...]:
    """The argv whose --help lists `command`'s flags: the benchmark's workloads each have their own parser."""
    if command == "bench" and "--workload" in flags:
        return command, "--workload", "multiturn"
    return (command,)


def mentions_flag(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


CALLS = [(page, command, flags) for page in PAGES for command, flags in documented_calls(page)]


def test_the_readme_has_at_most_120_lines():
    assert len(read(README).splitlines()) <= MAX_README_LINES


def test_the_readme_shows_commands():
    """The parser below finds the README's commands (a guard against it silently finding none)."""
    commands = {command for page, command, _ in CALLS if page == README}
    assert {"demo", "serve"} <= commands


def test_the_readme_test_command_is_the_one_ci_runs():
    ci_command = [line for line in read(os.path.join(ROOT, ".ci", "run")).splitlines() if line.strip()][-1]
    readme_lines = [line for block in shell_blocks(read(README)) for line in shell_lines(block)]
    assert [line for line in readme_lines if "pytest" in line] == [ci_command]


def test_the_readme_keeps_the_demo_command():
    readme_lines = [line for block in shell_blocks(read(README)) for line in shell_lines(block)]
    assert "pip install -e . && python -m jaxmodels demo" in readme_lines


@pytest.mark.parametrize("page,command,flags", CALLS,
                         ids=[f"{page_id(page)}:{command}:{len(flags)}" for page, command, flags in CALLS])
def test_documented_commands_and_flags_exist(page, command, flags):
    text = help_text(help_argv(command, flags))
    missing = [flag for flag in flags if not mentions_flag(text, flag)]
    assert not missing, f"{page_id(page)}: python -m jaxmodels {command} has no {missing}"


def flags_of(command: str) -> list[str]:
    """Every flag in a command's --help (its usage lines and option list)."""
    return sorted(set(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", help_text((command,)))) - {"--help"})


@pytest.mark.parametrize("command", ["demo", "generate", "serve"])
def test_every_flag_of_the_main_commands_is_documented(command):
    docs = "\n".join(read(path) for path in DOC_PAGES)
    missing = [flag for flag in flags_of(command) if not mentions_flag(docs, flag)]
    assert not missing, f"python -m jaxmodels {command}: {missing} documented in no docs/ page"


def source_files() -> list[str]:
    return [path for package in ("jaxmodels", "pallas_kernels", "sharding", "bridge")
            for path in glob.glob(os.path.join(ROOT, package, "**", "*.py"), recursive=True)]


def test_every_environment_switch_is_documented_and_exists():
    """JAXMODELS_* variables: those the code reads are in docs/configuration.md, and those it names exist."""
    in_code = {name for path in source_files() for name in re.findall(r"\bJAXMODELS_[A-Z0-9_]*[A-Z0-9]", read(path))}
    in_docs = set(re.findall(r"\bJAXMODELS_[A-Z0-9_]*[A-Z0-9]", read(os.path.join(ROOT, "docs", "configuration.md"))))
    assert sorted(in_code - in_docs) == []
    assert sorted(in_docs - in_code) == []


def test_every_http_route_is_documented():
    app = read(os.path.join(ROOT, "jaxmodels", "serve", "app.py"))
    routes = {re.sub(r"\{(\w+):\w+\}", r"{\1}", route) for route in re.findall(r"@app\.(?:get|post)\(\"([^\"]+)\"", app)}
    serving = read(os.path.join(ROOT, "docs", "serving.md"))
    assert routes, "no routes found in jaxmodels/serve/app.py"
    assert sorted(route for route in routes if not re.search(rf"(?<![\w/]){re.escape(route)}(?![\w/])", serving)) == []


@pytest.mark.parametrize("page", [*PAGES, os.path.join(ROOT, "docs", "BENCHMARKS.md")], ids=page_id)
def test_named_files_and_links_exist(page):
    """Repository paths in a page's text and its relative links name files or folders that exist."""
    text = read(page)
    named = {os.path.join(ROOT, path) for path in REPO_PATH.findall(text) if not re.search(r"[*{}<>]", path)}
    links = {os.path.normpath(os.path.join(os.path.dirname(page), target.split("#")[0]))
             for target in re.findall(r"\]\(([^)\s]+)\)", text)
             if not re.match(r"[a-z]+:", target) and not target.startswith("#")}
    assert sorted(page_id(path) for path in named | links if not os.path.exists(path)) == []
