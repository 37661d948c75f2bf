"""Why a hooked backend (``"layerwise"``, ``"rules"``) cannot give the rows of a model."""

from __future__ import annotations

__all__ = ["LayerwiseIncomplete", "LayerwiseUnsupported"]


class LayerwiseUnsupported(ValueError):
    """The selection or the model is outside what the hooked backend handles."""


class LayerwiseIncomplete(LayerwiseUnsupported):
    """The hooks do not see every use of a selected parameter, or not sample by sample."""
