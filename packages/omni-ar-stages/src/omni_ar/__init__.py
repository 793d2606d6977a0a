"""omni AR stage family: intake -> prefill -> decode -> postprocess (see ``stages``)."""

__version__ = "0.1.0"
