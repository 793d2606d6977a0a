"""The fixed prompts the AR benchmarks send (``omni bench ar``, ``ar-vllm``, ``serve``), so
that their figures compare."""

PROMPTS = [
    "Write a haiku about foxes in the snow.",
    "Explain what a pipeline is in one sentence.",
    "List three colors of autumn leaves.",
    "What is the capital of France?",
    "Describe a red fox.",
    "Give me a short poem about rivers.",
    "Why is the sky blue?",
    "Name a famous painter.",
]
