"""The chat template: messages → one plain-text prompt for a base model.

QuillGPT models are base models (trained to continue text, not to follow instructions), so
chat is a transcript for them to continue:

    System: <content>

    User: <content>

    Assistant: <content>

    User: <content>

    Assistant:

and the reply ends where the model starts the next turn (the stop strings CHAT_STOPS, never
part of the reply). "developer" messages are written as System.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from quillgpt.serve.schemas import ChatMessage

ROLE_NAMES = {"system": "System", "developer": "System", "user": "User", "assistant": "Assistant"}
CHAT_STOPS = ("\nUser:", "\nSystem:")


def message_text(message: ChatMessage) -> str:
    """A message's content as text: a string, or its text parts joined."""
    if message.content is None:
        return ""
    if isinstance(message.content, str):
        return message.content
    return "".join(part.text for part in message.content)


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The transcript of `messages`, ending with "Assistant:" for the model to continue."""
    turns = [f"{ROLE_NAMES[m.role]}: {message_text(m)}\n\n" for m in messages]
    return "".join(turns) + "Assistant:"
