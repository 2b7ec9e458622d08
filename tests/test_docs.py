"""The documentation as a newcomer meets it: README.md is a short front door that starts with the
set-up commands, every relative link in README.md and docs/ resolves (file and #anchor), every
`python scripts/...` and `megatrain ...` command they show parses, every config key and every
module of the package is on its page, the tracked tree speaks only of the project itself, and no
comment or docstring of the package states a measured rate or time (docs/benchmarks.md holds
them)."""

import ast
import io
import json
import os
import re
import shlex
import subprocess
import sys
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = "README.md"
README_MAX_LINES = 250
SETUP = ['pip install -e ".[test]"', "python -m pytest -q",
         "python scripts/train.py --config configs/tiny.yaml"]


def read(rel: str) -> str:
    with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
        return f.read()


def markdown_files() -> list:
    """README.md and every page under docs/ (docs/results/ too), as paths from the root."""
    out = [README]
    for base, _, files in os.walk(os.path.join(ROOT, "docs")):
        out += sorted(os.path.relpath(os.path.join(base, f), ROOT) for f in files
                      if f.endswith(".md"))
    return out


def blocks(text: str):
    """(kind, language, lines) of a markdown text: kind "code" for a fenced or indented code
    block (indented: four spaces after a blank line, outside a list), "prose" for the rest."""
    prose, lines = [], text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        fence = re.match(r"^(\s*)(```+)\s*(\S*)", line)
        if fence:
            indent, ticks, language = fence.groups()
            body, i = [], i + 1
            while i < len(lines) and not lines[i].strip().startswith(ticks):
                body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
                i += 1
            yield "prose", "", prose
            prose = []
            yield "code", language, body
        elif line.startswith("    ") and (not prose or not prose[-1].strip()) and \
                not any(p.lstrip().startswith(("- ", "* ", "1.")) for p in prose[-3:]):
            body = []
            while i < len(lines) and (lines[i].startswith("    ") or not lines[i].strip()):
                body.append(lines[i][4:])
                i += 1
            i -= 1
            yield "prose", "", prose
            prose = []
            yield "code", "", body
        else:
            prose.append(line)
        i += 1
    yield "prose", "", prose


def prose(text: str) -> str:
    return "\n".join(line for kind, _, lines in blocks(text) if kind == "prose" for line in lines)


# ----------------------------------------------------------------------------- README

def test_readme_is_a_short_front_door_that_starts_with_the_setup_commands():
    text = read(README)
    assert len(text.splitlines()) <= README_MAX_LINES
    first = next(lines for kind, _, lines in blocks(text) if kind == "code")
    commands = [line.split("#")[0].strip() for line in first if line.strip()]
    assert commands == SETUP


# ----------------------------------------------------------------------------- links

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(text: str) -> set:
    seen, out = {}, set()
    for line in prose(text).split("\n"):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(text: str) -> list:
    """The targets of the markdown links and images of a text's prose (not in code)."""
    body = re.sub(r"`[^`]*`", "", prose(text))
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", body)


def test_the_link_checker_sees_broken_files_and_anchors(tmp_path):
    """The checks below can fail: a missing file, a missing anchor, a heading in code."""
    text = "# A title\n\n## Step 2: the `plan`\n\n```\n# not a heading\n```\nsee [x](#step-2-the-plan)"
    assert anchors(text) == {"a-title", "step-2-the-plan"}
    assert links(text + " and `[y](nowhere.md)` [z](other.md#not-here)") == [
        "#step-2-the-plan", "other.md#not-here"]


