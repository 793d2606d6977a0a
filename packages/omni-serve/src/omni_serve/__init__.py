"""omni serve: an OpenAI-compatible HTTP server in front of an omni pipeline, with a web
page, Prometheus metrics and health (``omni serve CONFIG``)."""

from omni_serve.app import ServeSettings, create_app

__all__ = ["ServeSettings", "create_app"]
