"""The position experiment (kvjax/lab/experiments/position.py) at tiny size: per-position
terms streamed in lockstep with the fp32 reference equal the stored-reference path, and a
run writes one row per bucket, the fp32 setting's exactly the reference's."""

import json

import numpy as np
import pytest
import yaml

from kvjax import cli, config
from kvjax.lab import evaluate, lockstep
from kvjax.lab.experiments import position

MODEL = {"vocab_size": 260, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2,
         "head_dim": 8, "max_seq_len": 96}


def test_lockstep_terms_equal_the_stored_reference_path():
  """`lockstep.terms` (the fp32 reference streamed once beside every cache, segment by segment)
  gives, position by position, the NLL, KL and agreement of each cache's and the
  reference's whole log-probabilities (each streamed on its own), for every position with
  a target."""
  from kvjax import model
  cfg = config.load(None, {**{f"model.{k}": v for k, v in MODEL.items()}, "cache.codec": "int4"})
  params = model.init_params(cfg.model, 0)
  tokens = np.random.default_rng(0).integers(0, 260, (1, 80)).astype(np.int32)
  ref_cfg = evaluate.reference_config(cfg)
  int8 = config.apply_overrides(cfg, {"cache.codec": "int8"})
  got = lockstep.terms({"int4": cfg, "int8": int8}, ref_cfg, params, tokens, chunk=16)
  assert list(got) == ["int4", "int8"]
  ref_lp = evaluate.host_logprobs(ref_cfg, params, tokens, 16)
  for name, c in (("int4", cfg), ("int8", int8)):
    whole = evaluate.token_terms(evaluate.host_logprobs(c, params, tokens, 16), ref_lp,
                                 tokens[:, 1:])
    for g, w in zip(got[name], whole):
      assert g.shape == (1, 79)
      np.testing.assert_allclose(g, w[:, :79], rtol=1e-6, atol=1e-9)
    assert not np.array_equal(got[name][0], got[name][1])  # not the reference
  assert got["int4"][2].mean() > got["int8"][2].mean()  # KL: 4 bits drift more than 8


def test_a_policy_is_compacted_at_each_bucket_start():
  """snapkv at a quarter, read by bucket: the first bucket (no prefix) is the reference's
  own; a later bucket [lo, hi) equals prefilling its prefix compacted by the policy, then
  teacher-forcing the bucket (`evict.continuation_logprobs`, the frontier's protocol); at
  ratio 1 nothing is evicted and every bucket is the reference's."""
  from kvjax import model
  from kvjax.decode import evict
  cfg = config.load(None, {f"model.{k}": v for k, v in MODEL.items()})
  params = model.init_params(cfg.model, 0)
  tokens = np.random.default_rng(1).integers(0, 260, (1, 96)).astype(np.int32)
  ref_cfg = evaluate.reference_config(cfg)
  snap = config.apply_overrides(cfg, {"cache.policy": "snapkv", "cache.ratio": 0.25,
                                      "cache.window": 4})
  keep = config.apply_overrides(snap, {"cache.ratio": 1.0})
  edges = [0, 32, 64, 96]
  got = lockstep.terms({"snap": snap, "keep": keep}, ref_cfg, params, tokens, 16,
                                edges=edges)
  nll, nll_ref, kl, agree = got["snap"]
  np.testing.assert_allclose(kl[:, :32], 0, atol=1e-6)
  assert kl[:, 32:].mean() > 1e-4
  np.testing.assert_allclose(got["keep"][2], 0, atol=1e-5)
  for lo, hi in zip(edges[1:], edges[2:]):
    lp, _ = evict.continuation_logprobs(snap, params, tokens[:, :lo], tokens[:, lo:hi])
    want = -np.take_along_axis(np.asarray(lp[:, 1:]), tokens[:, lo + 1:hi, None], -1)[..., 0]
    np.testing.assert_allclose(nll[:, lo:hi - 1], want, rtol=1e-4, atol=1e-4)


def test_a_policy_needs_bucket_edges_on_the_chunk(tmp_path, capsys):
  path = _config(tmp_path, caches={"snap": {"cache.policy": "snapkv", "cache.ratio": 0.5}},
                 buckets=[0, 40, 64])
  raw = yaml.safe_load(path.read_text())
  del raw["grid"], raw["params"]["settings"]
  path.write_text(yaml.safe_dump(raw))
  rc = cli.main(["run", str(path), "--out", str(tmp_path / "o")])
  err = capsys.readouterr().err
  assert rc == 2 and "multiple of params.chunk=16" in err and err.count("\n") == 1, err
  raw["params"]["buckets"] = [0, 32, 64]
  path.write_text(yaml.safe_dump(raw))
  rc = cli.main(["run", str(path), "--out", str(tmp_path / "o")])  # before any weight
  assert rc == 2 and "snapkv window" in capsys.readouterr().err
  raw["params"]["caches"]["snap"]["cache.window"] = 4
  path.write_text(yaml.safe_dump(raw))
  assert cli.main(["run", str(path), "--out", str(tmp_path / "o")]) == 0
  rows = [json.loads(line) for f in (tmp_path / "o").rglob("*.jsonl") for line in open(f)]
  assert [r["workload"]["protocol"] for r in rows] == ["compacted at the bucket's start"] * 3
  assert rows[0]["metrics"]["kl"] < 1e-9 < rows[1]["metrics"]["kl"]


