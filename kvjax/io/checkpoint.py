"""Orbax checkpoints with the resolved config saved beside them.

A checkpoint folder holds:

    config.yaml          the fully resolved config the weights belong to (written atomically)
    steps/<step>/        orbax items: `params`, optionally `opt_state`, and `meta` (JSON)

Orbax writes each step into a temporary folder and renames it when complete, so a crash
mid-save leaves the previous step intact; `latest_step` only sees finished steps, and
training resumes from there. `load(dir)` returns `(cfg, params)` for any consumer
(`kvjax generate --checkpoint`, the quality and uptrain experiments). A damaged step, a
config.yaml that is not UTF-8 or not a config, and a non-finite weight are one line; the
reads orbax leaves running when a step is damaged are closed (kvjax.io.orbax_quiet) so no
traceback follows that line at exit.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax
import yaml

from kvjax import config as config_lib
from kvjax.config import Config, jsonfile, yamlfile
from kvjax.errors import KvjaxError
from kvjax.io import finite, orbax_quiet

# orbax logs every save at INFO and a damaged-but-readable step's metadata at ERROR (then
# loads it); kvjax reports what matters as one KvjaxError line. KVJAX_DEBUG=1 keeps them.
if not os.environ.get("KVJAX_DEBUG"):
  logging.getLogger("absl").setLevel(logging.CRITICAL)


def _ocp():
  import orbax.checkpoint as ocp  # heavy import: only when a checkpoint is touched
  return ocp


def _manager(out_dir: Path, keep: int = 2, read_only: bool = False):
  ocp = _ocp()
  opts = ocp.CheckpointManagerOptions(max_to_keep=keep, create=not read_only,
                                      enable_async_checkpointing=False, read_only=read_only)
  return ocp.CheckpointManager(Path(out_dir).absolute() / "steps", options=opts)


def _absolute_tokenizer(name: str) -> str:
  """A tokenizer that names a file (`gguf:PATH`, a tokenizer.json) as an absolute path, so
  the checkpoint reads it from any working folder (a relative one broke elsewhere)."""
  kind, path = ("gguf:", name[5:]) if name.startswith("gguf:") else ("", name)
  if path and Path(path).is_file():
    return kind + str(Path(path).resolve())
  return name


def write_config(out_dir: str | Path, cfg: Config) -> None:
  """Atomically write the resolved config (tmp file + rename), a tokenizer file named by
  its absolute path."""
  out = Path(out_dir)
  out.mkdir(parents=True, exist_ok=True)
  tmp = out / "config.yaml.tmp"
  data = cfg.to_dict()
  if isinstance(data.get("tokenizer"), str):
    data["tokenizer"] = _absolute_tokenizer(data["tokenizer"])
  tmp.write_text(yaml.safe_dump(data, sort_keys=True))
  os.replace(tmp, out / "config.yaml")


def read_config(ckpt_dir: str | Path, overrides: dict | None = None) -> Config:
  """The config a checkpoint's weights belong to, read by the strict YAML reader (a FIFO,
  non-UTF-8 bytes, an alias bomb or deep nesting is one line, never a hang)."""
  path = Path(ckpt_dir) / "config.yaml"
  if not path.exists():
    raise KvjaxError(f"{ckpt_dir} has no config.yaml, so it is not a kvjax checkpoint; "
                     "point --checkpoint at a folder written by `kvjax train --out DIR`")
  raw = jsonfile.read_bytes(path, "checkpoint file", "retrain or restore the file")
  try:
    data = yamlfile.parse(raw.decode("utf-8"), "config.yaml")
  except UnicodeDecodeError as e:
    raise KvjaxError(f"{path} is corrupt (not UTF-8 text: byte {e.start}); retrain or restore "
                     "the file") from None
  except KvjaxError as e:
    why = str(e).split("; ")[0]  # the reason, without the advice for a config a user writes
    raise KvjaxError(f"{path} is corrupt ({why}); retrain or restore the file") from None
  try:
    cfg = config_lib.from_dict(_nested(data))
  except RecursionError:  # an anchor that refers to itself nests without end
    raise KvjaxError(f"{path} is corrupt (a YAML alias that contains itself); retrain or "
                     "restore the file") from None
  except (TypeError, ValueError, AttributeError, KeyError) as e:  # a damaged mapping
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:120]
    raise KvjaxError(f"{path} is corrupt ({first}); retrain or restore the file") from None
  return config_lib.apply_overrides(cfg, overrides) if overrides else cfg


def _nested(data: Any) -> dict:
  """config.yaml holds `to_dict()` output; grid/params/rope_scaling are plain mappings."""
  if not isinstance(data, dict):
    raise KvjaxError("checkpoint config.yaml is not a mapping; retrain or restore the file")
  return data


def save(out_dir: str | Path, cfg: Config, params: Any, step: int, opt_state: Any = None,
         meta: dict | None = None, keep: int = 2) -> Path:
  """Save one step (params, optimizer state, JSON meta) and the resolved config beside it."""
  ocp = _ocp()
  write_config(out_dir, cfg)
  items = {"params": ocp.args.StandardSave(params),
           "meta": ocp.args.JsonSave({"step": int(step), **(meta or {})})}
  if opt_state is not None:
    items["opt_state"] = ocp.args.StandardSave(opt_state)
  mngr = _manager(Path(out_dir), keep)
  mngr.save(int(step), args=ocp.args.Composite(**items), force=True)
  mngr.wait_until_finished()
  mngr.close()
  return Path(out_dir)


def latest_step(ckpt_dir: str | Path) -> int | None:
  if not (Path(ckpt_dir) / "steps").is_dir():
    return None
  mngr = _manager(Path(ckpt_dir), read_only=True)
  step = mngr.latest_step()
  mngr.close()
  return step


def restore(ckpt_dir: str | Path, params_like: Any = None, opt_state_like: Any = None,
            step: int | None = None) -> dict:
  """Restore {params, opt_state?, meta} at `step` (default: latest finished step).

  `*_like` are abstract trees (e.g. from `jax.eval_shape`) giving structure and dtypes;
  without them params come back as the saved nested dicts.
  """
  ocp = _ocp()
  ckpt_dir = Path(ckpt_dir)
  if not ckpt_dir.is_dir():
    raise KvjaxError(f"checkpoint folder {ckpt_dir} not found; train one with "
                     f"`kvjax train CONFIG.yaml --out {ckpt_dir}`")
  step = latest_step(ckpt_dir) if step is None else step
  if step is None:
    raise KvjaxError(f"{ckpt_dir} holds no finished checkpoint step; retrain with "
                     f"`kvjax train CONFIG.yaml --out {ckpt_dir}`")
  items = {"params": ocp.args.StandardRestore(params_like), "meta": ocp.args.JsonRestore()}
  if opt_state_like is not None:
    items["opt_state"] = ocp.args.StandardRestore(opt_state_like)
  mngr = _manager(ckpt_dir, read_only=True)
  failure = None
  with orbax_quiet.watch():
    try:
      out = mngr.restore(step, args=ocp.args.Composite(**items))
    except Exception as e:  # orbax/tensorstore raise many types for damaged files
      failure = _reason(e)
      orbax_quiet.abandon_reads()
    finally:
      mngr.close()
  if failure is not None:  # raised here, not as the context of orbax's error, whose frames
    # would keep what it left behind alive until the message is printed
    raise KvjaxError(f"checkpoint {ckpt_dir} step {step} is corrupt or incomplete ({failure}); "
                     "delete that step folder to fall back to an earlier one, or retrain")
  return {k: out[k] for k in items}


def read_meta(ckpt_dir: str | Path, step: int | None = None) -> dict:
  """The JSON meta of one step (default: the latest finished one) without its params: what
  `kvjax convert` recorded (`method`, `recipe`, per-layer fit errors) or train's step."""
  ocp = _ocp()
  step = latest_step(ckpt_dir) if step is None else step
  if step is None:
    raise KvjaxError(f"{ckpt_dir} holds no finished checkpoint step")
  mngr = _manager(Path(ckpt_dir), read_only=True)
  failure = None
  try:
    out = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
  except Exception as e:  # noqa: BLE001  orbax raises many types for damaged files
    failure = _reason(e)
  finally:
    mngr.close()
  if failure is not None:
    raise KvjaxError(f"checkpoint {ckpt_dir} step {step} has no readable meta ({failure}); "
                     "delete that step folder or convert again")
  return dict(out["meta"] or {})


