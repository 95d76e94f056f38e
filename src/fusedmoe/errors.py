"""Errors a user can see, each carrying what is needed to act on it."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fusedmoe.oracle import Verdict


class BackendRequestError(ValueError):
    """An explicit backend request (argument or FUSEDMOE_BACKEND) that cannot be honoured."""


class NoBackendError(NotImplementedError):
    """No backend supports the configuration; `verdicts` holds every candidate's reason."""

    def __init__(self, message: str, verdicts: tuple[Verdict, ...] = ()):
        lines = [message]
        for v in verdicts:
            lines.append(f"  - {v.name}: {v.reason or v.status}")
        super().__init__("\n".join(lines))
        self.verdicts = verdicts
