"""The `pytest11` entry point `sharding_dump`: it loads :mod:`sharding_dump.pytest_plugin` by name.

Why a module of its own: pytest registers an entry point's module under the entry point's name, and
refuses the same module under a second name. Pointed at the plugin itself, the name `sharding_dump`
would make a conftest's `pytest_plugins = ["sharding_dump.pytest_plugin"]` (or `-p
sharding_dump.pytest_plugin`) fail at start-up; loaded through `pytest_plugins` here, the plugin is
registered under its module name and such a line is a no-op. `pytest -p no:sharding_dump` blocks this
module, so the plugin is not loaded at all.
"""

pytest_plugins = ["sharding_dump.pytest_plugin"]
