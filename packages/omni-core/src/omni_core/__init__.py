"""omni-core: the runtime that runs stage pipelines, one process per stage."""

from omni_core.client.collector import RequestHandle, RequestOutput
from omni_core.config import ConfigError, PipelineConfig, load_config, parse_config
from omni_core.dataplane.windows import Window
from omni_core.events import (
    AnyEvent,
    Cancelled,
    Completed,
    Error,
    Event,
    ImageProgress,
    Segment,
)
from omni_core.pipeline import Pipeline
from omni_core.stage import Stage, StageContext, StageEvent, StageInput

__all__ = [
    "AnyEvent",
    "Cancelled",
    "Completed",
    "ConfigError",
    "Error",
    "Event",
    "ImageProgress",
    "Pipeline",
    "PipelineConfig",
    "RequestHandle",
    "RequestOutput",
    "Segment",
    "Stage",
    "StageContext",
    "StageEvent",
    "StageInput",
    "Window",
    "load_config",
    "parse_config",
]
