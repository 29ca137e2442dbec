"""The `sharding-dump` command: one module per subcommand, each with `add_arguments` and `run`."""
