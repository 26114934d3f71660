"""The README and docs/ stand on their own: every relative link and every path they name outside
the repository would be dead for a reader who has only the repository."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_docs_link_only_inside_the_repository():
    outside, dead = [], []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(ROOT)
        for m in re.finditer(r"(?<![\w.])(\.\./[\w./-]+|/work/[\w./-]*)", text):
            outside.append(f"{name}: {m.group(1)}")
        for m in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            path = (doc.parent / target).resolve()
            if not path.is_relative_to(ROOT):
                outside.append(f"{name}: {target}")
            elif not path.exists():
                dead.append(f"{name}: {target}")
    assert not outside, f"references outside the repository: {outside}"
    assert not dead, f"links to files that do not exist: {dead}"
    assert (ROOT / "docs" / "architecture.md").exists()


def test_every_doc_is_linked_from_the_readme_and_has_a_title():
    readme = (ROOT / "README.md").read_text()
    for doc in sorted((ROOT / "docs").glob("*.md")):
        assert f"](docs/{doc.name}" in readme, f"README.md does not link docs/{doc.name}"
        assert doc.read_text().startswith("# "), f"docs/{doc.name} does not start with a # title"
