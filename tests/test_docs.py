"""The manual names only what exists (issue 43): README.md and docs/*.md.

Checked, page by page, without running anything but parsers:

- every relative link resolves to a file, and its ``#anchor`` to a heading of that file (GitHub's slugs);
- every ``dice-ray SUBCOMMAND ...`` (and ``python -m dice_ray.cli ...``) in a code span or block names a
  subcommand of :func:`dice_ray.cli.build_parser`, and each ``--flag`` of it that subcommand's option (a value
  given to a flag with choices is one of them); ``python jobs/X.py ...`` the same, through the subcommand the
  job runs; ``python benchmarks/X.py ...`` an existing benchmark and flags its argparse defines (read with
  ``ast``, not run); a code span that starts with a ``--flag`` names a flag some command defines;
- every config key, ``section.key`` (with or without ``=value``) or a top-level ``key=value`` override, is
  a field of :class:`dice_ray.config.DiceConfig`;
- every repository path (``configs/``, ``benchmarks/``, ``jobs/``, ``tests/``, ``docs/``, ``dashboards/``,
  ``dice_ray/``) exists; internal module paths appear only in docs/architecture.md, at package level;
- README.md is at most 250 lines, the pages of the manual exist and the old measurement log is gone.
"""

from __future__ import annotations

import argparse
import ast
import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
from pydantic import BaseModel

from dice_ray.cli import build_parser
from dice_ray.config import DiceConfig

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
ARCHITECTURE = DOCS / "architecture.md"
README_MAX_LINES = 250
REQUIRED_PAGES = ("candidates-and-reward", "verifier", "configs", "training", "monitoring", "evaluation",
                  "benchmarks", "troubleshooting", "architecture")
#: the measurement log the benchmarks page replaced (spelt in two parts so this file does not name it)
OLD_LOG = "verifier-" + "measurements"

#: flags of other tools that a code span may start with (ray, pip, nvcc, Grafana)
EXTERNAL_FLAGS = {"--head", "--temp-dir", "--port", "--dashboard-port", "--ray-client-server-port",
                  "--dashboard-agent-listen-port", "--metrics-export-port", "--working-dir", "--index-url",
                  "--std", "--use_fast_math", "--force"}
#: top-level modules of dice_ray that pages may name in dotted form (the candidate's API, the CLI's module)
PUBLIC_MODULES = {"dice_ray.launch", "dice_ray.cli"}
FILE_SUFFIXES = {"py", "yaml", "yml", "json", "jsonl", "md", "png", "txt", "cu", "so", "ini"}
PATH_PREFIXES = ("configs", "benchmarks", "jobs", "dashboards", "tests", "docs", "dice_ray")
PYTHONS = {"python", "python3"}


# -- reading markdown --------------------------------------------------------------------------------

FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)")
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def split_page(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(prose lines, fenced blocks as (language, lines))."""
    prose: list[str] = []
    blocks: list[tuple[str, list[str]]] = []
    fence, lang, body = None, "", []
    for line in text.splitlines():
        m = FENCE.match(line)
        if fence is None and m:
            fence, lang, body = m.group(1), m.group(2).lower(), []
        elif fence is not None and line.strip().startswith(fence[0] * len(fence)) and not line.strip().strip(fence[0]):
            blocks.append((lang, body))
            fence = None
        elif fence is not None:
            body.append(line)
        else:
            prose.append(line)
    assert fence is None, "a code block is not closed"
    return prose, blocks


def spans(prose: list[str]) -> list[str]:
    """Inline code spans of the prose (a span may not cross a line: the pages keep them on one)."""
    return [m.group(2).strip() for line in prose for m in SPAN.finditer(line)]


def command_lines(page: Path) -> list[str]:
    """Every code span, and every logical line of every non-Python code block (``\\`` continuations joined)."""
    prose, blocks = split_page(page.read_text())
    lines = spans(prose)
    for lang, body in blocks:
        if lang == "python":
            continue
        joined = "\n".join(body).replace("\\\n", " ")
        lines.extend(joined.splitlines())
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: link text kept, lower case, punctuation but ``-`` and ``_`` dropped,
    spaces to ``-``."""
    text = LINK.sub(r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors(page: Path) -> frozenset[str]:
    prose, _ = split_page(page.read_text())
    seen: dict[str, int] = {}
    out = set()
    for line in prose:
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


# -- what exists -------------------------------------------------------------------------------------

@lru_cache(maxsize=None)
def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def options(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {opt: a for a in parser._actions for opt in a.option_strings}


@lru_cache(maxsize=None)
def script_flags(path: Path) -> frozenset[str]:
    """The option strings of every ``add_argument`` call in a script (its argparse, read, not run)."""
    flags = {"-h", "--help"}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            flags.update(a.value for a in node.args
                         if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-"))
    return frozenset(flags)


@lru_cache(maxsize=None)
def job_subcommand(path: Path) -> str | None:
    """The ``dice-ray`` subcommand a ``jobs/*.py`` entry point runs: ``main(["train", *sys.argv[1:]])``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "main" and node.args
                and isinstance(node.args[0], ast.List) and node.args[0].elts
                and isinstance(node.args[0].elts[0], ast.Constant)):
            return node.args[0].elts[0].value
    return None


@lru_cache(maxsize=None)
def all_flags() -> frozenset[str]:
    flags = {"-h", "--help"}
    for sub in subparsers().values():
        flags.update(options(sub))
    for script in (REPO / "benchmarks").glob("*.py"):
        flags.update(script_flags(script))
    return frozenset(flags)


def config_sections() -> dict[str, type[BaseModel]]:
    return {name: f.annotation for name, f in DiceConfig.model_fields.items()
            if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel)}


def config_key_problem(key: str) -> str | None:
    """None when ``key`` (``section.name``, ``section.*``, ``section.prefix_*`` or a top-level name) is a
    config field, else what is wrong."""
    sections = config_sections()
    if "." not in key:
        if key in DiceConfig.model_fields and key not in sections:
            return None
        return f"config key {key!r} is not a top-level key"
    section, name = key.split(".", 1)
    if section not in sections:
        return f"config section {section!r} does not exist ({key})"
    fields = sections[section].model_fields
    if name == "*" or name in fields or (name.endswith("*") and any(f.startswith(name[:-1]) for f in fields)):
        return None
    return f"config key {key!r} does not exist"


# -- the checks of one command line ------------------------------------------------------------------

OVERRIDE = re.compile(r"^([a-z_]+(?:\.[a-z_]+)?)=")


def placeholder(token: str) -> bool:
    return any(c in token for c in "<$*") or "..." in token or bool(re.fullmatch(r"[A-Z][A-Z0-9_:./]*", token))


def tokens_of(segment: str) -> list[str]:
    try:
        raw = shlex.split(segment, comments=False)
    except ValueError:  # an unbalanced quote in a span: plain words will do
        raw = segment.split()
    return [t.strip("[]()") for t in raw if t.strip("[]()")]


def segments(line: str) -> list[str]:
    """Shell commands of a line: comments dropped, split at ``&&``, ``||``, ``;`` and pipes between spaces
    (``status|scale`` is an alternation, not a pipe)."""
    line = re.sub(r"(^|\s)#.*$", "", line)
    return [s for s in re.split(r"\s(?:&&|\|\||\||;)\s|;$", line) if s.strip()]


def check_cli(args: list[str], where: str) -> list[str]:
    """Problems of ``dice-ray ARGS``."""
    if not args:
        return []  # the program's name alone
    subs = subparsers()
    name = args[0]
    if name in ("-h", "--help"):
        return []
    if name not in subs:
        return [f"{where}: `dice-ray {name}` is not a subcommand ({', '.join(subs)})"]
    sub = subs[name]
    opts = options(sub)
    positional = [a for a in sub._actions if not a.option_strings and a.dest not in ("help",)]
    problems = []
    first_positional = True
    i = 1
    while i < len(args):
        tok = args[i]
        if tok.startswith("-") and not re.fullmatch(r"-?\d+(\.\d+)?", tok):
            flag = tok.split("=", 1)[0]
            if flag not in opts and flag not in ("-h", "--help"):
                problems.append(f"{where}: `dice-ray {name}` has no flag {flag}")
            action = opts.get(flag)
            if action is not None and action.choices and "=" not in tok and i + 1 < len(args):
                value = args[i + 1]
                if not value.startswith("-") and not placeholder(value):
                    bad = [v for v in value.split("|") if v not in action.choices]
                    if bad:
                        problems.append(f"{where}: `dice-ray {name} {flag}` takes {list(action.choices)}, not {bad}")
                    i += 1
        elif tok == "key=value":  # the placeholder of any override
            pass
        elif OVERRIDE.match(tok):
            problem = config_key_problem(OVERRIDE.match(tok).group(1))
            if problem:
                problems.append(f"{where}: {problem}")
        elif first_positional and positional and positional[0].choices and not placeholder(tok):
            first_positional = False
            bad = [v for v in tok.split("|") if v not in positional[0].choices]
            if bad:
                problems.append(f"{where}: `dice-ray {name}` takes {list(positional[0].choices)}, not {bad}")
        else:
            first_positional = False
        i += 1
    return problems


def check_command_line(line: str, where: str) -> list[str]:
    problems = []
    for segment in segments(line):
        toks = tokens_of(segment)
        for i, tok in enumerate(toks):
            if tok == "dice-ray":
                problems += check_cli(toks[i + 1:], where)
                break
            if Path(tok).name in PYTHONS and toks[i + 1:i + 3] == ["-m", "dice_ray.cli"]:
                problems += check_cli(toks[i + 3:], where)
                break
            name = toks[i + 1] if i + 1 < len(toks) else ""
            if Path(tok).name in PYTHONS and re.fullmatch(r"(benchmarks|jobs)/[\w-]+\.py", name):
                script = REPO / name
                if not script.is_file():
                    problems.append(f"{where}: {name} does not exist")
                elif name.startswith("jobs/"):
                    sub = job_subcommand(script)
                    problems += check_cli([sub, *toks[i + 2:]], where) if sub else [f"{where}: {name} runs no subcommand"]
                else:
                    flags = script_flags(script)
                    problems += [f"{where}: {name} has no flag {t.split('=', 1)[0]}" for t in toks[i + 2:]
                                 if t.startswith("--") and t.split("=", 1)[0] not in flags]
                break
    return problems


# -- the tests ---------------------------------------------------------------------------------------

def page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def test_readme_is_short_and_the_pages_exist():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail into docs/"
    missing = [p for p in REQUIRED_PAGES if not (DOCS / f"{p}.md").is_file()]
    assert not missing, f"docs pages missing: {missing}"
    assert not (DOCS / f"{OLD_LOG}.md").exists(), "the benchmarks page replaced the measurement log"


def test_nothing_names_the_old_measurement_log():
    named = []
    for folder in ("dice_ray", "tests", "benchmarks", "jobs", "configs", "docs", ".ci"):
        for path in (REPO / folder).rglob("*"):
            text = path.is_file() and path.suffix in (".py", ".md", ".yaml", ".yml", ".txt", "")
            if text and OLD_LOG in path.read_text(errors="ignore"):
                named.append(str(path.relative_to(REPO)))
    named += [name for name in ("README.md", "pyproject.toml", "cluster.yaml") if OLD_LOG in (REPO / name).read_text()]
    assert not named, f"{OLD_LOG}.md is gone (docs/benchmarks.md replaced it); still named in {named}"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_links_resolve(page):
    prose, _ = split_page(page.read_text())
    problems = []
    text = "\n".join(SPAN.sub("", line) for line in prose)  # a link's text may wrap onto the next line
    for m in LINK.finditer(text):
        target = m.group(2)
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"[{m.group(1)}]({target}): {path} does not exist")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            problems.append(f"[{m.group(1)}]({target}): no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not problems, f"{page_id(page)}:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_commands_and_flags_exist(page):
    problems = []
    for line in command_lines(page):
        problems += check_command_line(line, page_id(page))
        if line.startswith("--"):  # a flag named on its own: some command of the project (or a tool) has it
            flag = line.split()[0].split("=", 1)[0]
            if flag not in all_flags() and flag not in EXTERNAL_FLAGS:
                problems.append(f"{page_id(page)}: no command defines {flag} (`{line}`)")
    assert not problems, "\n".join(problems)


CONFIG_KEY = re.compile(r"(?<![\w./$-])([a-z]+)\.([a-z_]+\*?|\*)(?![\w(])")


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_config_keys_exist(page):
    sections = config_sections()
    problems = []
    for line in command_lines(page):
        if "unknown key" in line:  # a quoted error message, about a key that does not exist
            continue
        for m in CONFIG_KEY.finditer(line):
            section, name = m.groups()
            if section in sections and name not in FILE_SUFFIXES:
                problem = config_key_problem(f"{section}.{name}")
                if problem:
                    problems.append(f"{page_id(page)}: {problem} (`{line}`)")
    assert not problems, "\n".join(problems)


PATH = re.compile(r"(?<![\w./~-])((?:%s)/[\w./-]*)" % "|".join(PATH_PREFIXES))


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_paths_exist_and_modules_are_named_only_by_package(page):
    text = page.read_text()
    problems = []
    for m in PATH.finditer(text):
        path = m.group(1).rstrip(".,;:")
        if placeholder(path) or "NNN" in path:
            continue
        if not (REPO / path).exists():
            problems.append(f"{path} does not exist")
        if path.startswith("dice_ray/") and not path.startswith("dice_ray/tasks/builtin/"):
            rest = path[len("dice_ray/"):]
            package_level = re.fullmatch(r"\w+/|\w+\.py", rest)
            if page != ARCHITECTURE:
                problems.append(f"{path}: module paths belong in docs/architecture.md (name a command, key or flag)")
            elif not package_level:
                problems.append(f"{path}: name packages (dice_ray/verify/), not files inside them")
    for m in re.finditer(r"(?<![\w/])dice_ray(?:\.\w+)+", text):
        name = m.group(0)
        if name in PUBLIC_MODULES:
            continue
        if page != ARCHITECTURE or name.count(".") > 1:
            problems.append(f"{name}: internal module names belong in docs/architecture.md, at package level")
    assert not problems, f"{page_id(page)}:\n" + "\n".join(problems)
