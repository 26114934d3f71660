"""Small rooms: no module of the package grows past ~400 lines (split out a coherent piece instead)."""
from pathlib import Path

import pdserve

MAX_LINES = 400


def test_no_module_over_400_lines():
    root = Path(pdserve.__file__).parent
    sizes = {str(p.relative_to(root.parent)): len(p.read_text().splitlines()) for p in root.rglob("*.py")}
    assert len(sizes) > 50, "the package's modules were not found"
    too_long = {path: n for path, n in sizes.items() if n > MAX_LINES}
    assert not too_long, f"modules over {MAX_LINES} lines: {too_long}"
