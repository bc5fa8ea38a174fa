"""Every code sample of README.md and docs/*.md runs and prints what the page shows.

A page's ```` ```python ```` block is one of:

- a *sample*: a complete program. It is run (in a temporary folder, every block of a
  page in one process, each in a fresh namespace) and what it prints must equal the
  ```` ```output ```` block that follows it; a sample with no output block must print
  nothing. ``<!-- mpiexec -n N -->`` on the line before it runs it under
  ``mpiexec -n N`` instead (what it prints must come from worker 0 alone: printed
  once);
- a *fragment*: ``<!-- fragment -->`` on the line before it. A piece of a program
  (names defined elsewhere, a file that only exists on the user's cluster, a GPU): shown,
  not run;
- a column of a ``<!-- port: NAME -->`` table, which tests/test_porting.py runs, or a
  sample under ``<!-- tested: tests/FILE.py -->``, which that test runs and checks.

Other blocks are commands (``bash``), output (``output``, ``text``) and are not run;
every block names its language. New pages under docs/ are covered as they come.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/ for mpi_util
from mpi_util import REPO, repo_env, run_mpi  # noqa: E402

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FRAGMENT = "<!-- fragment -->"
MPIEXEC = re.compile(r"<!-- mpiexec -n (\d+) -->")
TESTED = re.compile(r"<!-- tested: (tests/\S+\.py) -->")
NOT_RUN = {"bash", "sh", "console", "output", "text"}
_FENCE = re.compile(r"^( *)```(\S*)\s*$")


class Block:
    def __init__(self, page: Path, line: int, lang: str, code: str, marker: str,
                 in_port: bool):
        self.page, self.line, self.lang, self.code = page, line, lang, code
        self.marker, self.in_port = marker, in_port
        self.output: str | None = None  # the ```output block right after it

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def ranks(self) -> int:
        m = MPIEXEC.fullmatch(self.marker)
        return int(m.group(1)) if m else 0


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i, in_port = 0, False
    last_text = ""  # the last non-blank line before the current block
    after_block = False  # only blank lines since the last block ended
    while i < len(lines):
        text = lines[i]
        if text.strip().startswith("<!-- port:"):
            in_port = True
        elif text.strip() == "</table>":
            in_port = False
        m = _FENCE.match(text)
        if m is None:
            if text.strip():
                last_text, after_block = text.strip(), False
            i += 1
            continue
        indent, lang = len(m.group(1)), m.group(2)
        j = i + 1
        while j < len(lines) and not (lines[j].startswith(" " * indent + "```")
                                      and lines[j].strip() == "```"):
            j += 1
        code = textwrap.dedent("\n".join(lines[i + 1:j])) + "\n"
        block = Block(page, i + 1, lang, code, last_text, in_port)
        if lang == "output" and out and after_block and out[-1].lang == "python":
            out[-1].output = code
        out.append(block)
        last_text, after_block = "", True
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks_of(page)]
SAMPLES = [b for b in ALL if b.lang == "python" and not b.in_port and b.marker != FRAGMENT
           and not TESTED.fullmatch(b.marker)]

# Runs a page's samples in one process, each in a fresh namespace, in a temporary
# folder; prints one JSON line per sample: what it printed, or its error.
RUNNER = r"""
import contextlib, io, json, os, sys, tempfile, traceback
blocks = json.loads(sys.stdin.read())
results = []
for where, code in blocks:
    out = io.StringIO()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, where, "exec"), {"__name__": "__main__"})
            results.append({"out": out.getvalue()})
        except BaseException:
            results.append({"out": out.getvalue(), "error": traceback.format_exc()})
        finally:
            os.chdir("/")
