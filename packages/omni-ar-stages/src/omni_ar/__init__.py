"""omni AR stage family (filled by its own issue)."""

__version__ = "0.1.0"
