"""Every committed results file is regenerable: results/MANIFEST.yaml records the command
that makes it, each `kvjax run` file's config hashes are cells of its config as committed
now, and `make reproduce` (scripts/reproduce.sh) runs exactly the recorded commands."""

import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def manifest():
  spec = importlib.util.spec_from_file_location("manifest", ROOT / "scripts" / "manifest.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_every_results_file_matches_its_manifest_entry_and_config(manifest):
  """Config hashes of every row against the committed configs, rows/commits/machines
  against the file, and every file under results/ listed (and nothing else)."""
  assert manifest.check() == []


def test_every_run_file_has_one_recorded_config_and_command(manifest):
  man = manifest.load()
  runs = {name: e for name, e in man.items() if "config" in e}
  assert {"results/quality.jsonl", "results/uptrain.jsonl",
          "results/cpu/roofline.jsonl"} <= set(runs)
  for name, entry in runs.items():
    assert (ROOT / entry["config"]).is_file()
    assert not entry["config"].startswith("/") and entry["out"].startswith("results")
    assert manifest.commands(entry) == list(entry.get("before", [])) + [
        f"kvjax run {entry['config']} --out {entry['out']}"
        + "".join(f" --set {shlex.quote(s)}" for s in sets)  # a shell's
        for sets in manifest.slices(entry)]
    assert ("set" in entry) + ("slices" in entry) <= 1, name  # one way to say the cells
  # the converted checkpoints a quality config reads are made by its `before` commands
  conv = runs["results/real_models/convert_smollm2/quality.jsonl"]
  assert all(c.split()[:2] == ["kvjax", "convert"] for c in conv["before"])
  import yaml
  settings = yaml.safe_load((ROOT / conv["config"]).read_text())["params"]["settings"]
  made = {c.split("--out ")[1].split()[0] for c in conv["before"]}
  read = {s["params.converted"] for s in settings.values() if "params.converted" in s}
  assert read and read <= made, f"checkpoints read without a command that makes them: {read - made}"


def test_reproduce_runs_exactly_the_recorded_commands(tmp_path, manifest):
  """reproduce.sh with `kvjax` and `python` replaced by a recorder: the commands it runs are
  the manifest's, under the chosen results folder (checkpoints present: no training)."""
  log = tmp_path / "ran.txt"
  fake = tmp_path / "fake"
  fake.write_text(f"#!/bin/bash\necho \"kvjax ${{*:2}}\" >> {log}\n")
  fake.chmod(0o755)
  python = tmp_path / "python"
  python.write_text(f"#!/bin/bash\nif [ \"$1\" = scripts/manifest.py ] && [ \"$2\" = commands ]; "
                    f"then exec {sys.executable} \"$@\"; fi\necho \"python $*\" >> {log}\n")
  python.chmod(0o755)
  out = tmp_path / "regen"
  env = {**os.environ, "KVJAX": f"{fake} kvjax-bin", "PYTHON": str(python)}
  only = ["results/cpu/roofline.jsonl", "results/cpu/xla_cpu.jsonl"]
  proc = subprocess.run(["bash", "scripts/reproduce.sh", str(out), str(tmp_path / "plots"),
                         *only], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stderr
  ran = log.read_text().splitlines()
  want = [c for name in sorted(only) for c in manifest.commands(manifest.load()[name], str(out))]
  ran_cmds = [line for line in ran if not line.startswith("kvjax plot ")
              and "compare" not in line]
  assert sorted(ran_cmds) == sorted(want)
  assert f"kvjax plot {out} --out {tmp_path / 'plots'}" in ran
  assert any("compare" in line for line in ran)


def test_compare_accepts_the_same_structure_and_flags_a_different_one(tmp_path, manifest):
  regen = tmp_path / "regen"
  shutil.copytree(ROOT / "results", regen)
  name = "results/cpu/roofline.jsonl"
  assert manifest.compare(regen, [name]) == []
  rows = manifest.rows(regen / "cpu" / "roofline.jsonl")
  rows[0]["metrics"]["new_metric"] = 1.0
  (regen / "cpu" / "roofline.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:-1]))
  problems = manifest.compare(regen, [name])
  assert any("rows regenerated" in p for p in problems)
  assert any("other fields" in p for p in problems)


def test_check_flags_rows_of_a_config_that_changed(tmp_path, manifest, monkeypatch):
  """A row whose config hash is no cell of the committed config is reported (as the
  quality/uptrain rows made with /tmp checkpoint paths were)."""
  entry = manifest.load()["results/cpu/roofline.jsonl"]
  monkeypatch.setattr(manifest, "expected_hashes", lambda e: set(entry["config_hashes"][1:]))
  problems = [p for p in manifest.check() if p.startswith("results/cpu/roofline.jsonl")]
  assert len(problems) == 1 and "no cell of configs/roofline.yaml" in problems[0]


def test_an_entry_of_slices_expects_the_union_of_their_cells(manifest):
  """Cells committed as two slices of one grid (filled in two sessions): a command each,
  and the expected cells are both slices' (a file holding one slice only misses cells)."""
  entry = {"config": "configs/ruler_qwen.yaml", "out": "results/real_models/ruler_qwen",
           "slices": [["grid.params.context=[8192]", "grid.params.sample=[0,1]"],
                      ["grid.params.context=[8192]", "grid.params.sample=[2]",
                       "grid.params.task=[vt]"]]}
  assert [c.split("--set ", 1)[1] for c in manifest.commands(entry)] == [
      "'grid.params.context=[8192]' --set 'grid.params.sample=[0,1]'",
      "'grid.params.context=[8192]' --set 'grid.params.sample=[2]' --set 'grid.params.task=[vt]'"]
  first = manifest.expected_hashes({**entry, "slices": entry["slices"][:1]})
  both = manifest.expected_hashes(entry)
  assert len(first) == 22 and len(both) == 23 and first < both


def test_a_live_runs_hidden_state_is_not_a_results_file(manifest, tmp_path, monkeypatch):
  base = tmp_path / "results"
  for rel in ("a/rows.jsonl", "a/.kvjax-partial/abc/x.npz", "a/.kvjax-locks/l", "tmp1/x"):
    (base / rel).parent.mkdir(parents=True, exist_ok=True)
    (base / rel).write_text("")
  monkeypatch.setattr(manifest, "ROOT", tmp_path)
  assert manifest.results_files() == {"results/a/rows.jsonl"}
