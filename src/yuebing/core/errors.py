"""Exception hierarchy. Every runtime failure the user can cause or see is a `YuebingError`
subclass with a message that says what happened and what to change."""


class YuebingError(Exception):
    """Base of all project errors."""


class ConfigError(YuebingError, ValueError):
    """An invalid configuration value; the message names the field and the accepted range."""


class InputError(YuebingError, ValueError):
    """Bad input at a boundary (file, CLI, HTTP, RPC); nothing was changed."""


class PrefixMissing(InputError):
    """A pipeline stage holds less of a prompt's prefix than its group planned to reuse."""


class TraceFormatError(InputError):
    """A malformed trace file; the message names file, line and field."""

    def __init__(self, path: str, line: int, field: str, problem: str) -> None:
        self.path, self.line, self.field = path, line, field
        super().__init__(f"{path}:{line}: field {field!r}: {problem}")


class TransferError(YuebingError):
    """A transfer failed (peer dead, timeout, access out of range)."""


class StoreError(YuebingError):
    """A store operation failed."""


class EngineError(YuebingError):
    """The inference engine refused or failed a request."""
