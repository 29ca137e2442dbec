"""Fixtures shared by this repository's tests.

jax, flax and the harness are imported here, when the session starts: pytester's in-process runs
forget every module imported after the `pytester` fixture was set up, jaxlib's native extension
aborts the process when it is imported a second time, and a re-imported flax would make two
`nn.Module` classes.
"""

import flax.linen  # noqa: F401
import flax.nnx  # noqa: F401
import jax  # noqa: F401
import optax  # noqa: F401

import sharding_dump.commands.verify  # noqa: F401
import sharding_dump.zoo.dump  # noqa: F401
