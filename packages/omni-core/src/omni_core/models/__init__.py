"""Models the families name and build: the on-disk cache and ``omni models``."""
