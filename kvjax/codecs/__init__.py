"""Cache codecs: how K or V is stored in the cache and read back by the attention.

The contract and the registry are in `kvjax.codecs.base`; every module of this folder is
imported here and registers its codecs: `floats` (fp32, bf16, fp16) and `quant` (int8,
int4, int2, fp8_e4m3, fp8_e5m2, with optional groups and per-channel keys; its bit packing
and scale arithmetic in `packing`), `normal` (nf4, nf2: normal-float levels on the same
scales); `rotate` registers nothing: the `cache.rotate` basis change the model applies
around any codec; `clip` registers nothing either: `cache.clip`, how the quantized codecs
choose each group's range. Adding a codec = one module in this folder with a
`Codec` subclass and its `register(...)` calls.

Non-finite input: the float codecs propagate NaN and +-Inf unchanged (a cast), and
saturate finite values at the storage type's largest finite value, so finite input
never becomes Inf (fp16 would otherwise overflow above 65504, bf16 just below 2**128).
"""

from kvjax import config as config_lib
from kvjax import plugins
from kvjax.codecs.base import (CODECS, DTYPE_TO_CODEC, READ_CHUNK, Codec, Stored,  # noqa: F401
                               dot_pv, dot_qk, for_role, get, load_bits, register, store_bits)
from kvjax.errors import KvjaxError

plugins.import_all(__name__, __path__)


def check(cache_cfg, model_cfg) -> None:
  """The codec registry's config checks (added to `config.validate`): both names known,
  each codec's own limits, and the rotation around them (`rotate`)."""
  from kvjax.codecs import clip, rotate
  for role in ("k", "v"):
    name = getattr(cache_cfg, f"{role}_codec")
    if name not in CODECS:
      raise KvjaxError(f"unknown codec '{name}' (cache.{role}_codec); known: {', '.join(CODECS)}")
  rotate.check(cache_cfg, model_cfg)
  clip.check(cache_cfg, CODECS)
  for role in ("k", "v"):
    get(getattr(cache_cfg, f"{role}_codec")).check(cache_cfg, model_cfg, role)


config_lib.add_check(check)

