"""The documentation: the reference pages build as a site, and the README stays a short tour.

`mkdocs build --strict` fails on any warning: a page under docs/ left out of `mkdocs.yml`'s nav, a link
to a page or an anchor that does not exist. The README is read on GitHub; its quick start and how to
write an environment come first.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 220
README_OPENING_LINES = 80  # the quick start's commands and "Write an environment" start within these


def test_the_docs_build_with_mkdocs_strict(tmp_path):
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True)
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    assert (tmp_path / "site" / "index.html").is_file()


def test_the_readme_is_short_and_opens_with_the_quick_start_and_an_environment():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; move reference material to docs/"
    quick_start = lines.index("## Quick start")
    first_block = next(i for i in range(quick_start, len(lines)) if lines[i].startswith("```bash"))
    assert first_block < README_OPENING_LINES, f"the quick start's commands start on line {first_block + 1}"
    assert "## Write an environment" in lines, "README.md has no '## Write an environment' section"
    environment = lines.index("## Write an environment")
    assert environment < README_OPENING_LINES, f"'## Write an environment' starts on line {environment + 1}"
