"""The engines' tokenizer, loaded once from a local path, and the chat template.

The gateway tokenizes every prompt itself and forwards token ids, so the
only tokenization that matters is this one. It uses the Hugging Face fast
tokenizer saved beside the model (``tokenizer.json``, its config and chat
template), read from disk only: nothing is downloaded.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvmesh.errors import ConfigError, InvalidInput


class PromptTokenizer:
    """Text and chat messages to token ids, as the engine's own server would make them.

    Completions add the tokenizer's special tokens (BOS); a rendered chat
    template already holds them, so chat prompts are encoded without adding
    any (vLLM's server does the same).
    """

    __slots__ = ("_tok", "path", "vocab_size")

    def __init__(self, path: str | Path) -> None:
        p = Path(path)
        if not (p / "tokenizer.json").is_file():
            raise ConfigError(
                f"no tokenizer at {str(p)!r}: point --tokenizer at the model folder that holds "
                "tokenizer.json (the one the engines serve)"
            )
        from transformers import AutoTokenizer  # heavy; only the gateway pays for it

        try:
            self._tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot load the tokenizer at {str(p)!r}: {exc}") from exc
        self.path = p
        self.vocab_size = len(self._tok)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(token_ids)))

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        """Token ids of the chat template applied to `messages`; `InvalidInput` if it fails."""
        if not self.has_chat_template:
            raise InvalidInput(
                f"the tokenizer at {str(self.path)!r} has no chat template: "
                "use /v1/completions, or serve a model whose tokenizer has one"
            )
        try:
            text = self._tok.apply_chat_template(
                [dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **dict(template_kwargs or {}),
            )
        except Exception as exc:  # jinja raises its own types for a template's refusals
            raise InvalidInput(f"the chat template rejected these messages: {exc}") from exc
        return self.encode(str(text), add_special_tokens=False)
