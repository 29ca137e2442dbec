"""Differences of two golden documents, found without a diff library: every changed field of a
tensor, a header mapping's changed key as `a.b`, and JSON's own distinctions (1 and 1.0, true and 1)."""

from sharding_dump.golden.diff import diff_documents


def test_every_difference_is_found_at_its_field():
    old = {"kind": "named", "mesh": {"shape": {"fsdp": 8}, "axes": ["fsdp"]}, "per_device_bytes": {"total": 1},
           "tensors": {"params/a": {"shape": [8], "partition_spec": ["fsdp"]}, "params/b": {"shape": [4]},
                       "params/gone": {"shape": [1]}}}
    new = {"kind": "named", "mesh": {"shape": {"fsdp": 8}, "axes": ["fsdp", "tp"]}, "per_device_bytes": {"total": 1.0},
           "tensors": {"params/a": {"shape": [8], "partition_spec": [None]}, "params/b": {"shape": [4], "dtype": "f32"},
                       "params/new": {"shape": [2]}}}
    diff = diff_documents(old, new)
    assert diff.changed == {"params/a": {"partition_spec": (["fsdp"], [None])}, "params/b": {"dtype": (None, "f32")}}
    assert diff.added == {"params/new": {"shape": [2]}} and diff.removed == {"params/gone": {"shape": [1]}}
    assert diff.header == {"mesh.axes": (["fsdp"], ["fsdp", "tp"]), "per_device_bytes.total": (1, 1.0)}
    assert not diff_documents(old, old) and not diff_documents(new, dict(new))
    assert diff_documents({"tensors": {"x": {"on": True}}}, {"tensors": {"x": {"on": 1}}}).changed == \
        {"x": {"on": (True, 1)}}
