"""The repository root, for every test (``ROOT``, a Path; ``REPO``, the same as a str); the
data-preparation tests import the scripts as the package ``scripts``, e.g. ``from scripts.data
import prepare_enwik8``."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
REPO = str(ROOT)
