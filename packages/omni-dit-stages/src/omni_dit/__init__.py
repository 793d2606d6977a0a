"""omni DiT stage family: plan -> sample -> vae -> encode on diffusers (see stages.py)."""

__version__ = "0.1.0"
