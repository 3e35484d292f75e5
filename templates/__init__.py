"""Jinja2 templates shipped with tidal: fallback chat templates and the web chat page."""

from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parent
