"""Activation constraints for the built-in models: the core's capture, under the name the zoo uses.

Models call :func:`constrain` (a named `nn.with_logical_constraint`); any other Flax model's own
`nn.with_logical_constraint` and `jax.lax.with_sharding_constraint` calls are captured too. See
:mod:`sharding_dump.core.capture`.
"""

from sharding_dump.core.capture import (  # noqa: F401
    BACKWARD, FORWARD, CallSite, Constraint, Recording, constrain, equations, module_prefix, read_constraints,
    recording, unrecorded_constraints)
