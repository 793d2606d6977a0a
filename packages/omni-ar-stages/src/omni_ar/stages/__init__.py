"""The AR stages: intake -> prefill -> decode -> postprocess, each in its own worker.

* intake: validate the request, apply the chat template, tokenize (a source stage). The
  request is parsed here, once: its params (:class:`omni_ar.params.SamplingParams`)
  travel on with its first segment, and each later stage takes them from there.
* prefill: the prompt forward pass; emits the first token and the KV cache as arrays,
  which cross to decode through the shared-memory data plane, with a
  :class:`omni_ar.handoff.Handoff`.
* decode: rebuilds the cache and steps; flushes a segment every ``max_segment_tokens``
  tokens, after ``min_flush_interval_ms``, or at the end; stops at its next step when
  the request is cancelled. It decides the finish reason: its last segment carries
  ``finish_reason`` (``stop`` or ``length``).
* postprocess: incremental detokenization and stop strings, off the decode loop; streams
  text to the caller directly.

The stages that hold a model (prefill, decode, talker) load it where
:meth:`omni_core.plugin.StageContext.place` puts them: the stage's ``devices`` (``cpu``,
or GPUs: the first one it is given) in its ``dtype`` (``auto``: bfloat16 on a CPU
that computes it natively, else float32; bfloat16 or float16 on a GPU). A GPU asked for
where torch sees none fails the load, naming the stage. Intake and postprocess load only
a tokenizer.
"""
