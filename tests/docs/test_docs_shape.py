"""The docs stay references: short pages, and no code that cites archived runs."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MAX_DOC_LINES = 300
MAX_README_LINES = 150
# written by the code, not by hand: their length follows what they document
GENERATED = {"CONFIG.md", "REPLICATION.md"}
# a path into the archive of runs (docs/results/... or results/<folder>/...), not a word like
# "results/" in a sentence about a results folder the user names
ARCHIVE_CITATION = re.compile(r"(?:docs/results\b|(?<![\w./-])results/[\w.-]+-\d{4}-\d{2}-\d{2})")


@pytest.mark.parametrize("path", sorted(p for p in (REPO / "docs").glob("*.md") if p.name not in GENERATED),
                         ids=lambda p: p.name)
def test_hand_written_docs_are_short(path):
    lines = len(path.read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_DOC_LINES, f"{path.relative_to(REPO)}: {lines} lines, at most {MAX_DOC_LINES}"


def test_the_readme_is_short():
    lines = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= MAX_README_LINES, f"README.md: {lines} lines, at most {MAX_README_LINES}"


def test_the_package_cites_no_archived_runs():
    """Comments say why the code is as it is; the measurements that showed it live in results/."""
    cited = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for path in sorted((REPO / "iga_ds").rglob("*.py"))
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if ARCHIVE_CITATION.search(line)]
    assert not cited, "citations of archived runs in the package:\n" + "\n".join(cited)


def test_the_citation_pattern():
    assert ARCHIVE_CITATION.search("(docs/results/h200-2026-11-28-jacobi/)")
    assert ARCHIVE_CITATION.search("see results/h100-h200-2026-11-27-evening/README.md")
    assert not ARCHIVE_CITATION.search("help='results folder (the one `iga-ds report` reads)'")
    assert not ARCHIVE_CITATION.search('out / "results.json"; runs/x/results/cell.json')
