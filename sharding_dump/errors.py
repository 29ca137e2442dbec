"""The one error type users see.

Anything a user can get wrong (a name, a file, a value) raises :class:`BadInput` with a single line
that names the file, field or value and says what would be valid. The CLI prints that line and exits
with status 2; nothing is written once a BadInput has been raised.
"""


class BadInput(Exception):
    """A user-facing input error: one line, no traceback, exit status 2."""


class UnevenSplitWarning(UserWarning):
    """A dumped case has leaves that do not split evenly over their mesh axes: XLA pads the last shard.
    The dump still succeeds (exit 0); the CLI prints it as one `sharding-dump: warning:` line."""
