"""Errors a user can fix: the CLI prints them as one line and exits 2."""


class MoebenchError(Exception):
    """Bad input (file, checkpoint, data row, option). The message names the file and the problem."""


class ActivationError(MoebenchError):
    """A switched-on optimization left no evidence that it ran."""
