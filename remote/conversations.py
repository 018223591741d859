"""The one reader of conversation shapes, shared by the generator (dataset rows in) and the trainer
and extractor (generated records in), so a row one side accepts the other never refuses.

Shapes read, first match wins:
  - OpenAI:     {"messages": [{"role": "system"|"user"|"assistant", "content": str}]}
  - ShareGPT:   {"conversations": [{"from": "system"|"human"|"gpt", "value": str}]}
  - SpecForge:  {"conversations": [{"role", "content"}]}  (each message may use either key pair)
  - a prompt:   {"prompt": str}
An assistant message may carry its reasoning (`reasoning` or `reasoning_content`, a string) and may
have no content (generate records a turn that stopped inside its thinking with content null).
Everything else (an unknown role, a number where text belongs) is refused with a one-line reason,
so a bad row is skipped and recorded, never passed on to crash a tokenizer later.
"""
import itertools
import json

ROLES = {
    "system": "system", "developer": "system",
    "user": "user", "human": "user",
    "assistant": "assistant", "gpt": "assistant", "model": "assistant", "chatgpt": "assistant",
}
SHAPES = ('OpenAI {"messages": [{"role", "content"}]}, ShareGPT {"conversations": [{"from", "value"}]} '
          'or [{"role", "content"}], or {"prompt": str}')


class ConversationError(ValueError):
    """The record holds no conversation in a shape read here; the message is the reason (one line)."""


def conversation(record):
    """The record's messages as [{"role", "content", "reasoning"?}], roles normalised."""
    if not isinstance(record, dict):
        raise ConversationError(f"row is {kind(record)}, not an object")
    if record.get("messages") is not None:
        raw = record["messages"]
    elif record.get("conversations") is not None:
        raw = record["conversations"]
    elif record.get("prompt") is not None:
        raw = [{"role": "user", "content": record["prompt"]}]
    else:
        raise ConversationError("no messages, conversations or prompt column")
    if not isinstance(raw, list):
        raise ConversationError(f"conversation is {kind(raw)}, not a list")
    if not raw:
        raise ConversationError("empty conversation")
    return [message(k, m) for k, m in enumerate(raw)]


def message(k, m):
    if not isinstance(m, dict):
        raise ConversationError(f"message {k} is {kind(m)}, not an object")
    role_key, content_key = ("role", "content") if "role" in m else ("from", "value")
    named = m.get(role_key)
    role = ROLES.get(named) if isinstance(named, str) else None
    if role is None:
        raise ConversationError(f"message {k} has unknown role {short(named)}")
    content = m.get(content_key)
    if not (isinstance(content, str) or content is None and role == "assistant"):
        raise ConversationError(f"message {k} content is {kind(content)}, not a string")
    out = {"role": role, "content": content}
    if role == "assistant":
        reasoning = next((m[f] for f in ("reasoning", "reasoning_content") if m.get(f) is not None), None)
        if reasoning is not None:
            if not isinstance(reasoning, str):
                raise ConversationError(f"message {k} reasoning is {kind(reasoning)}, not a string")
            out["reasoning"] = reasoning
    return out


def shape_of(record):
    """What a record looks like, for a refusal that must say what it saw: its keys and their types."""
    if not isinstance(record, dict):
        return kind(record)
    parts = []
    for key, value in itertools.islice(record.items(), 8):
        seen = kind(value)
        if isinstance(value, list) and value and isinstance(value[0], dict):
            seen = "[{" + ", ".join(short(k) for k in itertools.islice(value[0], 4)) + "}]"
        parts.append(f"{short(key)}: {seen}")
    more = ", ..." if len(record) > 8 else ""
    return "{" + ", ".join(parts) + more + "}"


def kind(value):
    """A JSON value's type in JSON's words (str, int, list, ...), as Python names them."""
    return "null" if value is None else type(value).__name__


def short(value, limit=40):
    """A value quoted for a message: escaped (no control characters reach a terminal) and cut."""
    text = json.dumps(value, ensure_ascii=True, default=str)
    return text if len(text) <= limit else text[:limit] + "..."
