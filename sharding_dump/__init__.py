"""sharding-dump: golden tests for how a JAX/Flax model's training state is split over a mesh.

The public API is small and model-agnostic; everything is imported on first use, so
`import sharding_dump` loads neither jax nor flax and changes nothing in the process::

    import sharding_dump as sd
    docs = sd.dump_model(my_lm, mesh, rules, batch_shape=(8, 2048))   # {file name: JSON document}
    sd.check_or_update_folder("golden/my_lm", docs, update=False)     # Outcome: match | differs | missing

Pieces, for your own step or state:

* :class:`ModelProgram`, :class:`TrainProgram`, :class:`Input`: the training program a factory returns
  (the model and how to call it, or the user's own init and step);
* :class:`ServingProgram`, :class:`ServingStep`, :class:`ServingSettings`: a serving program (init of
  weights and KV cache at the case's slots and lengths, and named steps: prefill, insert, generate);
* :func:`abstract_train_state`, :func:`as_model`, :func:`parameter_count`: the abstract state;
* :func:`tensor_layouts` / :func:`leaf_layout`: every leaf's layout on a mesh under a rule set
  (:class:`Rules`: logical axis rules, and :class:`PathRule` regexes for weights without logical axes);
* :func:`record_activations`, :func:`constrain`: activation constraints met while tracing;
* :func:`golden_documents`, :func:`check_or_update_folder`: golden JSON and the check-or-update engine;
* :class:`Case` and :func:`load_matrix`: a case of the built-in zoo (or of your factory) for the
  `sharding_golden` pytest fixture;
* :class:`BadInput` (one line; when the user's code failed, what it raised is its `__cause__`) and
  :func:`traceback_text`, that failure's whole traceback.

Everything else (the zoo's settings, meshes, rules, the commands) is internal: see the docs' Layout page (docs/maintainers/layout.md).
"""

from __future__ import annotations

import importlib
from typing import Any

DISTRIBUTION = "sharding-dump"

_EXPORTS = {
    "abstract_train_state": "sharding_dump.core.state",
    "as_model": "sharding_dump.core.state",
    "default_optimizer": "sharding_dump.core.state",
    "parameter_count": "sharding_dump.core.state",
    "Model": "sharding_dump.core.state",
    "TensorLayout": "sharding_dump.core.layout",
    "leaf_layout": "sharding_dump.core.layout",
    "tensor_layouts": "sharding_dump.core.layout",
    "resolve": "sharding_dump.core.layout",
    "Rules": "sharding_dump.core.layout",
    "PathRule": "sharding_dump.core.specs",
    "constrain": "sharding_dump.core.capture",
    "record_activations": "sharding_dump.core.capture",
    "recording": "sharding_dump.core.capture",
    "read_constraints": "sharding_dump.core.capture",
    "Constraint": "sharding_dump.core.capture",
    "next_token_step": "sharding_dump.core.step",
    "ModelProgram": "sharding_dump.core.program",
    "TrainProgram": "sharding_dump.core.program",
    "Input": "sharding_dump.core.program",
    "ServingProgram": "sharding_dump.core.program",
    "ServingStep": "sharding_dump.core.program",
    "ServingSettings": "sharding_dump.core.program",
    "ProgramError": "sharding_dump.core.program",
    "golden_documents": "sharding_dump.core.documents",
    "dump_model": "sharding_dump.core.model_dump",
    "spec_to_json": "sharding_dump.core.specs",
    "check_or_update_folder": "sharding_dump.golden.engine",
    "Outcome": "sharding_dump.golden.engine",
    "BadInput": "sharding_dump.errors",
    "traceback_text": "sharding_dump.errors",
    "Case": "sharding_dump.zoo.case",
    "load_matrix": "sharding_dump.zoo.matrix",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # written once, in pyproject.toml: read from the installed metadata on first use
        from importlib import metadata

        try:
            value = metadata.version(DISTRIBUTION)
        except metadata.PackageNotFoundError:  # a checkout on sys.path that was never installed
            value = "unknown"
        globals()[name] = value
        return value
    if name not in _EXPORTS:
        raise AttributeError(f"module 'sharding_dump' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
