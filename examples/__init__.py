"""Worked examples: your own model under sharding-dump (not imported by the package)."""
