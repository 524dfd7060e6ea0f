"""Shared by the data-preparation tests: the repository root (the scripts are imported as the
package ``scripts``, e.g. ``from scripts.data import prepare_enwik8``)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
