"""``python -m app serve ...``: see ``app.cli``."""

from app.cli import main

main()
