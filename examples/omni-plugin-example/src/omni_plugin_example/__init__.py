"""An example omni stage plug-in: ``example.redact`` masks words in a streamed text."""

from omni_plugin_example.redactor import StreamRedactor, word_pattern
from omni_plugin_example.stages import Redact, RedactOptions

__all__ = ["Redact", "RedactOptions", "StreamRedactor", "word_pattern"]
