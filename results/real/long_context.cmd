# results/real/long_context.jsonl was written by (from the repository root, SmolLM2 installed with `make models`):
nice -n 10 kvjax run configs/long_context.yaml --out results/real
# Run twice on 2026-11-30 on a shared 2-core CPU; the second run resumed where the first was stopped:
#   1k and 2k cells at commit 22be7c4 (cache capacity = the context),
#   4k and 8k cells at commit 7046089 (cache capacity = the model's 8192-token window for every context,
#   so each setting compiles once; attention reads only the live length, so the computation is the same).
# Plots: python scripts/plot_all.py results/real --out docs/img
