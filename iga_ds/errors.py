"""Errors that reach the user as one line and a non-zero exit, never a traceback."""
from __future__ import annotations


class UserError(Exception):
    """Bad input (file, line, field, config key): the message says where and what was expected."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


class ConfigError(UserError):
    """A configuration key is missing, unknown or of the wrong type."""


class DataError(UserError):
    """A data file does not follow the expected layout."""
