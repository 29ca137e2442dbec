"""The installed MaxText's own code as the program: its config composition, model, optimizer,
abstract state, shardings and train step, dumped to the same golden files the zoo writes.

MaxText is never a dependency of the package: :mod:`sharding_dump.maxtext.program` imports it when a
case is dumped, and its absence is one error line. :mod:`sharding_dump.maxtext.case` (no jax, no
MaxText) names the cases and their golden folders. See docs/guide/guard-your-maxtext.md.
"""
