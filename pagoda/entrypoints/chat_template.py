"""Chat templates: a conversation -> the prompt's token ids, for `LLM.chat` and the server."""

from __future__ import annotations

from typing import Any

Message = dict[str, Any]


def apply_chat_template(
    tokenizer,
    messages: list[Message],
    chat_template: str | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Token ids of a templated conversation; ValueError when there is no template.

    NOTE: the template is rendered to text and encoded without special tokens, because
    templates already write the BOS they want; encoding with them would double it.
    """
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("the model has no chat template; pass chat_template")
    text = tokenizer.apply_chat_template(
        messages,
        chat_template=chat_template,
        add_generation_prompt=add_generation_prompt,
        tokenize=False,
    )
    return tokenizer.encode(text, add_special_tokens=False)
