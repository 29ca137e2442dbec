"""One leaf-path format: a state's key paths as jax writes them (what MaxText's dump keys by), read by
`core.specs.leaf_path`, are the paths our goldens write (`core.tree.path_text`)."""

from __future__ import annotations

import json

import jax

from helpers import LINEN, linen_golden, linen_matrix
from sharding_dump.core.specs import leaf_path
from sharding_dump.core.tree import is_box, path_text
from sharding_dump.zoo import state
from sharding_dump.zoo.case import Case
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
    # The Linen build's golden: this state's layout as it is (the NNX build reassembles it, zoo.dump.maxtext_state).
    linen = next(folder for folder, c in linen_matrix().items() if c == Case.make(
        case.model, case.topology, case.rule, case.num_slices, {**dict(case.overrides), **LINEN}))
    named = json.loads((linen_golden(linen) / "named_shardings.json").read_text())
    assert sorted(ours for _, ours in pairs) == sorted(named["tensors"])
