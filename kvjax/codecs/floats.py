"""The full-precision codecs: fp32, bf16 and fp16 storage (the base `Codec` as it is)."""

import jax.numpy as jnp

from kvjax.codecs.base import Codec, register

register(Codec("fp32", jnp.float32))
register(Codec("bf16", jnp.bfloat16))
register(Codec("fp16", jnp.float16))
