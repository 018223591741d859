"""User-facing errors: one clear line and an exit code, never a traceback."""


class SpecopsError(Exception):
    """Something the user can fix; the message says what is wrong and what to do."""

    exit_code = 1

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class InventoryError(SpecopsError):
    """The inventory is malformed or names something that does not exist."""

    exit_code = 2


class HostError(SpecopsError):
    """A host could not be reached, refused us, or a command on it failed."""
