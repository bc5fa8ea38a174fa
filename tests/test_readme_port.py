"""The README's ported custom training loop runs, and without its shuffle prints what
the TensorFlow loop above it prints (recorded from TensorFlow 2.21, eager, on 2 logical
CPUs: the same model, data, optimizer, loss scaling and metric)."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"

# Recorded from TensorFlow 2.21 running the README's TensorFlow loop without
# `.shuffle(1000, seed=0)`, MirroredStrategy(["/cpu:0", "/cpu:1"]).
TF_PRINTED = ["epoch 1: loss 2.053, accuracy 0.585",
              "epoch 2: loss 1.337, accuracy 0.839",
              "epoch 3: loss 0.868, accuracy 0.871"]


def ported_block() -> str:
    text = README.read_text()
    section = text[text.index("## Porting a TensorFlow custom training loop"):]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert "import tensorflow as tf" in blocks[0] and "import gpustrat as gs" in blocks[1]
    return blocks[1]


def run(code: str) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "readme"})  # noqa: S102
    return out.getvalue().splitlines()


def test_ported_loop_prints_what_the_readme_shows():
    shown = re.findall(r"^    (epoch \d: .*)$", README.read_text(), re.M)
    assert run(ported_block()) == shown and len(shown) == 3


def test_ported_loop_matches_tensorflow_without_the_shuffle():
    code = ported_block()
    assert ".shuffle(1000, seed=0)" in code
    assert run(code.replace(".shuffle(1000, seed=0)", "")) == TF_PRINTED
