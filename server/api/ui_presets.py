"""The built-in page's defaults for the served model: its prompt presets, repetition penalty and chat-template
switch (``GET /ui/api/defaults``).

A **chat model** is one whose chat template marks the turns with the tokenizer's special tokens (SmolLM2's
``<|im_start|>``, Gemma's ``<start_of_turn>``): it was trained on chats, so a question reaches it as a chat turn,
and sent as raw text it may answer with end-of-text at once. For a chat model the page applies the template by
default, offers chat questions and a neutral repetition penalty (1.0, what the OpenAI routes default to). Any
other model (the bundled reference models, trained on plain text: their plain ``User: ...`` template writes no
special token; a base model with no template) is given text to continue, the Genesis passage the reference
model was trained on, with the repetition penalty that keeps its greedy text from looping (1.3); the switch is
offered wherever the tokenizer has a template, off by default.
"""

from __future__ import annotations

from server.api.openai_convert import chat_prompt
from server.api.openai_schemas import ChatMessage

GENESIS = ("In the beginning God created the heaven and the earth. And the earth was without form, and void; and "
           "darkness was upon the face of the deep. And the Spirit of God moved upon the face of the waters. And God "
           "said, Let there be light: and there was light. And God saw the light, that it was good: and God divided "
           "the light from the darkness. And God called the light Day, and the darkness he called Night. And the "
           "evening and the morning were the first day. And God said")
TEXT_PRESETS = (("Genesis 1:1-5", GENESIS), ("And God said", "And God said"))
"""Text to continue (any model that is not a chat model): the first is long enough for every backend to compress
on the reference model, the second too short for any."""
CHAT_PRESETS = (("How a rainbow forms", "Explain how a rainbow forms, in a few sentences."),
                ("Tips for a new language", "Give three tips for learning a new language."),
                ("The capital of France", "What is the capital of France?"))
"""Chat questions (a chat model): the first two get answers long enough for int8 and int4 to compress, the last a
short one."""
TEXT_REPETITION_PENALTY = 1.3
CHAT_REPETITION_PENALTY = 1.0


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def chat_turn(tokenizer, text: str) -> tuple[str, bool]:
    """``text`` as one user turn through the tokenizer's chat template, and whether the tokenizer should add its
    special tokens when encoding it (:func:`server.api.openai_convert.chat_prompt`)."""
    return chat_prompt(tokenizer, [ChatMessage(role="user", content=text)], field="prompt")


def is_chat_model(tokenizer) -> bool:
    """Whether the chat template marks a turn with one of the tokenizer's special tokens (see the module
    docstring)."""
    if not has_chat_template(tokenizer):
        return False
    try:
        text, _ = chat_turn(tokenizer, "Hello")
    except Exception:  # noqa: BLE001 - a template that cannot render one user turn: not one to apply by default
        return False
    return any(token and token in text for token in getattr(tokenizer, "all_special_tokens", []))


def page_defaults(tokenizer) -> dict:
    """What the page starts with for this tokenizer's model: ``chat_template`` (the switch is offered), ``chat``
    (it is on), ``repetition_penalty``, and the ``presets`` (``label``, ``prompt``, and ``tokens``: the prompt's
    tokens as the page sends it by default), the first being the default prompt."""
    chat = is_chat_model(tokenizer)
    presets = []
    for label, prompt in CHAT_PRESETS if chat else TEXT_PRESETS:
        text, special = chat_turn(tokenizer, prompt) if chat else (prompt, True)
        presets.append({"label": label, "prompt": prompt,
                        "tokens": len(tokenizer(text, add_special_tokens=special)["input_ids"])})
    return {"chat_template": has_chat_template(tokenizer), "chat": chat,
            "repetition_penalty": CHAT_REPETITION_PENALTY if chat else TEXT_REPETITION_PENALTY, "presets": presets}