def _reason(e: BaseException) -> str:
  """The first line of the innermost message that says something: orbax wraps tensorstore's
  error ("DATA_LOSS: ...") in one that prints the whole TensorStore spec instead."""
  while e.__cause__ is not None and "See full TensorStore details" in str(e):
    e = e.__cause__
  return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


def load(ckpt_dir: str | Path, overrides: dict | None = None) -> tuple[Config, Any]:
  """(config, params) of the latest step; params are checked against the config's shapes."""
  from kvjax import model

  cfg = read_config(ckpt_dir, overrides)
  from kvjax import memory
  memory.check_params(cfg, f"the weights of {ckpt_dir}")
  abstract = jax.eval_shape(lambda: model.init_params(cfg.model, cfg.seed))
  got = restore(ckpt_dir)["params"]
  want_shapes = jax.tree.map(lambda x: tuple(x.shape), abstract)
  got_shapes = jax.tree.map(lambda x: tuple(x.shape), got)
  if want_shapes != got_shapes:
    raise KvjaxError(f"checkpoint {ckpt_dir} parameters do not match its config's model shape "
                     "(a --set that changes model.* shapes?); drop the override or retrain")
  finite.check_tree(got, f"checkpoint {ckpt_dir}", like=abstract)
  params = jax.tree.map(lambda a, x: jax.numpy.asarray(x, a.dtype), abstract, got)
  return cfg, params
