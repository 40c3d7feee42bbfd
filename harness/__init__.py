"""moebench: prove that a mixture-of-experts optimization is faster without changing answers."""

__version__ = "0.1.0"
