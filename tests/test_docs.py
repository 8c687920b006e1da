"""README.md stays a user's page and the docs stay whole: the README within its byte budget, every
relative link of README.md and docs/*.md to a file (and heading) of the repository, no path outside.

    .venv/bin/python -m pytest tests/test_docs.py -q
"""

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_BUDGET = 20_000  # bytes: nanoGPT's README is 13.9 KB, nanochat's 16.6 KB
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
OUTSIDE = re.compile(r"\.\./shared|/work/")


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
