"""Paths the tests share, the same from whichever subfolder of tests/ a module sits in (a module's
own `Path(__file__).parents[...]` would change meaning when it moves)."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
FIXTURES = TESTS / "fixtures"
