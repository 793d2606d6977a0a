"""What both AR engines share: the model's Hugging Face tokenizer, its end-of-sequence
ids, and the request checks against its vocabulary and its grammars."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from omni_ar.engines.protocol import Source
from omni_ar.logits import check_tokens
from omni_ar.params import SamplingParams
from omni_ar.structured import Grammars


def eos_set(eos: int | list[int] | None) -> set[int]:
    """A generation config's ``eos_token_id`` (one id, a list, or none) as a set."""
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


class TokenizedEngine:
    """The base of the transformers and vLLM engines: the tokenizer of ``model_dir``
    (both engines tokenize with Hugging Face's, so their ids agree), ``eos_ids``, and
    :meth:`check_tokens` and the constraints' compiler over the vocabulary
    :meth:`vocab_size` gives once the model is loaded."""

    def __init__(self, model: str) -> None:
        self.model_dir = model
        self.tokenizer: Any = None
        self.eos_ids: set[int] = set()  # the model's, once it is loaded
        self.grammars: Grammars | None = None  # built at the first constrained request

    def load_tokenizer(self) -> Any:
        """The model's tokenizer (and its chat template), kept as ``self.tokenizer``."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        return self.tokenizer

    def encode(self, source: Source) -> list[int]:
        """A prompt's token ids; chat messages go through the chat template first."""
        if isinstance(source, str):
            return list(self.tokenizer(source)["input_ids"])
        ids = self.tokenizer.apply_chat_template(source, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def vocab_size(self) -> int | None:
        """The width of the loaded model's logits; None before the model is loaded."""
        raise NotImplementedError

    def check_tokens(self, params: SamplingParams) -> None:
        """A RequestError naming the field where ``params`` name a token outside the
        model's vocabulary (:func:`omni_ar.logits.check_tokens`; not before the model
        is loaded)."""
        vocab = self.vocab_size()
        if vocab is None:
            return
        tokenizer = (self.tokenizer or self.load_tokenizer()) if params.bad_words else None
        check_tokens(params, vocab, tokenizer)

    def grammar_stop_ids(self) -> Iterable[int]:
        """The ids a grammar allows where it ends, beside the tokenizer's own."""
        return self.eos_ids

    def _grammars(self) -> Grammars:
        """The constraints' compiler for this model's tokenizer (built on first use,
        once the model is loaded)."""
        if self.grammars is None:
            tokenizer = self.tokenizer or self.load_tokenizer()
            vocab = self.vocab_size()
            if vocab is None:
                raise RuntimeError("a constraint is compiled once the engine's model is loaded")
            self.grammars = Grammars(tokenizer, vocab, self.grammar_stop_ids())
        return self.grammars
