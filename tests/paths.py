"""Where the tests find the repository and their data, wherever a test file sits."""

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT / "tests" / "data"
