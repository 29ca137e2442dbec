"""The model-agnostic core: abstract state, leaf layouts, activation constraints, golden documents.

Nothing here knows about model cards, topologies or the case matrix: it takes the user's own model
(a Flax linen module or an NNX module factory), optimizer, mesh and logical axis rules. The CLI, the
pytest plugin and the built-in model zoo are clients of it. Modules:

* :mod:`specs`: the one partition-spec normaliser (no jax import);
* :mod:`state`: the abstract training state of any model and optax optimizer;
* :mod:`layout`: the layout of every leaf on a mesh under a rule set;
* :mod:`capture`: activation constraints (and shardings carried in types) met while tracing any function;
* :mod:`step`: a next-token training step for any causal LM;
* :mod:`program`: the training program a user gives: a model and how to call it, or their own
  init and step;
* :mod:`handback`: what a traced program decides about its own arrays: its mesh, the layout it takes
  its inputs in, the layout it hands its state back in;
* :mod:`documents`: the golden JSON documents of those layouts.
* :mod:`gc_policy`: fewer garbage collections while models are traced (no jax import).
"""
