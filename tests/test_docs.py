"""The README is a front door and docs/ holds the rest: the README stays short, every
relative link and image in it and in docs/ resolves, assets/ holds only what a page shows,
and comments explain the code in the present tense instead of naming dates and the
machines figures were measured on (those belong in docs/benchmarks.md and commit bodies).

Model-free and fast: it reads files only.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
ASSETS = ROOT / "assets"
MAX_README_LINES = 250

# [text](target) and ![alt](target); the target ends at whitespace or ")"
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# assets/ files that no page links but a page names as what a command writes or reads
ASSET_NAME = re.compile(r"assets/([\w.\-]+)")

# Outside docs/ and tests/, no comment or docstring names a date, the machine a figure was
# measured on, or narrates history. Product strings (a datasheet's "H200 141 GB", a GPU
# in the UI) are neither comments nor docstrings, and "H200" alone is allowed: only "on
# a/the/this H200" as a place is not.
FORBIDDEN = {
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
    "a measurement machine": re.compile(
        r"\bEPYC\b|\bXeon\b|\b(?:2|two)-core\b|\b(?:this|the) VM\b"
        r"|\b(?:on|from) (?:a |an |the |this )?(?:lent )?(?:NVIDIA )?[HB][12]00\b",
        re.IGNORECASE),
    "history": re.compile(r"\bno longer\b|\bused to (?!\w+ (?:the|a|an|each|its)\b)"
                          r"|\bbefore the kernel\b|\bas of commit\b|\bone-off\b",
                          re.IGNORECASE),
}
SKIP_DIRS = {"docs", "tests", ".git", ".venv", "node_modules", "build", ".gpu"}


def markdown_pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def links(page: Path) -> list[str]:
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # code blocks are not links
    return LINK.findall(text)


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as -."""
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.DOTALL)
    return {re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
            for title in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


@pytest.mark.parametrize("page", markdown_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue  # http(s):, mailto:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)  # a heading that is not there
    assert not broken, f"{page.name}: links to missing files or headings: {broken}"


def test_docs_pages_exist():
    for name in ("serving", "endpoints", "hosting", "engine", "benchmarks", "gpu"):
        assert (DOCS / f"{name}.md").is_file(), f"docs/{name}.md is missing"


def test_serving_has_a_parameters_section():
    text = (DOCS / "serving.md").read_text(encoding="utf-8")
    assert re.search(r"^## Parameters$", text, re.MULTILINE)


def test_every_asset_is_shown_or_named():
    referenced: set[str] = set()
    for page in markdown_pages():
        for target in links(page):
            resolved = (page.parent / target.split("#", 1)[0]).resolve()
            if resolved.parent == ASSETS:
                referenced.add(resolved.name)
        referenced.update(ASSET_NAME.findall(page.read_text(encoding="utf-8")))
    unused = sorted(p.name for p in ASSETS.iterdir() if p.name not in referenced)
    assert not unused, f"assets/ files no README or docs/ page shows: {unused}"


def source_files() -> list[Path]:
    found = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in SKIP_DIRS or any(part.startswith(".") for part in rel.parts[:-1]):
            continue
        if path.is_file() and (path.suffix in {".py", ".cpp", ".h", ".sh"}
                               or path.name == "Makefile"):
            found.append(path)
    return sorted(found)


def python_comments(source: str) -> list[tuple[int, str]]:
    """(line, text) of every comment and every module, class and function docstring."""
    found = [(tok.start[0], tok.string)
             for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                found.append((body[0].lineno, body[0].value.value))
    return found


def other_comments(path: Path, source: str) -> list[tuple[int, str]]:
    """(line, text) of C++ `//` and `/* */` comments, or shell and Makefile `#` comments."""
    if path.suffix in {".cpp", ".h"}:
        pattern = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
    else:
        pattern = re.compile(r"(?:^|(?<=\s))#[^\n]*", re.MULTILINE)
    return [(source.count("\n", 0, m.start()) + 1, m.group()) for m in pattern.finditer(source)]


def test_comments_name_no_dates_machines_or_history():
    hits = []
    for path in source_files():
        source = path.read_text(encoding="utf-8")
        comments = (python_comments(source) if path.suffix == ".py"
                    else other_comments(path, source))
        for line, text in comments:
            for what, pattern in FORBIDDEN.items():
                if m := pattern.search(text):
                    hits.append(f"{path.relative_to(ROOT)}:{line}: {what}: {m.group()!r}")
    assert not hits, ("comments should explain why in the present tense; dates, machines "
                      "and history go to docs/benchmarks.md:\n" + "\n".join(hits))


def test_the_patterns_spare_product_strings():
    """The machine pattern catches a measurement place, not a datasheet entry."""
    machine = FORBIDDEN["a measurement machine"]
    assert machine.search("measured on the 2-core EPYC")
    assert machine.search("on a lent NVIDIA H200")
    assert not machine.search("Host link of HGX H100/H200/B200")
    assert not machine.search('HardwareProfile("h200", "H200 141 GB", ...)')
    history = FORBIDDEN["history"]
    assert history.search("a row's result no longer depends on it")
    assert not history.search("the value used to pad each row")
