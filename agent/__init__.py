"""edge-agent: discovers, tunes and monitors an edge device and runs its inference loop."""

__version__ = "0.1.0"
