"""Typed errors of the circuit engine.

Every error says what was expected and what was given ("head L3H0 out of range: the model has 2 layers").
The app maps each class to an HTTP status once (app/errors.py); notebooks see plain exceptions.
"""


class QkovError(Exception):
    """Base class of every error the engine raises on purpose."""


class NotFoundError(QkovError, LookupError):
    """Something named does not exist: a model, a head, a token, a detector."""


class InvalidInputError(QkovError, ValueError):
    """An argument is malformed or inconsistent with the model (wrong shape, bad range)."""


class LimitExceededError(QkovError, ValueError):
    """A request is well formed but bigger than a configured budget (tokens, k, bytes)."""


class CheckpointError(QkovError):
    """A checkpoint folder cannot be loaded: names the file and the problem."""


class CancelledError(QkovError):
    """A long computation noticed its stop flag and gave up."""
