"""docs/python.md: every ```python snippet runs, in order, in one namespace, and prints what
the page says it prints (numbers within 5 %, times not compared). The model is the suite's
SmolLM2 fixture (`kvjax.load("smollm2-135m")` returns it instead of reading the file again)."""

import contextlib
import io
import math
import re
import warnings
from pathlib import Path

import pytest

import kvjax
from kvjax import api
from kvjax.io import sources

ROOT = Path(__file__).resolve().parents[2]
NUMBER = re.compile(r"-?\d[\d,]*\.?\d*(?:e[-+]?\d+)?")


def snippets(text: str) -> list[tuple[str, list[str]]]:
  """(code, the lines its trailing `# ` comments say it prints) of each python block."""
  out = []
  for block in re.findall(r"```python\n(.*?)```", text, re.S):
    lines = block.rstrip("\n").split("\n")
    expect = []
    while lines and lines[-1].startswith("# "):
      expect.insert(0, lines.pop()[2:])
    out.append(("\n".join(lines), expect))
  return out


def same(printed: str, expected: str) -> bool:
  """Equal text; numbers within 5 % or one unit of the page's last printed digit (a value
  rounded at a boundary), any number on a line of times."""
  if NUMBER.sub("#", printed) != NUMBER.sub("#", expected):
    return False
  if "ms" in expected:
    return True
  for a, b in zip(NUMBER.findall(printed), NUMBER.findall(expected)):
    x, y = float(a.replace(",", "")), float(b.replace(",", ""))
    exact = not any(c in a + b for c in ".e")  # ids, bytes, counts: equal
    digit = 10.0 ** -len(b.split(".")[1]) if "." in b and "e" not in b else 1e-3
    if x != y if exact else not math.isclose(x, y, rel_tol=0.05, abs_tol=digit * 1.001):
      return False
  return True


def test_page_snippets_run_and_print_what_the_page_says(smollm2_kvjax, tmp_path, monkeypatch):
  cfg, params, tok = smollm2_kvjax
  real_load = api.load

  def load(source="smollm2-135m", overrides=None):
    if source == "smollm2-135m" and not overrides:
      return api.Model(cfg, params, tok, sources.parse("gguf:smollm2-135m"), {})
    return real_load(source, overrides)

  monkeypatch.setattr(api, "load", load)
  monkeypatch.setattr(kvjax, "load", load, raising=False)
  monkeypatch.chdir(tmp_path)
  (tmp_path / "configs").symlink_to(ROOT / "configs")
  blocks = snippets((ROOT / "docs" / "python.md").read_text())
  assert len(blocks) >= 7
  namespace: dict = {}
  for code, expect in blocks:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), warnings.catch_warnings():
      warnings.simplefilter("ignore")  # (the page says which warnings a snippet gives)
      exec(compile(code, "docs/python.md", "exec"), namespace)  # noqa: S102
    printed = buf.getvalue().rstrip("\n").split("\n") if buf.getvalue() else []
    assert len(printed) == len(expect), (code, printed)
    for got, want in zip(printed, expect):
      assert same(got, want), (got, want)
