"""The docs: a site that builds with every link resolved, and a README that stays a front door."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_LINES = 300


def test_the_docs_site_builds_strict(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "site" / "learning" / "index.html").exists()


def test_the_readme_is_short_and_its_links_exist() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target


def test_no_issue_numbers_in_the_docs() -> None:
    pages = [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs").glob("*.md"))]
    for page in pages:
        assert not re.search(r"\bissue \d+|\bissues? #\d+", page.read_text(), re.IGNORECASE), page.name


def test_the_results_folder_holds_what_the_results_page_cites_and_no_more() -> None:
    """Every JSON or PNG named on the results page exists; every file kept there is named (history lives in git)."""
    page = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    kept = {p.name for p in (ROOT / "benchmarks" / "results").iterdir() if p.suffix in {".json", ".png"}}
    cited = set(re.findall(r"[`/]([\w.-]+\.(?:json|png))\b", page))
    assert kept <= cited, f"uncited: {sorted(kept - cited)}"
    assert cited <= kept, f"named on the page, not in benchmarks/results/: {sorted(cited - kept)}"
