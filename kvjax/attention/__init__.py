"""Attention variants. MHA, GQA and MQA are one grouped computation (`xla.grouped`); the
registry and the shared online softmax are in `base`; `pallas` reads each stored segment
with a Pallas kernel. Every module of this folder is imported here and registers itself."""

from kvjax import config as config_lib
from kvjax import plugins
from kvjax.attention.base import (ATTENTIONS, MASKED, check, get, names, program,  # noqa: F401
                                  register, resolve, update)

plugins.import_all(__name__, __path__)
config_lib.add_check(check)  # the variant named exists, and its own limits

from kvjax.attention.xla import grouped, reference  # noqa: E402,F401  (the face)
