"""Chat templates (step 1 of the split: the old module, moved as is)."""

from .sandbox import *  # noqa: F401,F403
from .sandbox import __all__, _check_jinja2_version  # noqa: F401
