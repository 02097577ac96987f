"""kvjax: KV-cache variants (MHA/GQA/MQA, quantized, paged) measured side by side in JAX.

The Python API (docs/python.md) is imported on first use, so `import kvjax` stays cheap:

    import kvjax
    m = kvjax.load("smollm2-135m")
    out = m.generate("The capital of France is", cache=kvjax.CacheConfig(codec="int4"))
"""

from kvjax.errors import KvjaxError

__version__ = "0.1.0"
# name -> the module that defines it (kvjax.api, kvjax.api_types), loaded when first read
_LAZY = {"load": "api", "Model": "api", "run": "api", "plot": "api", "results": "api", "size": "api",
         "RandomWeightsWarning": "api", "CacheConfig": "api_types",
         "GenerateResult": "api_types", "EvalResult": "api_types", "SizeResult": "api_types",
         "RunReport": "api_types"}
__all__ = ["KvjaxError", "__version__", *_LAZY]


def __getattr__(name: str):
  if name in _LAZY:
    import importlib
    value = getattr(importlib.import_module(f"kvjax.{_LAZY[name]}"), name)
    globals()[name] = value
    return value
  raise AttributeError(f"module 'kvjax' has no attribute '{name}'")


def __dir__():
  return sorted(set(globals()) | set(_LAZY))
