"""Loads the sharding-dump pytest plugin for this repository's tests."""

pytest_plugins = ["sharding_dump.pytest_plugin"]