def _config(tmp_path, **params):
  model_file = tmp_path / "tiny.yaml"
  model_file.write_text(yaml.safe_dump({"tokenizer": "bytes", "model": MODEL}))
  cfg = {"name": "position_tiny", "experiment": "position", "model": MODEL,
         "grid": {"params.setting": ["fp32", "int4"]},
         "params": {"models": [f"config:{model_file}"], "text": "stdlib", "tokens": 200,
                    "chunk": 16, "buckets": [0, 32, 64],
                    "settings": {"fp32": {"cache.codec": "fp32"}, "int4": {"cache.codec": "int4"}},
                    **params}}
  path = tmp_path / "position.yaml"
  path.write_text(yaml.safe_dump(cfg))
  return path


def test_a_run_writes_a_row_per_bucket_up_to_the_models_context(tmp_path, capsys):
  """200 tokens asked of a 96-token model: it reads 96, in buckets 0-32, 32-64 and 64-96;
  the fp32 setting's rows are the reference itself (Δppl and KL 0, agreement 1), int4's
  carry intervals."""
  out = tmp_path / "out"
  assert cli.main(["run", str(_config(tmp_path)), "--out", str(out)]) == 0
  rows = [json.loads(line) for f in sorted(out.rglob("*.jsonl")) for line in open(f)]
  assert len(rows) == 6
  for r in rows:
    assert r["workload"]["context"] == 96 and r["workload"]["protocol"] == "streamed"
  by = {(r["variant"]["setting"], tuple(r["workload"]["bucket"])): r["metrics"] for r in rows}
  assert set(by) == {(s, b) for s in ("fp32", "int4") for b in ((0, 32), (32, 64), (64, 96))}
  for b in ((0, 32), (32, 64), (64, 96)):
    assert by["fp32", b]["dppl_rel"] == 0 and by["fp32", b]["kl"] < 1e-9
    assert by["fp32", b]["agreement"] == 1
    lo, hi = by["int4", b]["dppl_rel_ci95"]
    assert np.isfinite([lo, hi]).all() and lo <= hi and by["int4", b]["kl"] > 0
  assert by["int4", (64, 96)]["positions"] == 95 - 64  # the last token predicts nothing
  err = capsys.readouterr().err
  # 32 positions are one bootstrap block: each bucket's interval is said to be rough
  assert err.count("intervals are rough") == 6
  assert "position: about" in err and "hours on this machine for 2 cells" in err  # before


def test_a_cell_of_caches_writes_what_a_cell_per_cache_writes(tmp_path, capsys):
  """`params.caches` streams the reference once beside every cache: its rows' metrics equal
  those of one cell per setting, named the same, in fewer streams (the estimate counts 3
  streams for the cell where the per-setting grid counts 2 x 2)."""
  one = tmp_path / "one"
  assert cli.main(["run", str(_config(tmp_path)), "--out", str(one)]) == 0
  caches = {"fp32": {"cache.codec": "fp32"}, "int4": {"cache.codec": "int4"}}
  path = _config(tmp_path, caches=caches)
  raw = yaml.safe_load(path.read_text())
  del raw["grid"], raw["params"]["settings"]
  path.write_text(yaml.safe_dump(raw))
  both = tmp_path / "both"
  assert cli.main(["run", str(path), "--out", str(both)]) == 0
  assert "for 1 cells" in capsys.readouterr().err
  read = lambda d: {(r["variant"]["setting"], tuple(r["workload"]["bucket"])): r["metrics"]
                    for f in sorted(d.rglob("*.jsonl")) for line in open(f)
                    for r in [json.loads(line)]}
  a, b = read(one), read(both)
  assert set(a) == set(b) and len(a) == 6
  for k in a:
    for m in a[k]:
      if isinstance(a[k][m], str):
        assert a[k][m] == b[k][m]
      else:
        np.testing.assert_allclose(a[k][m], b[k][m], rtol=1e-6, atol=1e-12, err_msg=f"{k} {m}")


@pytest.mark.parametrize("caches,match", [
    ({"x": {"model.d_model": 8}}, "must map cache"),
    ({"x": {"cache.codec": "int3"}}, "int3"),
    ([], "needs params.caches")])
