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
import re
from typing import Iterator

from sharding_dump.models.config import ModelConfig

__all__ = ["ModelConfig", "family_of", "shipped_families"]


def shipped_families() -> list[tuple[str, type]]:
    """(decoder block, DecoderLM subclass) of every family module of this package, in class order: a
    new family is its module (and a card), found here without a list to edit."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")
    from sharding_dump.models.decoder import DecoderLM

    return [(vars(family)["decoder_block"], family) for family in dict.fromkeys(_subclasses(DecoderLM))
            if "decoder_block" in vars(family) and family.__module__.startswith(f"{__name__}.")]


def family_of(block: str) -> type | None:
    """The DecoderLM subclass that names decoder block `block`, importing only the family module whose
    source declares it (a dump of one card loads its own family, not every one); None when the source
    does not point at exactly one module, or that module's classes do not name the block after all
    (the caller then asks :func:`shipped_families`, which imports them all)."""
    declared = re.compile(rf"^\s+decoder_block\s*=\s*[\"']{re.escape(block)}[\"']\s*$", re.M)
    found = []
    for module in pkgutil.iter_modules(__path__):
        try:
            source = (pkgutil.get_data(__name__, f"{module.name}.py") or b"").decode("utf-8")
        except (OSError, UnicodeDecodeError):
            return None
        if declared.search(source):
            found.append(module.name)
    if len(found) != 1:
        return None
    from sharding_dump.models.decoder import DecoderLM

    namespace = vars(importlib.import_module(f"{__name__}.{found[0]}"))
    classes = [cls for cls in namespace.values() if isinstance(cls, type) and issubclass(cls, DecoderLM)
               and vars(cls).get("decoder_block") == block and cls.__module__ == f"{__name__}.{found[0]}"]
    return classes[0] if len(classes) == 1 else None


def _subclasses(cls: type) -> Iterator[type]:
    """Every subclass of `cls`, of every generation."""
    for sub in cls.__subclasses__():
        yield sub
        yield from _subclasses(sub)
