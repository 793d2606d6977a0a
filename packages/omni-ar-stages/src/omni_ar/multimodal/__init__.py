"""Multimodal prefill -> decode handoff without media (the ``requires_kv`` contract).

``ar.mm_intake`` decodes and hashes the request's images; ``ar.mm_prefill`` runs the
image processor, the vision encoder and the prompt forward pass, and hands decode the
prompt token ids (placeholders included), per image its content hash and placeholder
span, and the KV through the data plane; ``ar.mm_decode`` admits the request only if
that KV covers every placeholder, and continues from it without pixels or a vision
tower. See :mod:`omni_ar.multimodal.handoff` for the contract.
"""
