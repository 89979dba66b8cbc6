"""Chat examples for fine-tuning: rendered with the tokenizer's own chat template, with the
loss on the assistant turns only.

:func:`render_chat` renders the whole conversation once (``apply_chat_template``), and
finds each assistant turn's characters as the difference between the conversation
rendered up to that turn with the generation prompt and rendered through it: what the
model must learn to produce after the prompt, its end-of-turn token included. The text is
tokenized once with offsets; a token whose first character falls in an assistant turn is
trained on, every other token gets label -100 (system, user and tool turns, the template's
markup, the generation prompt). This works with any template that renders a conversation's
prefix as a prefix of its text (the ones that do not are refused with the turn that
breaks it); templates need no ``{% generation %}`` markers.

Example:
    >>> from slapo_fn.data import train_bpe
    >>> tok = train_bpe(["<|user|>hi there<|assistant|>hello"] * 5, vocab_size=300)
    >>> tok.chat_template = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    ...                      "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    >>> ids, labels = render_chat(tok, [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}])
    >>> tok.decode(ids[labels != -100])
    'yo'
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import Problem, ScheduleError
from .packing import IGNORE

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ASSISTANT", "render_chat"]

ASSISTANT = "assistant"
_EXAMPLE = '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}'


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: object, where: str = "<chat>") \
        -> tuple[np.ndarray, np.ndarray]:
    """The token ids of ``messages`` rendered with ``tokenizer``'s chat template, and
    their labels: the ids on assistant turns, -100 elsewhere (int64 arrays).

    Raises :class:`~slapo_fn.errors.ScheduleError` naming ``where`` for messages that are
    not a list of ``{"role", "content"}`` objects, or a template that does not render a
    conversation's prefix as a prefix of it.
    """
    turns = _checked(messages, where)

    def text(upto: int, prompt: bool) -> str:
        conversation: Any = list(turns[:upto])
        return str(tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt))

    whole = text(len(turns), False)
    spans = []
    for i, turn in enumerate(turns):
        if turn["role"] != ASSISTANT:
            continue
        before, through = text(i, True) if i else "", text(i + 1, False)
        if not (whole.startswith(through) and through.startswith(before)):
            raise ScheduleError("data", [Problem(where, f"the chat template does not render the conversation up to "
                                                        f"turn {i} as a prefix of the whole (it renders turns "
                                                        "depending on later ones)",
                                                 "a chat template whose rendering of a conversation starts with "
                                                 "that of its first turns")])
        spans.append((len(before), len(through)))
    encoded: Any = tokenizer(whole, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], dtype=np.int64)
    starts = np.asarray([start for start, _ in encoded["offset_mapping"]], dtype=np.int64)
    trained = np.zeros(len(ids), dtype=bool)
    for start, stop in spans:
        trained |= (starts >= start) & (starts < stop)
    return ids, np.where(trained, ids, IGNORE)


def _checked(messages: object, where: str) -> Sequence[Mapping[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise ScheduleError("data", [Problem(where, f"a row's 'messages' is {messages!r:.60}, not a list of turns",
                                             f"rows like {_EXAMPLE}")])
    for i, turn in enumerate(messages):
        if not (isinstance(turn, dict) and isinstance(turn.get("role"), str)
                and isinstance(turn.get("content"), str | None)):
            raise ScheduleError("data", [Problem(where, f"turn {i} of a row's messages is {turn!r:.80}, not "
                                                        "{\"role\": ..., \"content\": ...}", f"rows like {_EXAMPLE}")])
    if not any(turn["role"] == ASSISTANT for turn in messages):
        raise ScheduleError("data", [Problem(where, "a conversation has no assistant turn: nothing to train on",
                                             f"rows with an {ASSISTANT!r} turn, e.g. {_EXAMPLE}")])
    return messages
