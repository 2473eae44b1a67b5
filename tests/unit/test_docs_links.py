"""The README stays a front page, and no relative link in it or in the docs points at nothing.

The docs site's own build (`mkdocs build --strict`, in CI) checks the links between pages and the API
reference; this test needs no docs tools, so the plain test suite catches a page or file that moved.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# [text](target) and [text](target "title"); images too. Reference-style links are not used here.
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"(?ms)^(`{3,}|~{3,})[^\n]*\n.*?^\1[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _relative_links(page: Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith(("#", "/")):
            continue  # a URL (https:, mailto:), an anchor on the same page, or a site-absolute path
        targets.append(target)
    return targets


def test_the_readme_stays_a_front_page() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 210, f"README.md has {len(lines)} lines: move the detail into docs/"


def test_the_docs_exist() -> None:
    assert (ROOT / "mkdocs.yml").is_file()
    assert (DOCS / "index.md").is_file()
    assert len(list(DOCS.rglob("*.md"))) >= 10


def test_every_relative_link_points_at_a_file() -> None:
    broken = []
    for page in _pages():
        for target in _relative_links(page):
            path = unquote(target.split("#", 1)[0].split("?", 1)[0])
            if path and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, "links to files that do not exist:\n" + "\n".join(broken)


# Paths the pages name in code (`p2ptrain/net/handshake.py`, `configs/tiny-gpt.toml`), and the modules of
# the commands they show (`python -m simulations.bench_bytes`): a file that moved leaves no dead name.
REPO_PATH = re.compile(r"`((?:p2ptrain|tests|configs|simulations|deploy|examples|docs)/[^`\s*]*)`")
MODULE = re.compile(r"python -m ((?:simulations|p2ptrain)(?:\.[a-z_0-9]+)*)")


def test_every_named_file_and_module_exists() -> None:
    missing = []
    for page in _pages():
        text = page.read_text()
        for path in REPO_PATH.findall(text):
            if not (ROOT / path).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
        for module in set(MODULE.findall(text)):
            base = ROOT.joinpath(*module.split("."))
            if not (base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()):
                missing.append(f"{page.relative_to(ROOT)}: python -m {module}")
    assert not missing, "names of files or modules that do not exist:\n" + "\n".join(missing)


def test_the_link_check_sees_links() -> None:
    # A pattern that silently matched nothing would pass every check above.
    assert "docs/quickstart.md" in _relative_links(README)
    assert "`x`" not in _relative_links(README)


def test_the_readme_example_is_python() -> None:
    text = README.read_text()
    blocks = re.findall(r"(?ms)^```python\n(.*?)^```", text)
    assert blocks, "README.md: no python example"
    for block in blocks:
        ast.parse(block)
