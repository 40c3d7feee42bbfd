"""Errors a user can fix: the CLI prints them as one line and exits 2."""


class MoebenchError(Exception):
    """Bad input (file, checkpoint, data row, option). The message names the file and the problem."""


class ActivationError(MoebenchError):
    """A switched-on optimization left no evidence that it ran."""


def describe_os_error(e: OSError) -> str:
    """One line for an OSError: the file, the system's reason, and for a full disk what to do."""
    import errno

    where = f"{e.filename}: " if e.filename else ""
    reason = e.strerror or str(e)
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        reason += " (free space or raise the file-size limit)"
    return where + reason
