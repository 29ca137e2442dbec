"""One leaf-path format: a state's key paths as jax writes them (what MaxText's dump keys by), read by
`core.specs.leaf_path`, are the paths our goldens write (`core.tree.path_text`)."""

from __future__ import annotations

import jax

from helpers import committed_golden
from sharding_dump.core.specs import leaf_path
from sharding_dump.core.tree import is_box, path_text
from sharding_dump.zoo import state
from sharding_dump.zoo.dump import setup_case
from sharding_dump.zoo.matrix import load_matrix


def test_jax_key_text_of_our_state_reads_as_our_golden_paths():
    """The zoo's state of a circular pipeline (dict keys, optax's attributes, chain indices, a stage of
    `layers_<k>`, layers left out): every key path, written as jax writes it, reads back as its golden path."""
    case = next(c for c in load_matrix() if c.model == "qwen3-0.6b" and "num_layers_per_pipeline_stage" in dict(c.overrides))
    setup = setup_case(case)
    boxed = state.abstract_state(setup.config, pipeline=setup.pipeline)
    pairs = [(leaf_path("/".join(str(key) for key in key_path)), path_text(key_path))
             for key_path, _ in jax.tree_util.tree_leaves_with_path(boxed, is_leaf=is_box)]
    assert [read for read, _ in pairs] == [ours for _, ours in pairs]
    assert sorted(ours for _, ours in pairs) == sorted(committed_golden(case, "named_shardings.json")["tensors"])
