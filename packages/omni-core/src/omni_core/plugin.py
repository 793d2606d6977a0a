"""The plug-in API: everything a stage family imports from omni-core.

A stage plug-in (a distribution registering classes under the ``omni.stages`` entry-point
group, or named models under ``omni.models``) imports from this module and from
``omni_core``'s top level (the client API: :class:`~omni_core.Pipeline` and the events a
caller reads), nothing else of ``omni_core``. Every other module of omni-core is the
runtime's own and may change in any release; ``hatch run lint`` fails on a plug-in
distribution of this repository that imports one (``tools/ci/check_imports.py``).

**Stability.** The names in ``__all__`` below, their signatures and the documented
meaning of their fields are the contract:

* a patch release changes none of them;
* a minor release may add names, keyword arguments with defaults, optional event and
  context fields, and stage hooks with a default that does nothing;
* removing or changing one incompatibly is announced first: the old form keeps working
  for at least one minor release, warns with a ``DeprecationWarning`` that names its
  replacement, and the release notes list it. While omni is 0.x, "major" is the minor
  number: 0.4 may remove what 0.3 deprecated.

What the names are for, by group:

* **The stage:** :class:`Stage` (subclass it), the :class:`StageContext` it is built
  with (its name, options, edges, logger, and :meth:`StageContext.place` for the device
  and dtype its models load in), the :class:`StageInput` each trigger brings (the request,
  a :class:`Window` per inbound edge, ``cancelled``), and :data:`StageEvent`, what
  :meth:`Stage.process` yields: a :class:`Segment` (tokens, payload, arrays written to the
  data plane by size: ``inp.segment(arrays=...)``), an :class:`ImageProgress` or an
  :class:`Error`, made with ``inp.segment``, ``inp.image`` and ``inp.fail``.
* **Errors:** :class:`UserInputError` (the caller's fault; its message is theirs to see,
  through ``inp.fail`` or raised from ``process``), :class:`DeviceError` (a placement
  the worker cannot give).
* **Placement:** :class:`Placement`, :func:`default_dtype` (the dtype ``auto`` stands
  for on a device), :func:`cpu_has_bf16` (whether the CPU computes bfloat16 natively:
  a family may run its models in bfloat16 there), :func:`apply_thread_env` (a library
  loaded before the worker's thread count was known, as in a worker forked from the
  zygote, gets it applied: call it after importing one that sizes a thread pool at
  import), :func:`usable_cores` (the cores the worker may run on, read at run time).
* **Scheduling:** :data:`PRIORITY_KEY` (the request field a priority is read from) and
  :data:`SchedulerPolicy` (a stage over an engine with its own scheduler passes
  :attr:`StageInput.priority` on under ``priority``).
* **Models:** :class:`NamedModel` (what an ``omni.models`` entry point lists, for ``omni
  models``), :func:`installed_models`, :class:`Reporter` (what a model's ``pull``
  reports its steps to), :func:`cached` and :func:`build_once` (a directory built once
  in omni's model cache, by one of several workers starting together).
* **Config sections:** a family may add a section to a config's ``mrs:`` in the MRS
  design doc's spelling (the AR family's ``mrs.ar``): a :data:`ConfigSection` registered
  under the ``omni.config_sections`` entry-point group, named by its key. It rewrites a
  :class:`Spelling` (the config as parsed) into omni's keys, told the option keys each
  stage kind takes (:data:`OptionNames`), and raises :class:`SpellingError` naming the
  key as written.
* **Media:** :data:`MEDIA_TYPE` (the payload key an encoding stage names its bytes'
  type under) and :data:`IMAGE_INPUT_FORMATS` (the image formats inputs are taken in).
"""

from __future__ import annotations

from omni_core.config_spelling import OptionNames, Spelling, SpellingError
from omni_core.config_spelling import Section as ConfigSection
from omni_core.dataplane.windows import Window
from omni_core.errors import UserInputError
from omni_core.events import Error, ImageProgress, Segment
from omni_core.media import IMAGE_INPUT_FORMATS, MEDIA_TYPE
from omni_core.models.model_cache import build_once, cached
from omni_core.models.named_models import NamedModel, installed_models
from omni_core.observability.progress import Reporter
from omni_core.placement import DeviceError, Placement, cpu_has_bf16, default_dtype
from omni_core.scheduling import PRIORITY_KEY, SchedulerPolicy
from omni_core.stage import Stage, StageContext, StageEvent, StageInput
from omni_core.threads import apply_thread_env, usable_cores

__all__ = [
    "IMAGE_INPUT_FORMATS",
    "MEDIA_TYPE",
    "PRIORITY_KEY",
    "ConfigSection",
    "DeviceError",
    "Error",
    "ImageProgress",
    "NamedModel",
    "OptionNames",
    "Placement",
    "Reporter",
    "SchedulerPolicy",
    "Segment",
    "Spelling",
    "SpellingError",
    "Stage",
    "StageContext",
    "StageEvent",
    "StageInput",
    "UserInputError",
    "Window",
    "apply_thread_env",
    "build_once",
    "cached",
    "cpu_has_bf16",
    "default_dtype",
    "installed_models",
    "usable_cores",
]
