"""scripts/kvpress_peer.py: the kept counts, kvpress's scoring rules on kvjax's keys, and
its refusals (the kvpress side itself needs its own environment: `make install-kvpress`)."""

import importlib.util
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("kvpress_peer", ROOT / "scripts" / "kvpress_peer.py")
peer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peer)


def test_kept_count_is_kvpress_s():
  assert peer.n_kept(4095, 0.5) == 2047 and peer.n_kept(4096, 0.5) == 2048
  assert peer.n_kept(3, 0.9) == 1 and peer.n_kept(100, 0.25) == 75


def test_jaccard():
  assert peer.jaccard([1, 2, 3], [2, 3, 4]) == 0.5 and peer.jaccard([], []) == 1.0


def _qk(L=2, n=96, H=4, K=2, D=8, seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=(L, n, H, D)).astype(np.float32),
          rng.normal(size=(L, K, n, D)).astype(np.float32))


def test_tova_rule_shares_one_ranking_and_keeps_the_last():
  q, k = _qk()
  kept = peer.as_kvpress("tova", q, k, 96, 30)
  for layer in kept:
    assert layer[0] == layer[1] and len(layer[0]) == 30 and 95 in layer[0]


def test_snapkv_rule_keeps_its_window_and_the_key_the_window_reads():
  """The 64-query window is always kept; a key every window query attends to strongly is
  kept with its pooled neighbours' help, whatever the rest score."""
  q, k = _qk(n=128)
  for kh in range(2):  # key 10 of KV head kh points along its query heads' window mean
    m = q[:, 64:, 2 * kh:2 * kh + 2].mean(axis=(1, 2))  # [L, D]
    k[:, kh, 10] = 12.0 * m / np.linalg.norm(m, axis=-1, keepdims=True)
  kept = peer.as_kvpress("snapkv", q, k, 128, 70)
  for layer in kept:
    for head in layer:
      assert set(range(64, 128)) <= set(head) and len(head) == 70 and 10 in head


@pytest.mark.parametrize("argv,match", [
    (["--ratio", "1.5"], "--ratio must be in"),
    (["--prompts", "0"], "--prompts must be"),
])
def test_bad_input_exit_2_one_line(argv, match, capsys):
  with pytest.raises(SystemExit) as e:
    peer.main(argv)
  assert e.value.code == 2
  err = capsys.readouterr().err.strip()
  assert match in err and "\n" not in err


def test_missing_environment_names_the_make_target(monkeypatch, capsys):
  monkeypatch.setattr(peer, "SIDE_PY", ROOT / "no-such-venv" / "bin" / "python")
  with pytest.raises(SystemExit) as e:
    peer.main([])
  assert e.value.code == 2 and "make install-kvpress" in capsys.readouterr().err
