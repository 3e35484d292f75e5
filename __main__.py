"""``python -m tidal serve ...``: see ``tidal.app.cli``."""

from tidal.app.cli import main

main()
