"""kvjax.lab.intervals: the default interval (a t interval over windows) covers a known mean
at about its nominal rate, also when windows differ, and narrows as tokens grow; Wilson
intervals equal their closed form."""

import math

import numpy as np
import pytest

from kvjax.lab import intervals


def synthetic(rng, B, M, mu=0.02, kl_mean=0.01, p_agree=0.9, phi=0.5):
  """Per-token (nll, nll_ref, kl, agree) of B windows of M positions whose true Δppl is
  exp(mu) - 1, true KL kl_mean and true agreement p_agree. The NLL differences are AR(1)
  noise (correlated over a few tokens, as a hard passage is) around mu."""
  from scipy import signal
  e = rng.normal(0.0, 0.3, (B, M + 63))
  d = signal.lfilter([1.0], [1.0, -phi], e, axis=1)[:, 64:]  # 64 tokens of burn-in
  nll_ref = rng.gamma(2.0, 1.5, (B, M - 1))
  kl = rng.exponential(kl_mean, (B, M))
  agree = rng.random((B, M)) < p_agree
  return nll_ref + mu + d, nll_ref, kl, agree


def test_bootstrap_covers_the_true_mean_at_about_the_nominal_rate():
  mu, kl_mean, p = 0.02, 0.01, 0.9
  truth = {"dppl_rel_ci95": math.expm1(mu), "kl_ci95": kl_mean, "agreement_ci95": p}
  hits = dict.fromkeys(truth, 0)
  reps = 200
  for seed in range(reps):
    data = synthetic(np.random.default_rng(seed), 4, 512, mu, kl_mean, p)
    ci = intervals.quality_ci(*data, n_resamples=300, seed=seed)
    for k, v in truth.items():
      hits[k] += ci[k][0] <= v <= ci[k][1]
  for k in truth:  # nominal 0.95; the band allows for 200 replicates and the percentile method
    assert 0.88 <= hits[k] / reps <= 0.99, (k, hits[k] / reps)


def test_windows_that_differ_are_covered_by_the_default_and_the_two_stage_bootstrap():
  """Windows of one text differ (each its own offset of the NLL difference, as one source
  file loses more to a codec than another): the interval must hold the mean over the whole
  text. Resampling blocks alone sees only the within-window noise and falls well short;
  the default (a t interval over windows) and the two-stage bootstrap (windows, then
  blocks) hold it at about their nominal rate."""
  mu, reps = 0.02, 150
  hits = {"blocks": 0, "two_stage": 0, "windows_t": 0}
  for seed in range(reps):
    rng = np.random.default_rng(seed)
    nll, ref, kl, agree = synthetic(rng, 4, 512, mu)
    nll = nll + rng.normal(0.0, 0.04, (4, 1))  # the windows' own offsets
    for method in hits:
      ci = intervals.quality_ci(nll, ref, kl, agree, n_resamples=300, seed=seed,
                                method=method)["dppl_rel_ci95"]
      hits[method] += ci[0] <= math.expm1(mu) <= ci[1]
  assert hits["blocks"] / reps < 0.75, hits
  assert hits["two_stage"] / reps >= 0.82, hits  # (four windows: a little under 0.95)
  assert hits["windows_t"] / reps >= 0.88, hits


def test_windows_that_happen_to_agree_still_get_the_noise_within_them():
  """Two windows with the same agreement and the same NLL difference: the spread over
  windows is zero, but each window's tokens still vary; the interval keeps that width."""
  nll, ref, kl, agree = synthetic(np.random.default_rng(3), 1, 320)
  two = [np.concatenate([x, x]) for x in (nll, ref, kl, agree)]
  ci = intervals.quality_ci(*two)
  assert ci["ci_method"] == "windows_t"
  for k in ("dppl_rel_ci95", "kl_ci95", "agreement_ci95"):
    assert ci[k][0] < ci[k][1], k
  point = math.expm1(np.mean(nll) - np.mean(ref))
  assert ci["dppl_rel_ci95"][0] < point < ci["dppl_rel_ci95"][1]


def test_few_windows_are_warned_about():
  assert intervals.few_windows(4) is None
  assert "at least 4 windows" in intervals.few_windows(1)
  assert "its blocks only" in intervals.few_windows(1)
  assert "1 degree of freedom, so they are wide" in intervals.few_windows(2)


def test_interval_narrows_as_tokens_grow_and_holds_the_point():
  widths = []
  for M in (256, 4096):
    nll, ref, kl, agree = synthetic(np.random.default_rng(1), 4, M)
    ci = intervals.quality_ci(nll, ref, kl, agree, n_resamples=500)
    point = math.expm1(np.mean(nll) - np.mean(ref))
    assert ci["dppl_rel_ci95"][0] <= point <= ci["dppl_rel_ci95"][1]
    assert ci["kl_ci95"][0] <= np.mean(kl) <= ci["kl_ci95"][1]
    widths.append({k: v[1] - v[0] for k, v in ci.items() if k.endswith("_ci95")})
  for k in widths[0]:  # 16x the tokens: about sqrt(16) = 4x narrower
    assert widths[1][k] < widths[0][k] / 2.5, k


def test_seeded_and_paired():
  data = synthetic(np.random.default_rng(2), 2, 300)
  assert intervals.quality_ci(*data) == intervals.quality_ci(*data)
  # the same cache as its reference: no difference at all, whatever is resampled
  nll, _, kl, _ = data
  same = intervals.quality_ci(nll, nll, np.zeros_like(kl), np.ones(kl.shape, bool))
  assert same == {"dppl_rel_ci95": [0.0, 0.0], "kl_ci95": [0.0, 0.0],
                  "agreement_ci95": [1.0, 1.0], "ci_method": "windows_t"}
  one = intervals.quality_ci(*(x[:1] for x in data))
  assert one["ci_method"] == "blocks"  # one window: its blocks are all there is


def test_blocks_stay_inside_their_window():
  x = np.arange(10.0).reshape(2, 5)  # windows of 5 positions, blocks of 2
  assert intervals.block_sums(x, 5, 2).tolist() == [1, 5, 4, 11, 15, 9]
  assert intervals.block_sums(x[:, :4], 5, 2).tolist() == [1, 5, 0, 11, 15, 0]
  assert intervals.n_blocks(5, 2, 2) == 6


def closed_form_wilson(k, n, z=1.959963984540054):
  centre = (k + z * z / 2) / (n + z * z)
  half = z / (n + z * z) * math.sqrt(k * (n - k) / n + z * z / 4)
  return centre - half, centre + half


@pytest.mark.parametrize("k,n", [(7, 10), (0, 20), (20, 20), (1, 3), (57, 100)])
def test_wilson_matches_its_closed_form(k, n):
  lo, hi = intervals.wilson(k, n)
  want = closed_form_wilson(k, n)
  assert lo == pytest.approx(want[0], abs=1e-9) and hi == pytest.approx(want[1], abs=1e-9)
  t = intervals.tally([1.0] * k + [0.0] * (n - k))
  assert (t["correct"], t["n"], t["accuracy"]) == (k, n, k / n)
  assert t["accuracy_ci95"] == [lo, hi]


def test_wilson_of_nothing_and_separation():
  assert intervals.wilson(0, 0) is None
  assert intervals.separated([0.1, 0.2], [0.3, 0.4])
  assert not intervals.separated([0.1, 0.35], [0.3, 0.4])
  assert not intervals.separated(None, [0.3, 0.4])
  assert intervals.text([0.0012, 0.0034], "{:+.2f}", 100) == "[+0.12, +0.34]"
  assert intervals.text(None) == ""
