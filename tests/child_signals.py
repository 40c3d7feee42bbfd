"""For tests that stop a child `moebench` with SIGINT as a user's Ctrl-C would."""

import signal


def interruptible() -> None:
    """preexec_fn: SIGINT back to its default in the child. Under a shell's background job pytest
    inherits SIGINT ignored, its children too, and Python installs no KeyboardInterrupt handler for
    an ignored SIGINT: the test's Ctrl-C would then never reach the run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
