"""The one exception type for mistakes a user can fix (config, paths, data, layout).

Entry points catch it, print its message as one paragraph and exit non-zero without a traceback.
Anything else that escapes is a bug and keeps its traceback.
"""


class UserError(ValueError):
    """A problem in the user's input: the message names the key or path, the value and the fix."""


class TrainingStopped(RuntimeError):
    """The run stopped on purpose (e.g. the non-finite loss policy); the message says why and what to change."""
