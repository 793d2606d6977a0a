"""omni DiT stage family: text_encode -> plan -> sample -> vae -> encode on diffusers
(see stages.py, text_encode.py and architectures/)."""

__version__ = "0.1.0"
