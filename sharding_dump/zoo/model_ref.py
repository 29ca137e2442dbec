"""How a case names its model: a shipped card, or a factory in the user's own code.

* `llama2-7b`: a model card shipped with the package (or registered by an installed package);
* `path/to/card.yml` (or `.yaml`): a card file of the user's, named by its `name` field;
* `package.module:factory`: a zero-argument callable in the user's code returning a Flax linen
  module or an NNX module (or a factory of one), called as `module(tokens)` (plus the positions when
  its `__call__` takes them) and returning logits `[batch, length, vocab]`; or returning a training
  program (`sharding_dump.ModelProgram`: the model and how to call it; `sharding_dump.TrainProgram`:
  the user's own init and step), see :mod:`sharding_dump.core.program`;
* `NAME=package.module:factory`: the same factory, called NAME (what a project's
  `models = {NAME = "package.module:factory"}` stands for), so moving the factory renames nothing.

A card's golden folder is its card name (lower-case letters, digits, `.` and `-`, by the card schema);
a named factory's is its NAME; an unnamed factory's is its reference with `:` replaced by `-`
(`examples.linen_lm-tiny_lm`). Letters, digits, `.`, `_` and `-` only, so no name from the command
line can leave the golden tree. The working directory is importable, as for `python -m`.

>>> ref = parse_model_ref("examples.linen_lm:tiny_lm")
>>> ref.kind, ref.folder_name
('factory', 'examples.linen_lm-tiny_lm')
>>> parse_model_ref("tiny=examples.linen_lm:tiny_lm").folder_name
'tiny'
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
from typing import TYPE_CHECKING, Any, Callable

from sharding_dump.core.boundary import guard
from sharding_dump.errors import BadInput, one_line, shown
from sharding_dump.zoo.cards import card_files, resolve_model
from sharding_dump.zoo.settings import MAX_REF, REFERENCE

if TYPE_CHECKING:
    from sharding_dump.core.program import Program


@dataclasses.dataclass(frozen=True)
class ModelRef:
    """A validated model reference: `kind` is card or factory; `label` goes into golden headers."""

    text: str
    kind: str
    name: str = ""  # a card's `name` field (a card given by path is called by it), or a factory's NAME

    @property
    def label(self) -> str:
        return self.name or self.text

    @property
    def folder_name(self) -> str:
        """The model's folder in the golden tree: the one place a model's name becomes a path."""
        return self.name or self.text.replace(":", "-")


def is_factory_ref(text: str) -> bool:
    """True for `package.module:factory` (a colon and no path separator)."""
    return ":" in text and "/" not in text and "\\" not in text


def parse_model_ref(text: str) -> ModelRef:
    """Checks a `--model` value: a known card name or a well-formed factory reference."""
    shown = text if len(text) <= 80 else text[:77] + "..."
    if is_factory_ref(text):
        match = REFERENCE.fullmatch(text) if len(text) <= MAX_REF else None
        if match is None:
            raise BadInput(f"model {shown!r}: a factory is written package.module:function or "
                           f"NAME=package.module:function (identifiers joined by '.', NAME of letters, digits, "
                           f"'.', '_' and '-', at most {MAX_REF} characters)")
        if match["name"] and match["name"] in _card_names():
            raise BadInput(f"model {shown!r}: {match['name']!r} is the name of a model card; name the factory "
                           "differently")
        return ModelRef(text, "factory", match["name"] or "")
    name, _ = resolve_model(text)
    return ModelRef(text, "card", name)


def _card_names() -> set[str]:
    return set(card_files())


def load_reference(text: str, what: str = "model") -> Callable[..., Any]:
    """The callable a `package.module:function` reference names; BadInput (one line, naming `what`
    the reference was given as: model, optimizer) when it cannot be imported."""
    match = REFERENCE.fullmatch(text)
    if match is None:
        raise BadInput(f"{what} {shown(text)}: not a reference to a function (package.module:function)")
    module_name, attr = match["module"], match["attr"]
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        with guard(f"importing {module_name} (for {what} {text})"):
            try:
                module = importlib.import_module(module_name)
            except ImportError as err:
                if err.name is None or not (module_name + ".").startswith(err.name + "."):
                    raise  # an import inside the module failed: the user's code, told with its file and line
                raise BadInput(f"{what} {text!r}: cannot import {module_name} ({one_line(str(err))})") from None
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)
    obj: Any = module
    for part in attr.split("."):
        with guard(f"reading {attr} of {module_name} (for {what} {text})"):
            found = hasattr(obj, part)
            obj = getattr(obj, part) if found else None
        if not found:
            raise BadInput(f"{what} {text!r}: {module_name} has no attribute {attr!r}")
    if not callable(obj):
        raise BadInput(f"{what} {text!r}: {attr} is a {type(obj).__name__}, not a callable returning "
                       f"{'a model' if what == 'model' else 'an ' + what}")
    return obj


def load_factory(text: str) -> Callable[[], Any]:
    """The callable a factory reference names; BadInput (one line) when it cannot be imported."""
    return load_reference(text, "model")


@functools.lru_cache(maxsize=16)
def factory_program(ref: str) -> Program:
    """The user's program behind a factory reference (a module or module factory is the simplest one),
    built once per process (abstractly)."""
    from sharding_dump.core.program import as_program

    return as_program(load_factory(ref), ref)
