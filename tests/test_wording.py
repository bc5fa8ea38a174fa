"""User-facing text (README, docs, docstrings, messages, examples, benchmark output)
describes behaviour; it does not cite the project's internal specification, its issue
tracker or the source documents it was built from."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FORBIDDEN = re.compile(r"\bSPEC\b|\b[Ii]ssue \d+|\bseeds'|\bthe seeds\b|\bseed example|"
                       r"\bseed[- ]0\d\d?\b")


def user_facing_files():
    yield REPO / "README.md"
    for folder, pattern in (("docs", "*.md"), ("gpustrat", "*.py"), ("kernels", "*.py"),
                            ("examples", "*.py"), ("benchmarks", "*.py")):
        yield from sorted((REPO / folder).rglob(pattern))


def test_no_internal_citations_in_user_facing_text():
    hits = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
            for path in user_facing_files()
            for n, line in enumerate(path.read_text().splitlines(), 1)
            if FORBIDDEN.search(line)]
    assert not hits, "\n".join(hits)
