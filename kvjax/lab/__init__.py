"""The lab: what measures the library and reports it.

Experiments and their runner (`kvjax run`), plots (`kvjax plot`), the long-context tasks,
metrics and intervals, results files and figures, evaluation (`kvjax eval`, `--ref`),
training and conversion (`kvjax train`, `kvjax convert`), sizing reports (`kvjax size`) and
the serving bench. It imports the library (kvjax.model, cache, codecs, attention, policies,
config, io, decode); the library never imports it (tests/test_structure.py).
"""
