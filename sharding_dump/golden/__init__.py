"""Golden files as bytes on disk: canonical JSON and schemas (:mod:`codec`), atomic case folders
(:mod:`store`), per-tensor differences (:mod:`diff`), the one check-or-update engine (:mod:`engine`)
and stale paths (:mod:`stale`). Nothing here imports jax: `sharding-dump diff` runs without it."""