@pytest.mark.parametrize("page", markdown_files())
def test_every_relative_link_resolves(page):
    text = read(page)
    broken = []
    for target in links(text):
        if re.match(r"^[a-z]+:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        full = os.path.join(ROOT, resolved)
        if not os.path.exists(full):
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.endswith(".md") and anchor not in anchors(read(resolved)):
            broken.append(f"{target}: no heading #{anchor} in {resolved}")
    assert broken == []


# ----------------------------------------------------------------------------- commands

SHOWN = re.compile(r"^(?:[A-Z_]+=\S*\s+)*(?:time\s+)?"
                   r"(?:python3?\s+scripts/\w+\.py(?:\s|$)|(?:python3?\s+-m\s+megatrain_jax|megatrain)\s+\S)")
NAME_ONLY = re.compile(r"^(?:python3?\s+-m\s+megatrain_jax|megatrain)\s+[a-z]+$")


def command_lines(text: str) -> list:
    """Every command a page shows: lines of its code blocks (continuations joined) and inline
    code spans of its prose that start with `python scripts/...`, `python -m megatrain_jax ...` or
    `megatrain ...` (after environment assignments), each with the block's variables. In prose,
    a command's name alone (`megatrain plot`) and a synopsis ending in `...` are not commands."""
    out = []
    for kind, language, lines in blocks(text):
        if kind == "code" and language in ("", "bash", "sh", "shell", "console"):
            variables = {}
            for line in "\n".join(lines).replace("\\\n", " ").split("\n"):
                line = line.strip()
                assignment = re.fullmatch(r"([A-Z_]+)=(\S+)", line)
                if assignment:
                    variables[assignment.group(1)] = assignment.group(2)
                elif SHOWN.match(line):
                    out.append((line, dict(variables)))
        elif kind == "prose":
            for span in re.findall(r"`([^`]+)`", re.sub(r"\s*\n\s*", " ", "\n".join(lines))):
                if SHOWN.match(span) and not NAME_ONLY.match(span) and \
                        not span.rstrip().endswith("..."):
                    out.append((span, {}))
    return out


def argv_of(line: str, variables: dict) -> list:
    """A shown command as the argv a shell would run: comments dropped, $VARIABLES from its block
    (others 0), environment assignments and `time` dropped, optional [groups] and `...` left out."""
    line = re.sub(r"\$\{?([A-Z_]+)\}?", lambda m: variables.get(m.group(1), "0"), line)
    words = shlex.split(line, comments=True)
    while words and (re.fullmatch(r"[A-Z_]+=.*", words[0]) or words[0] == "time"):
        words.pop(0)
    argv, depth = [], 0
    for word in words:
        depth += word.startswith("[")
        if depth == 0 and word not in ("...", "…"):
            argv.append(word)
        depth -= depth > 0 and word.endswith("]")
    return argv


def shown_commands() -> list:
    """Every distinct command shown in README.md and docs/, as (argv, the page showing it)."""
    seen = {}
    for page in markdown_files():
        for line, variables in command_lines(read(page)):
            argv = argv_of(line, variables)
            seen.setdefault(tuple(argv), page)
    return [(list(argv), page) for argv, page in seen.items()]


# Runs each command in this one process up to its argument parsing, and no further: argparse's
# parse_args stops there (an unknown argument is the parser's error, as when it runs), and the
# config overrides a command takes are resolved by load_config (a key or value that would be
# refused is an error here; model.from_hf names a directory that need not exist).
DRIVER = r"""
import argparse, contextlib, io, json, os, runpy, sys
from megatrain_jax.config import load_config

class Parsed(BaseException):
    pass

known = argparse.ArgumentParser.parse_known_args

def parse_known_args(self, args=None, namespace=None):
    ns, extras = known(self, args, namespace)
    raise Parsed(ns, extras)

def parse_args(self, args=None, namespace=None):
    ns, extras = known(self, args, namespace)
    if extras:
        self.error("unrecognized arguments: " + " ".join(extras))
    raise Parsed(ns, [])

def exit_now(code):  # the scripts end with os._exit after an error: keep this process
    raise SystemExit(code)

argparse.ArgumentParser.parse_known_args = parse_known_args
argparse.ArgumentParser.parse_args = parse_args
os._exit = exit_now
results = []
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    sys.argv = list(argv)
    outcome = "did not parse its arguments"
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            if argv[0] == "megatrain":
                runpy.run_module("megatrain_jax", run_name="__main__")
            else:
                runpy.run_path(argv[0], run_name="__main__")
    except Parsed as p:
        ns, extras = p.args
        overrides = list(getattr(ns, "overrides", None) or []) + [e for e in extras if "=" in e]
        overrides = [o for o in overrides if not o.startswith("model.from_hf=")]
        try:
            if overrides or getattr(ns, "config", None):
                load_config(getattr(ns, "config", None), overrides)
            outcome = None
        except Exception as e:
            outcome = f"config: {e}"
    except SystemExit as e:
        outcome = None if e.code in (0, None) else f"exit {e.code}: {err.getvalue().strip()[-300:]}"
    except Exception as e:
        outcome = f"{type(e).__name__}: {e}"
    results.append(outcome)
print(json.dumps(results))
"""


def normalised(argv: list) -> list:
    """python scripts/x.py ... -> [scripts/x.py, ...]; python -m megatrain_jax / megatrain ->
    [megatrain, ...]."""
    if argv[0] == "megatrain":
        return argv
    if argv[1] == "-m":
        return ["megatrain", *argv[3:]]
    return argv[1:]


def parse_all(argvs: list) -> list:
    env = dict(os.environ, PYTHONPATH=ROOT, MEGATRAIN_HUGE_PAGES="0", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps(argvs), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_command_finder_reads_blocks_spans_and_placeholders():
    text = ("Run `python scripts/plot.py RUN_DIR [RUN_DIR ...] [--out PNG]` or `megatrain --help`,\n"
            "not `megatrain plot` (a name) nor `megatrain generate ...` (a synopsis).\n"
            "\n```bash\nMODEL=models/m\npython scripts/train.py model.from_hf=$MODEL \\\n"
            "    train.steps=2   # a comment\nls runs\n```\n\n    PYTHONPATH=. python scripts/plan.py --json F\n")
    found = [argv_of(line, v) for line, v in command_lines(text)]
    assert found == [["python", "scripts/plot.py", "RUN_DIR"], ["megatrain", "--help"],
                     ["python", "scripts/train.py", "model.from_hf=models/m", "train.steps=2"],
                     ["python", "scripts/plan.py", "--json", "F"]]


def test_a_command_that_would_not_parse_fails_here():
    """The driver can fail: an unknown option, an unknown config key, a bad value."""
    bad = [["python", "scripts/train.py", "--nope"],
           ["python", "scripts/train.py", "--config", "configs/tiny.yaml", "train.stepz=3"],
           ["python", "scripts/plan.py", "--config", "configs/tiny.yaml", "train.steps=many"],
           ["megatrain", "trian"],
           ["python", "scripts/train.py", "--config", "configs/tiny.yaml"]]
    outcomes = parse_all([normalised(a) for a in bad])
    assert all(outcomes[:4]) and outcomes[4] is None, outcomes


def test_every_shown_command_parses():
    commands = shown_commands()
    scripts = {argv[1] for argv, _ in commands if argv[0] != "megatrain" and argv[1] != "-m"}
    assert {"scripts/train.py", "scripts/plan.py", "scripts/generate.py",
            "scripts/gpu_checklist.py"} <= scripts  # the finder found the pages' commands
    outcomes = parse_all([normalised(argv) for argv, _ in commands])
    failed = {f"{page}: {' '.join(argv)}": why
              for (argv, page), why in zip(commands, outcomes) if why}
    assert failed == {}


# ----------------------------------------------------------------------------- pages that list

def config_keys() -> list:
    """Every key of the config as `section.key` (and run_dir), the disk tier's included."""
    from megatrain_jax.config import load_config, to_dict

    keys = []
    for section, values in to_dict(load_config(None, ["offload.tier=disk",
                                                      "offload.path=/tmp/x"])).items():
        keys += [f"{section}.{k}" for k in values] if isinstance(values, dict) else [section]
    return keys


def test_every_config_key_is_in_docs_config():
    text = read("docs/config.md")
    named = set(re.findall(r"`([a-z_]+(?:\.[a-z_0-9]+)?)`", text))
    for cell in re.findall(r"^\| `([a-z_]+)\.([a-z_0-9]+)` ((?:/ `[a-z_0-9]+` )*)\|", text, re.M):
        section, first, rest = cell
        named |= {f"{section}.{k}" for k in [first, *re.findall(r"`([a-z_0-9]+)`", rest)]}
    assert [k for k in config_keys() if k not in named] == []


def package_modules() -> list:
    """Every module file of the package, as a path under megatrain_jax/."""
    package = os.path.join(ROOT, "megatrain_jax")
    return sorted(os.path.relpath(os.path.join(base, f), package)
                  for base, _, files in os.walk(package) for f in files if f.endswith(".py"))


def test_every_module_is_in_docs_architecture_tables():
    rows = [line for line in read("docs/architecture.md").splitlines() if line.startswith("| `")]
    listed = {name for row in rows for name in re.findall(r"`([\w/]+\.py)`", row.split("|")[1])}
    assert "engine/step.py" in listed and "config.py" in listed
    assert [m for m in package_modules() if m not in listed] == []


def test_the_engines_module_map_lists_every_module_of_the_engine():
    """megatrain_jax/engine/__init__.py's docstring maps the engine's modules by concern: each
    one is there (a line of the map starts with its name)."""
    source = read("megatrain_jax/engine/__init__.py")
    mapped = set(re.findall(r"^  (\w+\.py) ", ast.get_docstring(ast.parse(source)), re.M))
    assert {"streamed.py", "step.py"} <= mapped
    engine = os.path.join(ROOT, "megatrain_jax", "engine")
    modules = {f for f in os.listdir(engine) if f.endswith(".py") and f != "__init__.py"}
    assert sorted(modules - mapped) == []


# a docstring or comment's pointer to a section: docs/page.md, "Heading" (the two may be split
# over lines, a comment's "#" between them)
SECTION_REF = re.compile(r'docs/([\w-]+\.md),?\s*(?:#\s*)?"([^"\n]+)"')


def headings(page: str) -> set:
    return {line.lstrip("#").strip() for line in read(f"docs/{page}").splitlines()
            if line.startswith("#")}


def test_the_section_finder_reads_split_pointers():
    text = 'x (docs/a.md, "One")\n# see docs/b.md,\n#   "Two": y\ndocs/c.md "Three"'
    assert SECTION_REF.findall(text) == [("a.md", "One"), ("b.md", "Two"), ("c.md", "Three")]


def test_every_pointer_to_a_docs_section_names_one():
    """The code's pointers to a section of the docs (`docs/page.md, "Heading"`) name a heading
    that page has (engine/direct.py sent its reader to an architecture.md section that had
    gone)."""
    files = [os.path.join(base, f) for top in ("megatrain_jax", "scripts")
             for base, _, names in os.walk(os.path.join(ROOT, top)) for f in names
             if f.endswith(".py")]
    found = [(os.path.relpath(f, ROOT), page, heading) for f in sorted(files)
             for page, heading in SECTION_REF.findall(open(f).read())]
    assert len(found) > 5
    assert [ref for ref in found if ref[2] not in headings(ref[1])] == []


# ----------------------------------------------------------------------------- the tree

# How the project's own work was organised, the tools it was written with, or the machine it was
# written on: none of it belongs in the project. The words are spelled in pieces so that this file
# passes its own check (and a plain grep of the tree); a code word that merely contains one (a
# subprocess flag, say) is kept out by the word boundaries.
WORDS = (r"\bsess" + r"ions?\b", r"\bdevice " + r"tool", r"\bdevice " + r"calls?\b",
         r"\bdevice_" + r"tool\b", r"can_start_" + r"another", r"\brun\(" + r"kind=",
         r"give_" + r"back\(", r"budget_" + r"left", r"KINDS\." + r"md", r"/wo" + r"rk/",
         r"\.lib" + r"rary\b", r"\bissues (?:show|note|resolved|blocked|unsay)\b")
ORGANISATIONAL = re.compile("|".join(WORDS), re.I)
SKIPPED = ("megatrain_jax/texts/",)


def tracked_text_files() -> list:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                           check=True).stdout.decode().split("\0")
    return [f for f in files if f and not f.startswith(SKIPPED)]


def test_the_wording_check_sees_what_it_should_and_not_code():
    for text in ("one part a Sess" + "ion", "the device" + " tool", 'run(ki' + 'nd="x")',
                 "see /wo" + "rk/main", "the .libr" + "ary folder", "issues " + "note 36"):
        assert ORGANISATIONAL.search(text), text
    for code in ("subprocess.Popen(cmd, start_new_sess" + "ion=True)", "self.new_sess" + "ion()",
                 "xdist.dsess" + "ion.Interrupted", "device, calls"):
        assert not ORGANISATIONAL.search(code), code


def test_the_tree_speaks_only_of_the_project():
    found = []
    for rel in tracked_text_files():
        path = os.path.join(ROOT, rel)
        if not os.path.isfile(path):  # deleted in the working tree
            continue
        with open(path, "rb") as f:
            data = f.read()
        if b"\0" in data[:8192]:  # binary
            continue
        for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            if ORGANISATIONAL.search(line):
                found.append(f"{rel}:{n}: {line.strip()[:100]}")
    assert found == []


# ----------------------------------------------------------------------------- code comments

# A throughput or time figure (a rate, a duration, "3x faster"): a measurement, whose place is
# docs/benchmarks.md with its command, machine and date. A comment or docstring of the package
# keeps the why and points there. Spans in backticks are examples of output or code, not claims.
FIGURE = re.compile(r"\d\s?(?:[KMGT]i?B/s|TFLOP/s|TFLOPS|tok(?:ens)?/s|params/s)"
                    r"|\d\s?(?:ns|us|µs|ms|s|sec|seconds?|min|minutes?)\b"
                    r"|\d(?:\.\d+)?\s?[x×] (?:faster|slower)|\d\s?% (?:faster|slower)", re.I)
# (module, the figure's words): a figure that is a parameter, not a measurement
NOT_MEASURED = {("engine/stream.py", "its 5 ms switch interval"): "Python's documented default"}


def stated_figures(source: str) -> list:
    """(line, text) of each comment or docstring line of a module's source that states a figure:
    comments, and strings that stand alone as a statement (docstrings), read with tokenize."""
    found, previous = [], tokenize.NEWLINE
    statement_start = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING)
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        text = None
        if token.type == tokenize.COMMENT:
            text = token.string
        elif token.type == tokenize.STRING and previous in statement_start:
            text = token.string
        if token.type not in (tokenize.NL, tokenize.COMMENT):
            previous = token.type
        if text is None:
            continue
        text = re.sub(r"`[^`]*`", lambda m: re.sub(r"[^\n]", " ", m.group()), text)
        for i, line in enumerate(text.split("\n")):
            if FIGURE.search(line):
                found.append((token.start[0] + i, line.strip()))
    return found


def test_the_figure_check_sees_comments_and_docstrings_not_code():
    source = ('"""Runs at ~1 GB/s on a GPU host."""\n'
              'X = 5  # 133 ms against 0.1 ms\n'
              'def f():\n'
              '    """Made 3x faster by donation; `608 ms` is an example of the line."""\n'
              '    return f"{x:.3g} GB/s, {t} ms", "2 s"\n'
              '# a 2 MiB alignment, 64 bytes a line, 8 B/param\n')
    assert [n for n, _ in stated_figures(source)] == [1, 2, 4]


def test_code_comments_state_no_measured_figures():
    package = os.path.join(ROOT, "megatrain_jax")
    found, allowed = [], set()
    for module in package_modules():
        with open(os.path.join(package, module), encoding="utf-8") as f:
            for n, line in stated_figures(f.read()):
                hits = [key for key in NOT_MEASURED
                        if key[0] == module and key[1] in line]
                allowed.update(hits)
                if not hits:
                    found.append(f"megatrain_jax/{module}:{n}: {line[:100]}")
    assert found == []
    assert allowed == set(NOT_MEASURED)  # an entry that no longer matches is dropped
