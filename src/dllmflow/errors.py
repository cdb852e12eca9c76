"""User-facing errors: bad input that the CLI reports as one clear line (exit code 2), no traceback."""


class UserError(Exception):
    """Bad input (a file, a field, a flag, a server): the message names it and the fix."""
