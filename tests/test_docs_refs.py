"""Every reference in the repository resolves: each ``docs/*.md`` path the code, tests and
docs cite exists, so does every repository path the docs and the README name, relative
links between the docs point at files, each failure-case id
(``C01`` ..) cited anywhere is defined in docs/failure-cases.md, and the tests that page
names exist. Nothing points outside the repository (no path into the sibling ``shared``
folder that users never have)."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
CASES = DOCS / "failure-cases.md"

# What is scanned: the tracked top-level entries, text files only.
ROOTS = (".ci", "benchmarks", "charts", "crds", "docker", "docs", "e2e", "scripts", "src", "tests",
         "Makefile", "README.md", "pyproject.toml")
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".toml", ".json", ".sh", ".txt", ".tpl", ".cfg",
                 ".Dockerfile", ".dockerignore", ".helmignore", ""}
SKIP_DIRS = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis", "results"}

# Paths that look like ours but are another project's, cited as sources (none: another
# project's document is cited by its full URL, which DOC_PATH does not match).
UPSTREAM_DOCS: set[str] = set()

DOC_PATH = re.compile(r"(?<![\w./-])docs/[\w./-]+?\.md\b")
REPO_PATH = re.compile(r"(?<![\w./-])(?:benchmarks|charts|crds|docker|e2e|scripts|src|tests)/[\w./-]*\w")
MD_LINK = re.compile(r"\]\(([^)#\s:]+\.md)(?:#[^)]*)?\)")
CASE_ID = re.compile(r"\bC\d\d\b")
CASE_ROW = re.compile(r"^\| (C\d\d) \|(.*)$", re.MULTILINE)
TEST_REF = re.compile(r"`((?:tests|e2e)/[\w./-]+\.py)(?:::(\w+))?`")
ISSUE_CITATION = re.compile(r"\bissues? #?\d+", re.IGNORECASE)


@cache
def repo_files() -> tuple[Path, ...]:
    out: list[Path] = []
    for name in ROOTS:
        root = REPO / name
        if root.is_file():
            out.append(root)
            continue
        for path in sorted(root.rglob("*")):
            if path.is_file() and path.suffix in TEXT_SUFFIXES and not SKIP_DIRS & set(path.parts):
                out.append(path)
    return tuple(out)


def read(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def occurrences(pattern: re.Pattern[str]) -> dict[str, list[str]]:
    """match -> the files (relative) it occurs in."""
    found: dict[str, list[str]] = {}
    for path in repo_files():
        if path == Path(__file__).resolve():
            continue
        for match in pattern.findall(read(path)):
            found.setdefault(match, []).append(str(path.relative_to(REPO)))
    return found


def defined_cases() -> dict[str, str]:
    return {case: row for case, row in CASE_ROW.findall(read(CASES))}


def test_every_cited_docs_path_exists():
    missing = {path: files for path, files in occurrences(DOC_PATH).items()
               if path not in UPSTREAM_DOCS and not (REPO / path).is_file()}
    assert not missing, f"cited but not in the repository: {missing}"


def test_repository_paths_in_the_docs_exist():
    missing = []
    for page in [*DOCS.glob("*.md"), REPO / "README.md"]:
        for path in REPO_PATH.findall(read(page)):
            if not (REPO / path).exists():
                missing.append(f"{page.relative_to(REPO)} -> {path}")
    assert not missing, f"named in the docs but not in the repository: {missing}"


def test_relative_links_between_docs_resolve():
    broken = []
    for page in [*DOCS.glob("*.md"), REPO / "README.md"]:
        for target in MD_LINK.findall(read(page)):
            if not (page.parent / target).is_file():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, f"broken links: {broken}"


def test_nothing_points_outside_the_repository():
    # Built from parts, so that this test does not name the path it looks for.
    outside = occurrences(re.compile(r"\.\./" + "shared" + r"\b"))
    assert not outside, f"references outside the repository: {outside}"


def test_every_cited_case_id_is_defined():
    defined = defined_cases()
    assert defined, f"no case rows found in {CASES}"
    undefined = {case: files for case, files in occurrences(CASE_ID).items() if case not in defined}
    assert not undefined, f"case ids cited but not defined in docs/failure-cases.md: {undefined}"


def test_every_case_names_tests_that_exist():
    problems = []
    for case, row in defined_cases().items():
        refs = TEST_REF.findall(row)
        if not refs:
            problems.append(f"{case}: names no test")
        for file, name in refs:
            path = REPO / file
            if not path.is_file():
                problems.append(f"{case}: {file} does not exist")
            elif name and not re.search(rf"^\s*(async )?def {name}\(", read(path), re.MULTILINE):
                problems.append(f"{case}: {file} has no test {name}")
    assert not problems, problems


def test_comments_name_behaviour_not_issue_numbers():
    """Issue numbers mean nothing to a reader of the repository: name the behaviour."""
    cited = occurrences(ISSUE_CITATION)
    assert not cited, f"cite the behaviour instead of the issue: {cited}"
