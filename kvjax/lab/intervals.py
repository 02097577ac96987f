"""95 % intervals of the quality numbers, so two settings are told apart only where their
intervals separate.

Perplexity, KL and agreement (`kvjax eval`, the `quality` and `compression` experiments)
come from the windows as independent draws of the text. The tested cache and the fp32
reference read the same tokens, so each window gives five paired sums: NLL through the cache
minus NLL through the reference (its targets), its number of targets, KL, argmax matches,
and its number of positions. Each statistic is a ratio of sums: Δppl = exp(ΣΔNLL /
Σtargets) − 1, KL = ΣKL / Σpositions, agreement = Σmatches / Σpositions. The default
interval (`windows_t`) is the cluster-robust t interval of that ratio over the windows: its
standard error from the windows' linearized terms and a Student t quantile with B − 1
degrees of freedom, so few windows give a wide interval rather than a short one that
misses; never narrower than the normal interval over every window's blocks of `BLOCK`
positions pooled, so windows that happen to agree do not make a point of it. Over disjoint sets of 2, 4 and 8 windows of a real model's text it held the
pooled estimate in at least 0.90 of the sets for every model, text, codec and measure, where
the bootstraps fell short at 2 or 4 windows (scripts/interval_coverage.py, rows in
results/real_models/interval_coverage.jsonl). The bootstraps stay as methods: `two_stage`
draws the windows with replacement, then each drawn window's blocks of `BLOCK` positions
(blocks, not tokens, because a passage that is hard for the model is hard for several
tokens in a row); `windows` draws whole windows; `blocks` pools every window's blocks. Each
is the percentile interval of `RESAMPLES` resamples seeded with `SEED`, so a row's interval
is the same every run. One window has only its blocks to resample (`blocks`,
scipy.stats.bootstrap): its interval cannot see other text, and fewer than `MIN_WINDOWS`
windows are warned about (`few_windows`), as are fewer than `MIN_BLOCKS` blocks
(`few_blocks`).

Task accuracies (long-context retrieval) get a Wilson score interval of the number right
out of the number asked (`scipy.stats.binomtest(k, n).proportion_ci(method="wilson")`).
"""

from __future__ import annotations

import numpy as np

LEVEL = 0.95      # confidence level of every interval
BLOCK = 32        # token positions per bootstrap block (within one window)
RESAMPLES = 2000  # bootstrap resamples of the blocks
SEED = 0          # the bootstrap's random state: a row's interval is reproducible
MIN_BLOCKS = 10   # fewer blocks than this: the interval is rough
MIN_WINDOWS = 4   # fewer windows than this: the interval may not cover other text


