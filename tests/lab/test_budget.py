"""The `budget` experiment: the largest batch that fits a memory budget, its throughput
with an interval, and its plot."""

import pytest

from kvjax import config
from kvjax.errors import KvjaxError
from kvjax.lab import intervals
from kvjax.lab.experiments import budget

TINY = {"model.d_model": 32, "model.n_heads": 4, "model.n_kv_heads": 2, "model.head_dim": 8,
        "model.n_layers": 2, "workload.prompt_len": 64, "workload.gen_len": 3,
        "workload.repeats": 3}


def _cfg(**over):
  return config.load(None, {**TINY, **over})


def test_largest_batch_is_the_last_that_fits_and_grows_as_the_cache_shrinks():
  sizes = {}
  for codec in ("fp32", "int4"):
    cfg = _cfg(**{"cache.codec": codec}, params={"budget": 0})
    one, two = budget.need(cfg, 1), budget.need(cfg, 2)
    limit = one + 5 * (two - one) + 1  # room for about six sequences
    cfg = _cfg(**{"cache.codec": codec}, params={"budget": limit, "max_batch": 64})
    b = budget.largest_batch(cfg)
    assert budget.need(cfg, b) <= limit < budget.need(cfg, b + 1)
    sizes[codec] = b
  fp32 = _cfg(params={"budget": 0})
  limit = budget.need(fp32, 1) + 5 * (budget.need(fp32, 2) - budget.need(fp32, 1)) + 1
  int4 = _cfg(**{"cache.codec": "int4"}, params={"budget": limit, "max_batch": 64})
  assert budget.largest_batch(int4) > 6  # the same budget holds more int4 sequences


def test_run_cell_rows_interval_and_plot(tmp_path):
  cfg = _cfg(**{"cache.codec": "int8"}, params={"budget": "64MiB", "max_batch": 4})
  budget.check(cfg)
  (row,) = budget.run_cell(cfg)
  m = row["metrics"]
  assert m["batch"] == 4 and m["need_bytes"] <= m["budget_bytes"] == 64 * 2 ** 20
  lo, hi = m["tokens_per_s_ci95"]
  assert len(m["tokens_per_s_samples"]) == 3 and lo <= m["tokens_per_s"] <= hi
  assert m["tokens_per_s"] == pytest.approx(4 / m["tpot_s"])
  (line,) = budget.summary([row])
  assert line["batch"] == 4
  from kvjax.lab.plots import budget as plot_budget
  row["env"] = {"backend": "cpu", "device_kind": "cpu"}
  paths = plot_budget.plot([row], tmp_path)
  assert {p.suffix for p in paths} == {".png", ".svg"} and all(p.stat().st_size for p in paths)


def test_median_interval_covers_and_ratio_interval_holds_one_for_equal_samples():
  s = [10.0, 11.0, 9.0, 10.5, 9.5]
  lo, hi = intervals.median_ci(s)
  assert lo <= 10.0 <= hi
  lo, hi = budget.ratio_ci(s, s)
  assert lo <= 1.0 <= hi


@pytest.mark.parametrize("params, needle", [({}, "params.budget"), ({"budget": "lots"}, "2GiB"),
                                            ({"budget": -5}, "positive"),
                                            ({"budget": 1000}, "does not hold"),
                                            ({"budget": "1GiB", "max_batch": 0}, "max_batch")])
def test_bad_budgets_are_one_line(params, needle):
  with pytest.raises(KvjaxError, match=needle) as e:
    budget.check(_cfg(params=params))
  assert "\n" not in str(e.value)
