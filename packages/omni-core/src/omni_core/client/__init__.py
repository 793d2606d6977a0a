"""The caller's side: ``Pipeline``, the backends it runs on, and the collector that turns
the stages' events into one stream per request."""
