"""`kvjax run FILE.yaml`: expand a config's grid into cells, run each cell, append rows.

A config names an `experiment:` (a module in the `experiments` package) and a `grid:` of
dotted config keys -> lists; their cartesian product is the set of cells. Keys may be
any config key (`model.n_kv_heads`, `cache.codec`, `workload.batch`, ...) or
`params.<name>` for experiment options, so a new codec or layout joins a grid by name,
with no code change. `--set key=value` overrides the base config; `--set` on a key the
grid sweeps pins it, and `--set grid.KEY=[a,b]` replaces (or adds) an axis.

Paired settings, for every experiment: `params.settings` maps a name to a bundle of
overrides (`k8v4: {cache.k_codec: int8, cache.v_codec: int4}`), and `params.setting`
(usually a grid axis) selects one per cell, so unlike settings sweep side by side instead of
as a cartesian product. A cell's config is composed from its layers (`compose`): the file
< grid coordinates < the selected setting < `--set`, merged into one set, so explicit
`cache.k_codec`/`cache.v_codec` from any layer beat `cache.codec` from any layer. Rows
record the composed config (what ran) and the setting's name in `variant.setting`.
`kvjax run FILE --dry-run` lists the cells with their resolved cache settings.

Results go to OUT/<experiment>.jsonl, one JSON row per line (each ending in a CRC-32 of
itself), flushed as written. A cell is identified by the hash of its resolved config (grid
removed) and counts as done only when all of its rows are in the folder, so a rerun skips
finished cells, and a run killed mid-cell leaves no half cell counted as done: on the next
run, torn or corrupt lines and partial cells are dropped (the file is rewritten atomically,
what it drops kept in OUT/<experiment>.jsonl.rejected, one warning line naming the line
numbers) and that cell runs again. Runs that share a folder claim cells under advisory locks
and never duplicate a row; `--shard I/N` runs one part of the grid into
OUT/<experiment>.shard-I-of-N.jsonl, and readers merge the files (the first complete row of
a cell wins).

This package face re-exports the public names of its modules: `grid` (experiments, grid
axes, paired settings, cells), `rows` (reading, checking, repairing and writing results
files), `claims` (the folder's locks), `shard` (`--shard` parts and their files), `table`
(flattened records and the summary table) and `run` (`run_file`, `dry_run`); `results` is
`kvjax results`.
"""

from kvjax.lab.runner.grid import (
    Cell, available_experiments, compose, coords_str, expand, load_experiment, setting_overrides)
from kvjax.lab.runner.rows import (
    check_rows, clean, complete_rows, encode, json_default, read_rows, repair, scan)
from kvjax.lab.runner.run import CELL_CACHE_KEYS, cell_record, dry_run, run_file
from kvjax.lab.runner.table import TABLE_METRICS, cell_text, flatten, format_table, is_seconds

__all__ = ["CELL_CACHE_KEYS", "TABLE_METRICS", "Cell", "available_experiments", "cell_record",
           "cell_text", "check_rows", "clean", "complete_rows", "compose", "coords_str",
           "dry_run", "encode", "expand", "flatten", "format_table", "is_seconds", "json_default",
           "load_experiment", "read_rows", "repair", "run_file", "scan", "setting_overrides"]
