"""Proof, for mypy, that each engine class conforms to the protocols it claims
(:mod:`omni_ar.engines.protocol`): ``hatch run lint`` type-checks this module (strict),
and an engine that stops conforming (a method gone, a signature changed) fails it there.
Nothing here runs: the engines are imported for the type checker only."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omni_ar.engines.protocol import (
        Engine,
        HiddenStatesEngine,
        MultimodalEngine,
        PagedMultimodalEngine,
        Preemptible,
        StreamingEngine,
    )
    from omni_ar.engines.transformers_batch import BatchSteps
    from omni_ar.engines.transformers_engine import TransformersEngine
    from omni_ar.engines.vllm_engine import VllmEngine
    from omni_ar.multimodal.engine import VLMEngine

    def _transformers(engine: TransformersEngine) -> None:
        _: Engine = engine
        _h: HiddenStatesEngine = engine

    def _transformers_steps(steps: BatchSteps) -> None:
        _: Preemptible = steps

    def _vlm(engine: VLMEngine) -> None:
        _: MultimodalEngine = engine

    def _vllm(engine: VllmEngine) -> None:
        _: Engine = engine
        _s: StreamingEngine = engine
        _m: PagedMultimodalEngine = engine