def test_bad_caches_are_refused_in_one_line(tmp_path, capsys, caches, match):
  path = _config(tmp_path, caches=caches)
  raw = yaml.safe_load(path.read_text())
  del raw["grid"], raw["params"]["settings"]
  path.write_text(yaml.safe_dump(raw))
  rc = cli.main(["run", str(path), "--out", str(tmp_path / "o")])
  err = capsys.readouterr().err
  assert rc == 2 and match in err and err.count("\n") == 1, err


@pytest.mark.parametrize("buckets", [[0], [1, 10], [0, 10, 10], [0, "x"]])
def test_bad_buckets_are_refused_in_one_line(tmp_path, capsys, buckets):
  rc = cli.main(["run", str(_config(tmp_path, buckets=buckets)), "--out", str(tmp_path / "o")])
  err = capsys.readouterr().err
  assert rc == 2 and "params.buckets" in err and err.count("\n") == 1


def _setup(seed=2):
  from kvjax import model
  cfg = config.load(None, {f"model.{k}": v for k, v in MODEL.items()})
  params = model.init_params(cfg.model, 0)
  tokens = np.random.default_rng(seed).integers(0, 260, (1, 90)).astype(np.int32)
  tcfgs = {"int4": config.apply_overrides(cfg, {"cache.codec": "int4"}),
           "snap": config.apply_overrides(cfg, {"cache.policy": "snapkv", "cache.ratio": 0.25,
                                                "cache.window": 4})}
  return tcfgs, evaluate.reference_config(cfg), params, tokens


def _same(a, b):
  assert list(a) == list(b)
  for name in a:
    for x, y in zip(a[name], b[name]):
      np.testing.assert_array_equal(x, y, err_msg=name)


def test_pieces_cut_at_edges_on_the_chunk_and_every_piece():
  assert lockstep.pieces(90, 16, [0, 32, 64, 90], piece=4096) == [(0, 32), (32, 64), (64, 90)]
  assert lockstep.pieces(90, 16, [0, 32, 64, 90], piece=56) == [  # 56: 48, whole chunks
      (0, 32), (32, 48), (48, 64), (64, 90)]
  assert lockstep.pieces(90, 16, None, piece=16) == [
      (0, 16), (16, 32), (32, 48), (48, 64), (64, 80), (80, 90)]


def test_a_sequence_read_in_pieces_gives_the_terms_of_one_read():
  """Cut every 16 tokens (each stream's cache handed from piece to piece, an evicting one
  compacted afresh at each bucket's start only), the terms are exactly those of the
  sequence read bucket by bucket."""
  tcfgs, ref_cfg, params, tokens = _setup()
  edges = [0, 32, 64, 90]
  whole = lockstep.terms(tcfgs, ref_cfg, params, tokens, 16, edges=edges)
  _same(lockstep.terms(tcfgs, ref_cfg, params, tokens, 16, edges=edges, piece=16), whole)


class _Killed(Exception):
  pass


class _DiesAfter(lockstep.Store):
  """A store whose run is killed after its n-th save."""

  def __init__(self, folder, n):
    super().__init__(folder)
    self.n = n

  def save(self, *a, **k):
    super().save(*a, **k)
    self.n -= 1
    if self.n == 0:
      raise _Killed


def test_a_killed_run_resumes_from_its_last_saved_piece(tmp_path, capsys):
  """Killed after the piece ending at 48 (mid-bucket: snapkv's cache there is not saved, so
  its bucket is read again up to 48), a second run on the same folder starts at 48 and
  writes exactly the terms of a run never killed; the folder of another run's state is
  set aside with a warning, and a corrupt one too."""
  tcfgs, ref_cfg, params, tokens = _setup()
  edges = [0, 32, 64, 90]
  whole = lockstep.terms(tcfgs, ref_cfg, params, tokens, 16, edges=edges)
  with pytest.raises(_Killed):
    lockstep.terms(tcfgs, ref_cfg, params, tokens, 16, edges=edges, piece=16,
                   store=_DiesAfter(tmp_path, 3))
  store = lockstep.Store(tmp_path)
  key = lockstep.run_key(tcfgs, ref_cfg, tokens, 16, edges, 16)
  assert store.load(key, {})[0] == 48  # the tokens done when it was killed

  class Bar:
    def __init__(self):
      self.steps = []

    def update(self, k):
      self.steps.append(k)

  bar = Bar()
  _same(lockstep.terms(tcfgs, ref_cfg, params, tokens, 16, bar, edges=edges, piece=16,
                       store=store), whole)
  # the 48 tokens done counted at once for all three streams, the rest a segment at a time
  assert bar.steps[0] == 3 * 48 and sum(bar.steps) == 3 * 90
  # a state of another run (other tokens) is not resumed
  other = tokens.copy()
  other[0, 5] += 1
  got = lockstep.terms(tcfgs, ref_cfg, params, other, 16, edges=edges, piece=16, store=store)
  assert "cannot be resumed (written by another run)" in capsys.readouterr().err
  with pytest.raises(AssertionError):
    _same(got, whole)
  store.path.write_bytes(b"not an npz")
  _same(lockstep.terms(tcfgs, ref_cfg, params, tokens, 16, edges=edges, piece=16,
                       store=store), whole)
  assert "cannot be resumed" in capsys.readouterr().err


