"""Cache bits by layer and by K/V on SmolLM2: where the quantization error of a low-bit cache
comes from, and whether spending more bits on some layers moves the quality/bytes frontier.

    python scripts/layer_bits.py --out results/real/layer_bits.jsonl
    python scripts/layer_bits.py --tokens 256 --seqs 1 --settings all4,k4 --out /tmp/x.jsonl

Every setting assigns a (K codec, V codec) to each layer over one base cache (`--base`:
per-token int4 in a Hadamard basis, `cache.rotate=hadamard`, the real_quality setting
`int4_rot`). The per-layer cache is simulated: the store holds float32, and at every write
each layer's new keys and values go through that layer's codec, encoded then decoded, so
the attention reads what a cache of those codes would hold, dequantized. This is exact for
per-token codecs (a token's codes depend on that token alone), the only ones used here.
The rows' Δppl and KL come with the paired-bootstrap 95 % intervals of `kvjax eval`, on the
real_quality windows (4 × 2,048 stdlib tokens, 64 per step); bits per element are
`kvjax.footprint`'s count of the setting, whose codec knows each layer's codes and scales (no
window, no first tokens).

Settings (LAYERS as `A-B`, inclusive, 0-based):

  all4          the base codec on every layer, K and V (the check: real_quality's int4_rot)
  k4, v4        the base codec on K only (V float32), on V only
  only:A-B      the base codec on layers A..B only, float32 elsewhere (their share of the error)
  k8:A-B        the base codec everywhere, keys of layers A..B in int8
  kv8:A-B       the base codec everywhere, keys and values of layers A..B in int8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import jax.numpy as jnp  # noqa: E402

from kvjax import config as config_lib, footprint
from kvjax.codecs import base as codecs  # noqa: E402
from kvjax.errors import KvjaxError  # noqa: E402
from kvjax.io import sources  # noqa: E402
from kvjax.lab import evaluate, metrics  # noqa: E402

FULL = None  # a layer stored at full precision (float32)


@dataclasses.dataclass(frozen=True)
class LayerMix(codecs.Codec):
  """A float32 store whose writes pass each layer's vectors through that layer's codec
  (encode, then decode): `encode` gets the write of every layer at once, [L, B, K, T, D]."""

  layers: tuple = ()
  storage = "float"  # float32 values: every read (the native kernel too) reads it as fp32

  def encode(self, x_LBKTD):
    if x_LBKTD.ndim != 5 or x_LBKTD.shape[0] != len(self.layers):
      raise ValueError(f"LayerMix encodes a whole write [L={len(self.layers)}, B, K, T, D], "
                       f"got {x_LBKTD.shape}")
    x = x_LBKTD.astype(jnp.float32)
    return jnp.stack([x[i] if c is FULL else c.decode(c.encode(x[i]), jnp.float32)
                      for i, c in enumerate(self.layers)])

  def bytes_per_token(self, n_kv_heads: int, head_dim: int) -> float:
    """What the cache of these codes would hold for one token, per layer on average (the
    layers times this is every layer's codes and scales; float32 where a layer is FULL)."""
    per = [4.0 * n_kv_heads * head_dim if c is FULL else c.bytes_per_token(n_kv_heads, head_dim)
           for c in self.layers]
    return sum(per) / len(per)


def _range(text: str, n: int) -> range:
  a, _, b = text.partition("-")
  try:
    lo, hi = int(a), int(b or a)
  except ValueError:
    raise KvjaxError(f"layer range '{text}' is not A-B (0-based layer numbers)") from None
  if not 0 <= lo <= hi < n:
    raise KvjaxError(f"layer range '{text}' is outside 0-{n - 1}")
  return range(lo, hi + 1)


def assignment(setting: str, n: int, base, int8) -> tuple[list, list]:
  """(K codecs, V codecs) per layer of a setting (the module docstring's names)."""
  kind, _, arg = setting.partition(":")
  k, v = [base] * n, [base] * n
  if kind == "all4":
    pass
  elif kind == "k4":
    v = [FULL] * n
  elif kind == "v4":
    k = [FULL] * n
  elif kind == "only":
    keep = set(_range(arg, n))
    k = v = [base if i in keep else FULL for i in range(n)]
  elif kind in ("k8", "kv8"):
    up = set(_range(arg, n))
    k = [int8 if i in up else base for i in range(n)]
    if kind == "kv8":
      v = list(k)
  else:
    raise KvjaxError(f"unknown setting '{setting}'; see --help")
  return k, v


def bits_per_element(cfg) -> float:
  """Bits per K/V element all-in of a setting's config (`footprint.asymptotic`: no window, no
  first tokens, no policy state in these settings)."""
  m = cfg.model
  return 8 * footprint.asymptotic(cfg) / (m.n_layers * 2 * m.n_kv_heads * m.D)


def main(argv: list[str] | None = None) -> int:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--out", required=True, help="JSON-lines file the rows are appended to")
  p.add_argument("--model", default="gguf:smollm2-135m")
  p.add_argument("--base", default="int4", help="the low-bit codec (per token, whole head)")
  p.add_argument("--rotate", default="hadamard", help="cache.rotate of every setting")
  p.add_argument("--tokens", type=int, default=2048)
  p.add_argument("--seqs", type=int, default=4)
  p.add_argument("--chunk", type=int, default=64)
  p.add_argument("--settings", default="all4,k4,v4,only:0-4,only:5-9,only:10-14,only:15-19,"
                 "only:20-24,only:25-29")
  args = p.parse_args(argv)
  try:
    text = evaluate.eval_inputs("stdlib", args.tokens, args.seqs, args.chunk)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.open("a").close()  # writable before minutes of work, not after
    cfg, params, tok = sources.load(sources.parse(args.model))
    evaluate.check_tokens(args.tokens, cfg.model.max_seq_len)
    cfg = config_lib.apply_overrides(cfg, {"cache.codec": "fp32", "cache.rotate": args.rotate,
                                           "cache.layout": "contiguous"})
    n = cfg.model.n_layers
    base = codecs.for_role(args.base, cfg.cache, "k")
    int8 = codecs.for_role("int8", cfg.cache, "k")
    plans = {s: assignment(s, n, base, int8) for s in args.settings.split(",")}
    windows = evaluate.text_windows(tok, text, args.tokens, args.seqs)
  except (KvjaxError, OSError) as e:
    print(f"layer_bits: {e}", file=sys.stderr)
    return 2
  t0 = time.time()
  ref = evaluate.reference_logprobs(cfg, params, windows, args.chunk)
  print(f"reference: {time.time() - t0:.0f} s", file=sys.stderr)
  env = metrics.environment()
  for i, (setting, (k, v)) in enumerate(plans.items()):
    t0 = time.time()
    # a codec name per setting: its own static config, so its own compiled program
    kname, vname = f"layer_mix_k{i}", f"layer_mix_v{i}"
    codecs.register(LayerMix(kname, jnp.float32, tuple(k)))
    codecs.register(LayerMix(vname, jnp.float32, tuple(v)))
    c = config_lib.apply_overrides(cfg, {"cache.k_codec": kname, "cache.v_codec": vname})
    m, _ = evaluate.compare_streamed(c, params, windows, ref, args.chunk)
    name = lambda x: "fp32" if x is FULL else x.name  # noqa: E731
    row = {"experiment": "layer_bits", "variant": {
               "setting": setting, "base": args.base, "rotate": args.rotate,
               "k_codecs": [name(x) for x in k], "v_codecs": [name(x) for x in v]},
           "workload": {"model": args.model, "text": "stdlib", "tokens": args.tokens,
                        "seqs": args.seqs, "chunk": args.chunk},
           "metrics": {**m, "bits_per_element": bits_per_element(c)}, "env": env}
    try:
      with out.open("a") as f:
        f.write(json.dumps(row) + "\n")
    except OSError as e:  # the rows already written stay
      print(f"layer_bits: cannot write {out}: {e}", file=sys.stderr)
      return 2
    ci = [f"{100 * x:+.2f}" for x in m["dppl_rel_ci95"]]
    print(f"{setting:14s} {row['metrics']['bits_per_element']:5.2f} bits  "
          f"Δppl {100 * m['dppl_rel']:+.3f} % [{ci[0]}, {ci[1]}]  kl {m['kl']:.2e}  "
          f"({time.time() - t0:.0f} s)", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
