"""Conversions between attention variants of the same weights, one module per method:

    pool       fewer KV heads by mean-pooling each group; more by exact expansion (`pool`)
    align      each group's heads rotated onto its first before pooling, exactly (`align`)
    fit        aligned and pooled, then each layer's q/k/v fitted to the original's
               attention on calibration text (`fit`, one layer at a time: `layerwise`)
    distill    a converted model's q/k/v/o trained end to end toward the original's
               next-token distributions, KL on calibration text (`distill`)

`kvjax convert` (`cli`) is the front door; it writes an orbax checkpoint recording the
recipe, which every command then takes as `checkpoint:DIR`. With `--latent-rank R` the K/V
projections become rank R for the latent (MLA-style) cache: `--method pool` by the
weights' SVD (`kvjax.cache.latent.factor`), `--method fit` from the calibration keys and
values, then fitted layer by layer (`latent`).
"""

from kvjax.lab.convert.pool import check_target, expand, mean_pool

METHODS = ("pool", "align", "fit", "distill")  # kvjax convert --method (listed by the CLI)

__all__ = ["METHODS", "check_target", "expand", "mean_pool"]
