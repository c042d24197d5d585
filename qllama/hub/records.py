"""The hub's records and errors, shared by reference resolution (`refs`) and downloads (`download`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import QllamaError


class HubError(QllamaError):
    """A reference that cannot be resolved or downloaded (one line; the hub's reason included)."""


class HubUnreachable(HubError):
    """The hub could not be asked (no network, offline mode, a timeout)."""


@dataclass(frozen=True)
class HubRef:
    """A model on the hub: repo id, and a quant tag or a file path (or neither), at a revision."""

    repo: str
    tag: str | None = None
    filename: str | None = None
    revision: str = "main"

    def __str__(self) -> str:
        rev = "" if self.revision == "main" else f"@{self.revision}"
        if self.filename:
            return f"{self.repo}{rev}/{self.filename}"
        return f"{self.repo}{rev}" + (f":{self.tag}" if self.tag else "")


@dataclass
class CachedModel:
    """A model file in the cache: `path` (first shard) and every shard's path."""

    ref: HubRef  # with the exact filename
    commit: str
    paths: list[str] = field(default_factory=list)
    downloaded: bool = False  # something was fetched by this call

    @property
    def path(self) -> str:
        return self.paths[0]

    @property
    def size(self) -> int:
        return sum(os.path.getsize(p) for p in self.paths)


def hf_module():
    """huggingface_hub, imported on first use."""
    import huggingface_hub  # lazily: ~0.3 s, and only hub references need it
    import huggingface_hub.constants
    import huggingface_hub.errors
    import huggingface_hub.utils

    return huggingface_hub
