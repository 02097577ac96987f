"""A codec or a layout is one module: dropped into a copy of the package, with no other file
edited, it is in the command line's help, `kvjax size` takes it and compares it under
`--budget`, and a run's summary shows it. So are an attention variant, a policy and an
experiment with its plot: `kvjax run` runs the experiment through them and `kvjax plot`
draws it. And the names are checked in a fresh process:
the config imports no registry, so the entry points must load them before validating. And
a codec says what the Pallas read needs, or that read refuses it."""

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

CODEC = '''"""`tw_half`: a throwaway codec (K/V cast to float16), added by a test."""

import jax.numpy as jnp

from kvjax.codecs.base import Codec, register

register(Codec("tw_half", jnp.float16))
'''
LAYOUT = '''"""`tw_slots`: a throwaway layout (the contiguous one under another name), added by a test."""

from kvjax.cache import base
from kvjax.cache.contiguous import Contiguous


class Slots(Contiguous):
  name = "tw_slots"


base.register(Slots())
'''
ATTENTION = '''"""`tw_attend`: a throwaway attention variant (the reference read), added by a test."""

from kvjax.attention import base, xla

base.register("tw_attend", xla.reference)
'''
POLICY = '''"""`tw_far`: a throwaway policy (keep the keys of largest norm), added by a test."""

import jax.numpy as jnp

from kvjax.policies.base import Policy, register


class Far(Policy):
  name = "tw_far"

  def scores(self, ctx):
    return jnp.linalg.norm(ctx.k_LBKSD.astype(jnp.float32), axis=-1)


register(Far())
'''
EXPERIMENT = '''"""`tw_greedy`: a throwaway experiment (greedy tokens of each cell), added by a test."""

from kvjax.decode import generate
from kvjax.lab import experiments as ex

PARAMS = frozenset()


def run_cell(cfg):
  params = ex.random_params(cfg.model, cfg.seed)
  out = generate.generate(cfg, params, [[1, 2, 3, 4, 5, 6, 7, 8]], 4, timed=False)
  return [{"variant": ex.variant(cfg, policy=cfg.cache.policy),
           "workload": {"prompt_len": 8, "gen_len": 4},
           "metrics": {"tokens": out["tokens"][0], "cache_bytes": out["cache_bytes"]}}]
'''
PLOT = '''"""Plot of the throwaway `tw_greedy` experiment, added by a test."""

from pathlib import Path

import matplotlib.pyplot as plt

from kvjax.lab.plots.style import save


def plot(rows, out_dir):
  fig, ax = plt.subplots(figsize=(4, 3))
  ax.bar(range(len(rows)), [r["metrics"]["cache_bytes"] for r in rows])
  ax.set_title("cache bytes per cell")
  return save(fig, Path(out_dir), "tw_greedy_bytes")
'''
GREEDY = """\
name: tw
experiment: tw_greedy
model: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 2, max_seq_len: 32,
        attention: tw_attend}
cache: {budget: 4}
grid:
  cache.policy: [knorm, tw_far]
"""
CONFIG = """\
name: tiny
experiment: memory
model: {vocab_size: 64, d_model: 32, n_layers: 1, n_heads: 4, n_kv_heads: 2, max_seq_len: 32}
workload: {batch: 1}
params: {contexts: [8]}
grid:
  cache.codec: [fp32, CODEC]
"""
# Runs in the copy: each command in-process, its output (or help text) captured.
SCRIPT = textwrap.dedent("""\
    import contextlib, io, json, sys
    import kvjax
    from kvjax import cli
    out = {"package": kvjax.__file__}
    for key, argv in json.loads(sys.argv[1]).items():
      buf = io.StringIO()
      with contextlib.redirect_stdout(buf):
        try:
          rc = cli.main(argv)
        except SystemExit as e:
          rc = e.code
      out[key] = {"rc": rc, "out": buf.getvalue()}
    print(json.dumps(out))
""")


