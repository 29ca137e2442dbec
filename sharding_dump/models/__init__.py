"""The zoo's Flax decoders: one module per family, each a DecoderLM subclass that names the decoder
block it builds from a :class:`ModelConfig` (which card fields it reads, which it requires).

Flax is imported by the family modules, not here, so the card registry
(:mod:`sharding_dump.zoo.cards`) can read ModelConfig without it.

>>> sorted(name for name, _ in shipped_families())[:3]
['deepseek', 'gemma', 'gemma2']
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Iterator

from sharding_dump.models.config import ModelConfig

__all__ = ["ModelConfig", "shipped_families"]


def shipped_families() -> list[tuple[str, type]]:
    """(decoder block, DecoderLM subclass) of every family module of this package, in class order: a
    new family is its module (and a card), found here without a list to edit."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    from sharding_dump.models.decoder import DecoderLM

    return [(vars(family)["decoder_block"], family) for family in dict.fromkeys(_subclasses(DecoderLM))
            if "decoder_block" in vars(family) and family.__module__.startswith(f"{__name__}.")]


def _subclasses(cls: type) -> Iterator[type]:
    """Every subclass of `cls`, of every generation."""
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)
