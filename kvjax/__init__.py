"""kvjax: KV-cache variants (MHA/GQA/MQA, quantized, paged) measured side by side in JAX."""

from kvjax.errors import KvjaxError

__version__ = "0.1.0"
__all__ = ["KvjaxError", "__version__"]
