"""The built-in zoo: a case (model, topology, rule, settings) turned into golden documents.

A client of :mod:`sharding_dump.core` (layouts, capture, documents), :mod:`sharding_dump.models`
(the Flax decoders) and :mod:`sharding_dump.golden` (golden folders)."""
