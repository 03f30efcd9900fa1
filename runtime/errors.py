"""The one error type the CLI turns into a single line on stderr and a non-zero exit."""


class LowbitError(Exception):
    """A user-facing failure: bad file, unknown model, bad flag value. The message is one line
    that names what was wrong (file, tensor, type) — the CLI prints it as is, with no traceback."""
