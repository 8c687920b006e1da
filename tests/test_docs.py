"""README.md stays a user's page and the docs stay whole: the README within its byte budget, every
relative link of README.md and docs/*.md to a file (and heading) of the repository, no path outside;
every module named in the README's layout and readable in one sitting (at most 800 code lines).

    .venv/bin/python -m pytest tests/test_docs.py -q
"""

import ast
import glob
import io
import os
import re
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_BUDGET = 20_000  # bytes: nanoGPT's README is 13.9 KB, nanochat's 16.6 KB
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"\.\./shared|/work/")
MODULE_LINES = 800  # code lines: not blank, not a comment, not a docstring


def pages():
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def anchors(path):
    """GitHub's heading anchors of a Markdown file: lower case, punctuation dropped, spaces to
    hyphens."""
    with open(path) as f:
        heads = [line.lstrip("#").strip() for line in f if re.match(r"#{1,6} ", line)]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in heads}


def broken_links(path, text):
    """The relative links of `text` (a page at `path`) that name no file of the repository, or no
    heading of it."""
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
        inside = dest.startswith(ROOT + os.sep)
        if not inside or not os.path.exists(dest):
            broken.append(target)
        elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
            broken.append(target)
    return broken


def test_readme_within_budget():
    size = os.path.getsize(os.path.join(ROOT, "README.md"))
    assert size <= README_BUDGET, f"README.md: {size:,} bytes of {README_BUDGET:,}; depth: docs/"


def test_links_resolve_inside_the_repository():
    readme = os.path.join(ROOT, "README.md")
    # the checker itself: a missing file, a missing heading, a path out of the repository are caught
    text = "[a](docs/nope.md) [b](#no-such-heading) [c](../README.md) [d](https://x.org)"
    assert broken_links(readme, text) == ["docs/nope.md", "#no-such-heading", "../README.md"]
    for path in pages():
        with open(path) as f:
            assert broken_links(path, f.read()) == [], path
    assert len(pages()) > 1, "docs/*.md pages are missing"


def test_no_path_outside_the_repository():
    for path in pages():
        with open(path) as f:
            hits = [line for line in f if OUTSIDE.search(line)]
        assert hits == [], (path, hits)


def code_lines(src):
    """The lines of Python source `src` that hold code: blank lines, comments and docstrings (of the
    module, its classes and functions) do not count."""
    docstrings = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body \
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            docstrings.update(range(body[0].lineno, body[0].end_lineno + 1))
    lines = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
            tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in skip:
            lines.update(range(tok.start[0], tok.end[0] + 1))
    return len(lines - docstrings)


def test_every_module_in_the_layout_and_within_800_code_lines():
    # the counter itself: a docstring, a comment and blank lines are not code; a string value is
    src = 'def f():\n    """doc\n    more"""\n\n    # note\n    x = """a\nb"""\n    return x\n'
    assert code_lines(src) == 4
    with open(os.path.join(ROOT, "README.md")) as f:
        layout = f.read().split("## Layout", 1)[1].split("```")[1]
    listed = {name for line in layout.splitlines() for name in line.split("  ")[0].split()}
    modules = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))
    assert [m for m in modules if m not in listed] == [], "modules missing from the README's layout"
    sizes = {}
    for path in glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, "*", "*.py")):
        with open(path) as f:
            sizes[os.path.relpath(path, ROOT)] = code_lines(f.read())
    assert "capture.py" in sizes and "tests/test_docs.py" in sizes and "agents/calculator.py" in sizes
    assert {m: n for m, n in sizes.items() if n > MODULE_LINES} == {}, sizes
