"""The AR family's section of a pipeline config in the MRS design doc's spelling:
``mrs.ar``, the defaults of every ``ar.*`` stage and of the edges out of one.

=================================  ===============================================
design doc                         omni
=================================  ===============================================
``mrs.ar.default_window_size: N``  ``window: {size: N}`` on every edge out of an
                                   ``ar.*`` stage that sets no window size
``mrs.ar.max_segment_tokens``,     ``options.<key>`` of every ``ar.*`` stage whose
``mrs.ar.min_flush_interval_ms``   options have that key and that sets none
``mrs.ar.scheduler_policy``        ``scheduler_policy`` of every ``ar.*`` stage that
                                   sets none (``fcfs`` or ``priority``)
=================================  ===============================================

Registered under ``omni.config_sections`` as ``ar``: the core rewrites the rest of the
doc's spelling and hands this section here (:data:`omni_core.plugin.ConfigSection`).
Nothing here imports more than the standard library and omni-core: it runs wherever a
config is read.
"""

from __future__ import annotations

from typing import Any, get_args

from omni_core.plugin import OptionNames, SchedulerPolicy, Spelling, SpellingError

AR_KIND_PREFIX = "ar."
AR_STAGE_OPTIONS = ("max_segment_tokens", "min_flush_interval_ms")
AR_KEYS = ("default_window_size", *AR_STAGE_OPTIONS, "scheduler_policy")
POLICIES: tuple[str, ...] = get_args(SchedulerPolicy)


def apply(ar: Any, out: Spelling, option_names: OptionNames) -> None:
    """``mrs.ar.*``: the defaults of every ``ar.*`` stage and of the edges out of one."""
    if not isinstance(ar, dict):
        raise SpellingError("mrs.ar", f"expected a mapping, got {type(ar).__name__}")
    for name in ar:
        if name not in AR_KEYS:
            raise SpellingError(
                f"mrs.ar.{name}",
                f"unknown key; mrs.ar takes {', '.join(AR_KEYS)}; an ar.* stage's other "
                "settings go in its own `options`",
            )
    policy = ar.get("scheduler_policy")
    if policy is not None and policy not in POLICIES:
        raise SpellingError(
            "mrs.ar.scheduler_policy", f"expected one of {', '.join(POLICIES)}, got {policy!r}"
        )
    stages = out.data.get("stages")
    if not isinstance(stages, list):
        stages = []
    else:
        stages = out.data["stages"] = list(stages)  # the caller's list stays as it was
    ar_stages = [
        (i, s)
        for i, s in enumerate(stages)
        if isinstance(s, dict) and str(s.get("kind", "")).startswith(AR_KIND_PREFIX)
    ]
    if policy is not None:
        for i, s in ar_stages:
            if "scheduler_policy" not in s:
                stages[i] = {**s, "scheduler_policy": policy}
                out.origins[f"stages[{i}].scheduler_policy"] = "mrs.ar.scheduler_policy"
    given = [o for o in AR_STAGE_OPTIONS if o in ar]
    for i, s in ar_stages:
        if not given:  # nothing to default: no kind's options are looked up
            break
        options = s.get("options", {})
        if not isinstance(options, dict):
            continue  # the config's own check says what is wrong with it
        takes = option_names(str(s["kind"]))
        if takes is None:  # kinds not checked: every ar.* stage takes them, on any machine
            takes = frozenset(AR_STAGE_OPTIONS)
        defaults = {o: ar[o] for o in given if o in takes and o not in options}
        if defaults:
            stages[i] = {**s, "options": {**options, **defaults}}
            out.origins.update({f"stages[{i}].options.{o}": f"mrs.ar.{o}" for o in defaults})
    if "default_window_size" in ar:
        _ar_edge_windows(out, {str(s.get("name")) for _, s in ar_stages}, ar["default_window_size"])


def _ar_edge_windows(out: Spelling, ar_names: set[str], size: Any) -> None:
    edges = out.data.get("edges")
    if not isinstance(edges, list):
        return
    edges = out.data["edges"] = list(edges)  # the caller's list stays as it was
    for i, e in enumerate(edges):
        if not isinstance(e, dict) or e.get("from") not in ar_names:
            continue
        window = e.get("window")
        if window is None or (isinstance(window, dict) and "size" not in window):
            edges[i] = {**e, "window": {"size": size, **(window or {})}}
            out.origins[f"edges[{i}].window.size"] = "mrs.ar.default_window_size"
