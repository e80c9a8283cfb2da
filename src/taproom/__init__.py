"""taproom: a reliable real-time log and telemetry hub."""

__version__ = "0.1.0"