sys.__stdout__.write(json.dumps(results))
"""


def _run_page(blocks: list[Block]) -> list[dict]:
    env = repo_env(GPUSTRAT_TIMEOUT="60", OMP_NUM_THREADS="1")
    env.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.run([sys.executable, "-c", RUNNER], text=True, capture_output=True,
                          input=json.dumps([(b.where, b.code) for b in blocks]), env=env,
                          timeout=600, cwd="/")
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def _check(block: Block, out: str, error: str | None = None) -> list[str]:
    problems = []
    if error:
        problems.append(f"{block.where}: the sample raised:\n{error}")
    want = block.output or ""
    if out.strip() != want.strip():
        problems.append(f"{block.where}: the sample printed\n{out}\nbut the page shows\n"
                        f"{want or '(no output block: it must print nothing)'}")
    return problems


@pytest.mark.timeout(900)
@pytest.mark.parametrize("page", [p for p in PAGES
                                  if any(b.page == p and not b.ranks for b in SAMPLES)],
                         ids=lambda p: p.name)
def test_the_samples_of_a_page_run_and_print_what_it_shows(page):
    blocks = [b for b in SAMPLES if b.page == page and not b.ranks]
    problems = []
    for block, result in zip(blocks, _run_page(blocks)):
        problems += _check(block, result["out"], result.get("error"))
    assert not problems, "\n\n".join(problems)


MPI_SAMPLES = [b for b in SAMPLES if b.ranks]


@pytest.mark.mpi
@pytest.mark.timeout(300)
@pytest.mark.parametrize("block", MPI_SAMPLES, ids=lambda b: b.where)
def test_the_mpiexec_samples_print_once_from_worker_0(block):
    rc, out, err = run_mpi(block.ranks, block.code, timeout=240,
                           env={"GPUSTRAT_TIMEOUT": "60"})
    assert rc == 0, f"{block.where}: mpiexec exited {rc}\n{out}\n{err[-4000:]}"
    problems = _check(block, out)
    assert not problems, "\n\n".join(problems)


def test_every_block_names_its_language_and_every_marker_is_known():
    problems = []
    for b in ALL:
        if not b.lang:
            problems.append(f"{b.where}: a code block without a language (```python, "
                            "```bash, ```output, ```text)")
        elif b.lang not in NOT_RUN | {"python"}:
            problems.append(f"{b.where}: ```{b.lang}: a sample is ```python; commands "
                            f"and output are one of {sorted(NOT_RUN)}")
        tested = TESTED.fullmatch(b.marker)
        if tested and not (REPO / tested.group(1)).is_file():
            problems.append(f"{b.where}: {b.marker}: no such test file")
        if b.marker.startswith("<!--") and b.marker != FRAGMENT and not b.ranks \
                and not tested and not b.marker.startswith("<!-- port:") \
                and b.lang == "python":
            problems.append(f"{b.where}: unknown marker {b.marker!r}: {FRAGMENT}, "
                            "<!-- mpiexec -n N --> or <!-- tested: tests/FILE.py -->")
        if b.lang == "output" and not any(o.output is not None and o.page == b.page
                                          and o.line < b.line for o in ALL):
            problems.append(f"{b.where}: an output block that follows no sample")
    assert not problems, "\n".join(problems)


def test_the_markers_are_found_and_samples_are_run():
    # The parser finds the README's port and the pages' samples (a broken parser would
    # pass every other test by finding nothing).
    assert len(SAMPLES) >= 10
    assert any(b.in_port for b in ALL)
    assert any(b.marker == FRAGMENT for b in ALL)
    assert MPI_SAMPLES, "no <!-- mpiexec -n N --> sample"
    assert all(b.output is not None or "print(" not in b.code for b in SAMPLES), [
        b.where for b in SAMPLES if b.output is None and "print(" in b.code]
    assert os.path.isfile(REPO / "docs" / "distributed_input.md")
    assert any(b.page.name == "distributed_input.md" for b in SAMPLES)


#: The first line of an indented (unfenced) block that reads as Python.
_PYTHON_START = re.compile(r"^(from \S+ import |import |def |class |with |for |if |@)")


def indented_python(page: Path, root: Path = REPO) -> list[str]:
    """Where ``page`` has an indented code block (four spaces after a blank line, outside
    fences and lists) that starts like Python: such a block is neither run nor marked."""
    found, in_fence, previous = [], False, ""
    for n, text in enumerate(page.read_text().splitlines(), 1):
        if _FENCE.match(text):
            in_fence = not in_fence
        elif not in_fence and text.startswith("    ") and not previous.strip() and \
                _PYTHON_START.match(text[4:]):
            found.append(f"{page.relative_to(root)}:{n}: {text.strip()}")
        if not in_fence and text.strip() and not text.startswith("    ") and \
                re.match(r"^\s*([-*]|\d+\.) ", text):
            previous = "list"   # an indented line after a list item continues it
        elif not text.strip() and previous == "list":
            previous = "list"
        else:
            previous = text
    return found


def test_no_page_shows_python_in_an_indented_block():
    problems = [p for page in PAGES for p in indented_python(page)]
    assert not problems, ("Python in an indented block is neither run nor marked: fence "
                          "it as ```python (a sample, or a fragment after "
                          f"{FRAGMENT}):\n" + "\n".join(problems))


def test_the_indented_python_check_finds_a_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n    from gpustrat import testing\n    x = 1\n\n"
                    "Run:\n\n    python -m gpustrat demo\n\n- a list item\n\n"
                    "    import os   (continues the item)\n")
    assert indented_python(page, tmp_path) == ["page.md:3: from gpustrat import testing"]
