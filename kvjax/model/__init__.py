"""The model: a Llama-style decoder used as a pure function over an immutable cache.

`transformer` holds the module and its layer loops, `layers` one decoder layer and its
named input, `rope` the rotary embeddings."""

from kvjax.model.layers import Block, LayerInput, RMSNorm, block_forward, linear, rms_norm  # noqa: F401
from kvjax.attention.rope import apply_rope, rope_cos_sin, rope_inv_freq  # noqa: F401
from kvjax.model.transformer import (Transformer, init_params, split_layers,  # noqa: F401
                                     switched_layers, trainable, unrolled)
