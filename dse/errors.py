"""The one exception type a user can cause.

Every error that bad input can trigger (unknown model or chip, malformed topology, infeasible
model, out-of-range sequence length, unreadable file) is raised as :class:`NeuScaleError` with a
message that names what to change. The CLI prints the message alone (no traceback) and exits 2.
"""


class NeuScaleError(ValueError):
    """A user-facing error: the message says what is wrong and what to change."""