def block_sums(x_BM, n: int, block: int = BLOCK) -> np.ndarray:
  """Sums of `x_BM` over consecutive blocks of `block` positions of each window, the windows'
  first `n` positions cut into ceil(n / block) blocks (positions past x's end add 0):
  [B * ceil(n / block)], window by window."""
  x = np.asarray(x_BM, np.float64)
  B, M = x.shape
  nb = -(-n // block)
  pad = np.zeros((B, nb * block))
  pad[:, :min(M, n)] = x[:, :n]
  return pad.reshape(B, nb, block).sum(-1).reshape(-1)


def n_blocks(M: int, B: int = 1, block: int = BLOCK) -> int:
  """Bootstrap blocks of B windows of M tokens."""
  return B * -(-M // block)


def few_blocks(M: int, B: int = 1) -> str | None:
  """A warning when B windows of M tokens give fewer than MIN_BLOCKS bootstrap blocks."""
  n = n_blocks(M, B)
  if n >= MIN_BLOCKS:
    return None
  return (f"{B} x {M} tokens make {n} bootstrap blocks of {BLOCK}, so the 95 % intervals are "
          f"rough; evaluate at least {MIN_BLOCKS * BLOCK} tokens (--tokens, --seqs)")


def few_windows(B: int) -> str | None:
  """A warning when B windows are too few: one cannot see other text at all, and two or
  three give a t interval with so few degrees of freedom that it is wide."""
  if B >= MIN_WINDOWS:
    return None
  if B == 1:
    return ("1 window: the 95 % intervals resample its blocks only and may not cover a "
            f"rerun on other text; evaluate at least {MIN_WINDOWS} windows (--seqs)")
  return (f"{B} windows: the 95 % intervals are t intervals with {B - 1} degree"
          f"{'s' if B > 2 else ''} of freedom, so they are wide; evaluate at least "
          f"{MIN_WINDOWS} windows (--seqs) for a narrower one")


def _quality_stat(dnll, n_t, kl, agree, n_p, axis=-1):
  """(Δppl, KL, agreement) as ratios of block means, along `axis` (vectorized)."""
  nt, npos = n_t.sum(axis), n_p.sum(axis)
  return np.stack([np.expm1(dnll.sum(axis) / nt), kl.sum(axis) / npos, agree.sum(axis) / npos])


METHODS = ("blocks", "two_stage", "windows", "windows_t")
WORDS = {"blocks": f"a paired bootstrap over {BLOCK}-token blocks",
         "two_stage": f"a paired bootstrap of the windows, then of {BLOCK}-token blocks in each",
         "windows": "a paired bootstrap of whole windows",
         "windows_t": "a t interval over the windows, each a paired sum"}


def describe(methods) -> str:
  """In words, how intervals of `ci_method` `methods` (one name, or several rows') were drawn
  (rows from before `ci_method` existed resampled blocks alone: pass "blocks")."""
  names = [methods] if isinstance(methods, str) else sorted(set(methods))
  return "; ".join(WORDS.get(m, m) for m in names)


def quality_ci(nll_Bm, nll_ref_Bm, kl_BM, agree_BM, block: int = BLOCK,
               n_resamples: int = RESAMPLES, seed: int = SEED, method: str = "windows_t"
               ) -> dict:
  """`dppl_rel_ci95`, `kl_ci95`, `agreement_ci95` ([lo, hi]) of B windows of M positions:
  the next-token NLLs through the cache and the reference ([B, m], m = M - 1: the
  prediction at t scoring token t+1), per-position KL(ref || cache) and argmax matches
  ([B, M]). `method`: `blocks` resamples the blocks of all windows as one pool; `two_stage`
  resamples windows, then blocks within each drawn window; `windows` resamples whole
  windows; `windows_t` (the default) is the cluster-robust t interval over windows; with one
  window every method is `blocks` (scripts/interval_coverage.py measures how often each
  covers other windows of the text)."""
  if method not in METHODS:
    raise ValueError(f"unknown bootstrap method {method!r}; use one of {METHODS}")
  kl = np.asarray(kl_BM, np.float64)
  B, M = kl.shape
  dnll = np.asarray(nll_Bm, np.float64) - np.asarray(nll_ref_Bm, np.float64)
  data = (block_sums(dnll, M, block), block_sums(np.ones_like(dnll), M, block),
          block_sums(kl, M, block), block_sums(agree_BM, M, block),
          block_sums(np.ones_like(kl), M, block))
  if len(data[0]) < 2 or not data[1].sum():  # one block: nothing to resample
    lo = hi = _quality_stat(*data)
  elif method == "windows_t" and B >= 2:
    lo, hi = windows_t(tuple(d.reshape(B, -1).sum(1) for d in data), data)
  elif method == "blocks" or B < 2:
    from scipy import stats
    r = stats.bootstrap(data, _quality_stat, paired=True, vectorized=True,
                        confidence_level=LEVEL, n_resamples=n_resamples, method="percentile",
                        random_state=seed)
    lo, hi = r.confidence_interval.low, r.confidence_interval.high
  else:
    lo, hi = _nested(tuple(d.reshape(B, -1) for d in data), n_resamples, seed,
                     blocks=method == "two_stage")
  names = ("dppl_rel_ci95", "kl_ci95", "agreement_ci95")
  out = {k: [float(a), float(b)] for k, a, b in zip(names, lo, hi)}
  out["kl_ci95"] = [max(x, 0.0) for x in out["kl_ci95"]]  # as the point: KL >= 0
  out["ci_method"] = method if B >= 2 else "blocks"  # what a row's intervals resampled
  return out


def _ratio_se(x, n) -> float:
  """Standard error of R = Σx / Σn over K clusters (the linearized terms x_k − R·n_k, the
  cluster-robust sandwich with its K / (K − 1) correction)."""
  K, r = len(x), x.sum() / n.sum()
  return float(np.sqrt(K / (K - 1) * np.sum((x - r * n) ** 2)) / n.sum())


def windows_t(window_sums: tuple, block_sums: tuple | None = None):
  """(lo, hi) of (Δppl, KL, agreement) over B windows taken as independent draws of the
  text: each a ratio of sums R = ΣX / ΣN (`window_sums`: the five sums per window), its
  standard error over the windows (`_ratio_se`) times a Student t quantile with B − 1
  degrees of freedom, never narrower than the normal interval over `block_sums` (every
  window's blocks pooled: the noise within the text, which a few windows that happen to
  agree would hide); Δppl on the log scale, then expm1."""
  from scipy import stats
  def ratios(sums):  # (numerator, denominator) of Δppl's log, KL and agreement
    dnll, nt, kl, agree, npos = sums
    return ((dnll, nt), (kl, npos), (agree, npos))

  t = stats.t.ppf(0.5 + LEVEL / 2, len(window_sums[0]) - 1)
  z = stats.norm.ppf(0.5 + LEVEL / 2)
  floors = ratios(block_sums) if block_sums is not None and len(block_sums[0]) >= 2 else None
  out = []
  for i, (x, n) in enumerate(ratios(window_sums)):
    half = t * _ratio_se(x, n)
    if floors is not None:  # many blocks: a normal quantile
      half = max(half, z * _ratio_se(*floors[i]))
    r = x.sum() / n.sum()
    out.append((r - half, r + half))
  (a, b), (c, d), (e, f) = out
  return (np.array([np.expm1(a), c, max(e, 0.0)]),
          np.array([np.expm1(b), d, min(f, 1.0)]))


def _nested(sums_Bn: tuple, n_resamples: int, seed: int, blocks: bool):
  """Percentile interval of the statistics over resamples that draw B windows with
  replacement and, with `blocks`, each drawn window's n blocks with replacement."""
  rng = np.random.default_rng(seed)
  B, n = sums_Bn[0].shape
  stats = []
  for r0 in range(0, n_resamples, 250):  # bounded memory: 250 x B x n indices at a time
    R = min(250, n_resamples - r0)
    w = rng.integers(0, B, (R, B))
    if blocks:
      k = rng.integers(0, n, (R, B, n))
      tot = [s[w[..., None], k].sum((1, 2)) for s in sums_Bn]
    else:
      tot = [s.sum(1)[w].sum(1) for s in sums_Bn]
    stats.append(_quality_stat(*(t[:, None] for t in tot)))
  est = np.concatenate(stats, axis=1)  # [3, R]
  a = (1 - LEVEL) / 2
  return np.quantile(est, a, axis=1), np.quantile(est, 1 - a, axis=1)


def wilson(k: int, n: int) -> list[float] | None:
  """95 % Wilson score interval of k successes in n trials ([lo, hi]; None for n = 0)."""
  if n <= 0:
    return None
  from scipy import stats
  ci = stats.binomtest(int(k), int(n)).proportion_ci(confidence_level=LEVEL, method="wilson")
  return [float(ci.low), float(ci.high)]


def tally(scores) -> dict:
  """`correct`, `n`, `accuracy` and its Wilson `accuracy_ci95` of 0/1 scores."""
  s = [float(x) for x in scores]
  k = int(round(sum(s)))
  return {"correct": k, "n": len(s), "accuracy": k / len(s) if s else float("nan"),
          "accuracy_ci95": wilson(k, len(s))}


def shares(scores) -> dict:
  """`score` (the mean of scores in [0, 1], each a question's share of expected strings
  found), `n` questions and the Wilson 95 % interval `score_ci95` with n trials and the
  summed shares as successes: for 0/1 scores exactly `wilson`; for fractional shares at
  least as wide as a binomial of the same mean needs (a share's variance is at most
  mean x (1 - mean)), so it never claims more than the questions show."""
  s = np.asarray([float(x) for x in scores], float)
  if s.size == 0:
    return {"score": float("nan"), "n": 0, "score_ci95": None}
  n, p = s.size, float(s.mean())
  z = 1.959963984540054
  centre = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z / (1 + z * z / n) * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
  return {"score": p, "n": int(n),
          "score_ci95": [float(max(0.0, centre - half)), float(min(1.0, centre + half))]}


def separated(a: list[float] | None, b: list[float] | None) -> bool:
  """Whether two intervals do not overlap (a difference worth calling one)."""
  return bool(a and b) and (a[1] < b[0] or b[1] < a[0])


def text(ci: list[float] | None, fmt: str = "{:.3g}", scale: float = 1.0) -> str:
  """An interval as `[lo, hi]` ('' when absent: rows written before intervals existed)."""
  if not ci:
    return ""
  return "[" + ", ".join(fmt.format(scale * x) for x in ci) + "]"


def median_ci(samples: list[float]) -> list[float]:
  """95 % bootstrap interval of the median of `samples` ([x, x] for one sample)."""
  from scipy import stats
  a = np.asarray(samples, float)
  if len(a) < 2 or np.all(a == a[0]):
    return [float(np.median(a))] * 2
  r = stats.bootstrap((a,), np.median, confidence_level=0.95, n_resamples=2000,
                      method="percentile", random_state=0)
  return [float(r.confidence_interval.low), float(r.confidence_interval.high)]


def paired_ratio(samples: list[float], reference: list[float]) -> tuple[float, list[float]]:
  """The median of per-repeat ratios samples[i] / reference[i] (times taken in the same
  repeat), with its 95 % bootstrap interval (`median_ci`)."""
  ratios = [a / b for a, b in zip(samples, reference)]
  return float(np.median(ratios)), median_ci(ratios)