def test_a_cell_killed_midway_resumes_in_the_runners_scratch_folder(tmp_path, monkeypatch):
  """`kvjax run` hands the position cell a scratch folder: killed after its first saved
  piece, the next run resumes there (it saves from 48 on only) and writes the
  rows a run never killed writes; the folder is gone once the rows are written."""
  caches = {"int4": {"cache.codec": "int4"}}
  path = _config(tmp_path, caches=caches)
  raw = yaml.safe_load(path.read_text())
  del raw["grid"], raw["params"]["settings"]
  path.write_text(yaml.safe_dump(raw))
  monkeypatch.setattr(lockstep, "PIECE", 16)
  saved = []
  real_save = lockstep.Store.save

  def save(self, key, done, caches_, parts):
    real_save(self, key, done, caches_, parts)
    saved.append(done)
    if done == 32 and saved.count(32) == 1:
      raise _Killed

  monkeypatch.setattr(lockstep.Store, "save", save)
  out = tmp_path / "o"
  with pytest.raises(_Killed):
    cli.main(["run", str(path), "--out", str(out)])
  assert list((out / ".kvjax-partial").rglob("lockstep.npz"))
  assert not list(out.rglob("*.jsonl")) or not any(open(f).read() for f in out.rglob("*.jsonl"))
  assert cli.main(["run", str(path), "--out", str(out)]) == 0
  assert saved == [16, 32, 48, 64, 80]  # the second run started after 32
  assert not (out / ".kvjax-partial").exists()
  fresh = tmp_path / "fresh"
  assert cli.main(["run", str(path), "--out", str(fresh)]) == 0
  read = lambda d: [(r["variant"]["setting"], r["workload"]["bucket"], r["metrics"])
                    for f in sorted(d.rglob("*.jsonl")) for line in open(f)
                    for r in [json.loads(line)]]
  assert read(out) == read(fresh) and len(read(out)) == 3


def test_the_estimate_counts_the_prefix_prefills_of_an_evicting_cell(tmp_path, monkeypatch):
  """Streams: the reference and each cache over the model's 96 tokens; an evicting cache adds
  the one-call prefill of each bucket's prefix (32 and 64 tokens), once per cell."""
  from kvjax.lab.experiments import roofline, ruler
  from kvjax.lab.runner import run
  monkeypatch.setattr(roofline.DotProbe, "measure", lambda self: {"f32": 2.0})
  seen = []
  monkeypatch.setattr(ruler, "prefill_flops", lambda m, n: seen.append(n) or 72.0 * n)
  caches = {"int4": {"cache.codec": "int4"},
            "snap": {"cache.policy": "snapkv", "cache.ratio": 0.5, "cache.window": 4},
            "h2o": {"cache.policy": "h2o", "cache.ratio": 0.5}}
  path = _config(tmp_path, caches=caches)
  raw = yaml.safe_load(path.read_text())
  del raw["grid"], raw["params"]["settings"]
  path.write_text(yaml.safe_dump(raw))
  cells = run._select(path, None, None)[2]
  said = position.estimate([c.cfg for c in cells])
  assert sorted(seen) == [32, 64, 96]
  # 72 flops a token at 1 flop/s: 4 streams of 96 tokens, then prefixes of 32 and 64
  assert said.startswith(f"about {72 * (4 * 96 + 32 + 64) / 3600:.1f} hours"), said


def test_a_dry_run_lists_each_cache_of_a_cell_with_its_own_columns(tmp_path, capsys):
  caches = {"int4": {"cache.codec": "int4"}, "snap": {"cache.policy": "snapkv",
                                                      "cache.ratio": 0.5, "cache.window": 4}}
  path = _config(tmp_path, caches=caches)
  raw = yaml.safe_load(path.read_text())
  del raw["grid"], raw["params"]["settings"]
  path.write_text(yaml.safe_dump(raw))
  assert cli.main(["run", str(path), "--dry-run"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert "1 cells, 2 variants" in lines[0]
  head = lines[1].split()
  rows = [dict(zip(head, line.split())) for line in lines[3:5]]
  assert [(r["cache"], r["k_codec"], r["policy"]) for r in rows] == [
      ("int4", "int4", "full"), ("snap", "fp32", "snapkv")]
