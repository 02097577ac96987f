"""The fuzz harness for the shared readers (hypothesis, derandomized, a small budget in the
suite; `KVJAX_FUZZ_EXAMPLES=500` runs a longer campaign): results rows with any JSON in any
field go through `kvjax plot`'s and `kvjax results`' reader (kvjax.lab.rowfile) and `plot_all`
without anything but a KvjaxError; the environment variables kvjax reads
(kvjax.envcheck) and the API's argument checks (kvjax.inputs) either accept a value or
refuse it in one KvjaxError line."""

from __future__ import annotations

import json
import os

from hypothesis import given, settings
from hypothesis import strategies as st

from kvjax import envcheck, inputs
from kvjax.errors import KvjaxError
from kvjax.lab import plots, rowfile
from kvjax.lab.runner import results
from test_plots import timing_row

EXAMPLES = int(os.environ.get("KVJAX_FUZZ_EXAMPLES", "15"))
FUZZ = settings(derandomize=True, deadline=None, max_examples=EXAMPLES, database=None)

SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=12))
JSONS = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=8)
FIELDS = ["experiment", "config_hash", "cell", "variant", "workload", "metrics", "config",
          "env", "config.name", "config.model", "config.cache", "metrics.tpot_s",
          "workload.context", "variant.codec", "cell.row", "env.backend"]


def _row(edits) -> dict:
  row = timing_row("latency", "MHA", "bf16", "contiguous",
                   {"batch": 1, "prompt_len": 16, "gen_len": 16, "context": 32}, 1e-3)
  for field, value, drop in edits:
    head, _, tail = field.partition(".")
    target = row if not tail else row.get(head)
    key = tail or head
    if isinstance(target, dict):
      if drop:
        target.pop(key, None)
      else:
        target[key] = value
  return row


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(FIELDS), JSONS, st.booleans()), min_size=1,
                max_size=3))
def test_fuzz_rows_through_plot_and_results(tmp_path_factory, edits):
  folder = tmp_path_factory.mktemp("fuzz")
  good = _row([])
  bad = _row(edits)
  (folder / "rows.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
  groups, _ = plots.scan_rows(folder)
  kept = [r for rows in groups.values() for r in rows]
  assert good in kept and all(rowfile.shape_problem(r) is None for r in kept)
  assert len(results.load(folder)) == len(kept)
  out = folder / "plots"
  try:
    paths = plots.plot_all(folder, out)
  except KvjaxError as e:
    assert "\n" not in str(e)
  else:
    assert all(p.resolve().is_relative_to(out.resolve()) for p in paths)


@FUZZ
@given(st.sampled_from(["KVJAX_MEMORY_LIMIT", "KVJAX_KERNEL", "XLA_FLAGS",
                        "KVJAX_NUM_PROCESSES"]),
       st.one_of(st.text(max_size=30), st.from_regex(r"[0-9. ]{0,30}[KMGTkmgt]?i?[Bb]?"),
                 st.just("--xla_force_host_platform_device_count=").map(
                     lambda s: s) | st.text(max_size=5).map(
                         lambda t: "--xla_force_host_platform_device_count=" + t)))
def test_fuzz_environment_variables(name, value):
  value = value.replace("\x00", "")
  old = os.environ.get(name)
  os.environ[name] = value
  try:
    envcheck.check()
  except KvjaxError as e:
    assert "\n" not in str(e) and name in str(e)
  finally:
    if old is None:
      os.environ.pop(name, None)
    else:
      os.environ[name] = old


@FUZZ
@given(JSONS | st.binary(max_size=8) | st.tuples(st.integers(), st.text(max_size=3)))
def test_fuzz_api_arguments(value):
  for check in (lambda v: inputs.prompts(v), lambda v: inputs.seed(v),
                lambda v: inputs.integer("--max-new-tokens", v),
                lambda v: inputs.windows(v, 1, 1),
                lambda v: inputs.eval_source(v, None, None),
                lambda v: inputs.eval_source(None, None, v)):
    try:
      check(value)
    except KvjaxError as e:
      assert "\n" not in str(e)
