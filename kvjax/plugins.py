"""How the registries fill themselves: a package's `__init__` imports every module in its
folder (`import_all`), and each module registers what it defines (a codec, a layout, an
attention variant, a policy). Adding one is writing one module; nothing else is edited."""

import importlib
import pkgutil


def import_all(package: str, path) -> None:
  """Import every module of `package` (its `__path__`), in name order."""
  for info in sorted(pkgutil.iter_modules(path), key=lambda m: m.name):
    importlib.import_module(f"{package}.{info.name}")