def _copy(tmp_path: Path) -> Path:
  """A copy of the package in `tmp_path`, with the throwaway codec and layout dropped in."""
  shutil.copytree(ROOT / "kvjax", tmp_path / "kvjax",
                  ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.o"))
  (tmp_path / "kvjax" / "codecs" / "tw_half.py").write_text(CODEC)
  (tmp_path / "kvjax" / "cache" / "tw_slots.py").write_text(LAYOUT)
  for where, text in (("attention/tw_attend.py", ATTENTION), ("policies/tw_far.py", POLICY),
                      ("lab/experiments/tw_greedy.py", EXPERIMENT), ("lab/plots/tw_greedy.py", PLOT)):
    (tmp_path / "kvjax" / where).write_text(text)
  return tmp_path


def _python(cwd: Path, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                        timeout=300, env={"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
                                          "PYTHONPATH": str(cwd), "JAX_PLATFORMS": "cpu"})


def test_each_kind_of_variant_added_as_one_module_is_listed_and_runs(tmp_path):
  root = _copy(tmp_path)
  (root / "tiny.yaml").write_text(CONFIG.replace("CODEC", "tw_half"))
  size = ["size", "--layers", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16",
          "--seq-len", "64", "--budget", "1MB", "--json"]
  commands = {"help": ["--help"], "size_help": ["size", "--help"],
              "size": size + ["--codec", "tw_half", "--set", "cache.layout=tw_slots"],
              "run": ["run", "tiny.yaml", "--out", "out"]}
  (root / "greedy.yaml").write_text(GREEDY)
  commands.update({"greedy": ["run", "greedy.yaml", "--out", "gout"],
                   "plot": ["plot", "gout", "--out", "figs"]})
  proc = _python(root, "-c", SCRIPT, json.dumps(commands))
  assert proc.returncode == 0, proc.stderr[-2000:]
  res = json.loads(proc.stdout.splitlines()[-1])
  assert Path(res["package"]).is_relative_to(root)  # the copy ran, not the worktree
  assert res["greedy"]["rc"] == 0 and res["plot"]["rc"] == 0, res["greedy"]["out"]
  greedy = [json.loads(line) for line in (root / "gout" / "tw_greedy.jsonl").read_text()
            .splitlines()]
  assert sorted(r["variant"]["policy"] for r in greedy) == ["knorm", "tw_far"]
  assert {r["config"]["model"]["attention"] for r in greedy} == {"tw_attend"}
  held = {r["variant"]["policy"]: r["metrics"]["cache_bytes"] for r in greedy}
  assert held["tw_far"] == held["knorm"]  # the same budget of 4 tokens, another choice
  assert (root / "figs" / "tw_greedy_bytes.png").stat().st_size > 0
  for key in ("help", "size_help"):
    text = " ".join(res[key]["out"].split())
    assert res[key]["rc"] == 0 and "tw_half" in text and "tw_slots" in text, text
  sized = json.loads(res["size"]["out"])
  assert sized["k_codec"] == sized["v_codec"] == "tw_half" and sized["layout"] == "tw_slots"
  by_codec = sized["budget"]["max_sequences_by_codec"]
  assert by_codec["tw_half"] == by_codec["fp16"] == sized["budget"]["max_sequences"]
  assert res["run"]["rc"] == 0
  summary = res["run"]["out"]
  assert any("tw_half" in line.split() for line in summary.splitlines()), summary
  rows = [json.loads(line) for line in (root / "out" / "memory.jsonl").read_text().splitlines()]
  assert {r["variant"]["k_codec"] for r in rows} == {"fp32", "tw_half"}


def test_an_unknown_name_is_one_line_in_a_fresh_process(tmp_path):
  """`kvjax run --dry-run` validates each cell before anything else loads the registries:
  the grid's entry point imports them, so an unknown codec is refused, not run."""
  (tmp_path / "bad.yaml").write_text(CONFIG.replace("CODEC", "nope"))
  proc = subprocess.run([sys.executable, "-m", "kvjax.cli", "run", str(tmp_path / "bad.yaml"),
                         "--dry-run"], cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 2
  assert proc.stderr.count("\n") == 1 and "unknown codec 'nope'" in proc.stderr, proc.stderr


def test_a_codec_with_storage_of_its_own_is_refused_by_the_pallas_read(monkeypatch, capsys):
  """The Pallas read loads what a codec says it stores (`Codec.stored`); a codec that
  changes the storage without saying is refused there in one line (exit 2), not read as
  its parent's bit patterns, and the other reads still take it."""
  import jax.numpy as jnp

  from kvjax import cli, codecs, config
  from kvjax.codecs.base import Codec
  from kvjax.errors import KvjaxError

  class Twice(Codec):  # stores 2x: the kernel's float read would double every logit
    def encode(self, x_TD):
      return super().encode(2 * x_TD)

    def decode(self, enc, dtype=jnp.float32):
      return super().decode(enc, dtype) / 2

  class Checked(Codec):  # limits of its own, the storage its parent's
    def check(self, cache_cfg, model_cfg, role):
      super().check(cache_cfg, model_cfg, role)

  assert Twice("t").stored == codecs.Stored(None) and Checked("c").stored == Codec("c").stored
  assert Codec("c", jnp.float32).stored == codecs.Stored("float", kernel=0)  # nor the CPU kernel
  monkeypatch.setitem(codecs.CODECS, "tw_twice", Twice("tw_twice", jnp.float32))
  monkeypatch.setitem(codecs.CODECS, "tw_said", Checked("tw_said", jnp.float32))
  with pytest.raises(KvjaxError, match="model.attention=pallas has no read for tw_twice's"):
    config.load(None, {"cache.k_codec": "tw_twice", "model.attention": "pallas"})
  assert config.load(None, {"cache.codec": "tw_twice"}).cache.k_codec == "tw_twice"
  assert config.load(None, {"cache.codec": "tw_said", "model.attention": "pallas"})
  rc = cli.main(["size", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--head-dim", "8",
                 "--seq-len", "8", "--v-codec", "tw_twice", "--set", "model.attention=pallas"])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1 and "cache.v_codec" in err, err


@pytest.mark.parametrize("name", ["fp32", "bf16", "int4", "int8", "nf4", "nf2"])
def test_the_folded_read_takes_what_each_codec_stores(name):
  """The accelerator program's folded read agrees with the codec's own read for every kind
  of storage; nf4/nf2 (a ScaledCodec whose codes index levels) read through their own."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from kvjax import codecs
  from kvjax.attention import folded

  rng = np.random.default_rng(0)
  q_BKGTD = jnp.asarray(rng.normal(size=(1, 2, 2, 3, 16)), jnp.float32)
  x_BKCD = jnp.asarray(rng.normal(size=(1, 2, 8, 16)), jnp.float32)
  codec = codecs.get(name)
  enc = codec.encode(x_BKCD)
  want = codec.qk(q_BKGTD, enc)
  np.testing.assert_allclose(folded.qk(codec, q_BKGTD, enc), want, rtol=1e-5, atol=1e-5)
  p_BKGTC = jax.nn.softmax(want, axis=-1)
  np.testing.assert_allclose(folded.pv(codec, p_BKGTC, enc, jnp.float32),
                             codec.pv(p_BKGTC, enc), rtol=1e-5, atol=1e-5)
