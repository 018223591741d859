"""Conversations -> the token stream the target model really saw and emitted.

A draft learns the target's token stream, so each assistant turn is rendered
the way it was produced: the prompt by the target's own chat template (with
the history a client sends back: earlier answers as content only), then the
completion as the model emitted it — `<think>` + reasoning + `</think>` +
content + the end-of-turn token — not as the template would re-render it
(templates strip the thinking's newlines, or drop it). The loss mask is 1 on
completion tokens (reasoning included), 0 on the prompt.

Turns share one sample while each turn's prompt extends the previous sample's
text; a template that rewrites history (Qwen3 drops earlier thinking) starts a
new sample per turn, so every sample is a context the model really decoded in.

Used by the trainer and by the state extractor: both must cut the same tokens.
Standalone on purpose (transformers, and its sibling conversations.py).
"""
import json
import os
import sys
import time
from dataclasses import dataclass

import layout
from conversations import conversation
from script import PROGRESS_EVERY_S, progress

REMOTE_CODE_HINT = "pass --trust-remote-code (with inv: add --trust-remote-code to the host's vllm_args)"


def load_pretrained(loader, path: str, trust_remote_code: bool = False, **kw):
    """loader.from_pretrained(path), with transformers' many-line refusal of custom code (Kimi-K2's
    tokenizer, an unknown model_type with an auto_map) made one line that says what to do."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    if not trust_remote_code and loader.__name__ in ("AutoTokenizer", "AutoConfig"):
        hf_logging.set_verbosity_error()  # its config warnings on the way to that refusal are noise
    try:
        return loader.from_pretrained(path, trust_remote_code=trust_remote_code, **kw)
    except ValueError as e:
        if "trust_remote_code" in str(e) and not trust_remote_code:
            raise ValueError(f"{path}: its {loader.__name__} needs the checkpoint's own code: {REMOTE_CODE_HINT}") \
                from None
        raise
    finally:
        hf_logging.set_verbosity(verbosity)


@dataclass
class Sample:
    ids: list[int]  # (the trainer keeps ids and mask as tensors)
    mask: list[int]  # 1 where the token is the target's own output (loss goes there)
    row: int = -1  # the data row it came from (file order, all files): held-out slices take whole rows
    tail: int = 0  # held-out replay only: its last `tail` tokens follow the answer's stop (held_out.py)


class ChatRenderer:
    """Renders conversations with one target's tokenizer and chat template."""

    def __init__(self, tokenizer, eos_ids=(), think_open="<think>", think_close="</think>"):
        self.tok = tokenizer
        self.think_open, self.think_close = think_open, think_close
        self.eos_ids = list(eos_ids)
        self.eos_text = self._end_of_turn(eos_ids)

    @classmethod
    def from_pretrained(cls, path: str, trust_remote_code: bool = False, **kw) -> "ChatRenderer":
        from transformers import AutoTokenizer, GenerationConfig

        try:
            eos = GenerationConfig.from_pretrained(path).eos_token_id
        except OSError:  # no generation_config.json
            eos = None
        eos_ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
        return cls(load_pretrained(AutoTokenizer, path, trust_remote_code), eos_ids=eos_ids, **kw)

    def _end_of_turn(self, eos_ids) -> str:
        """The token text the model emits to end its turn: the template's first stop token after an answer."""
        stops = [self.tok.convert_ids_to_tokens(i) for i in eos_ids] + [self.tok.eos_token]
        probe = "\x00answer\x00"
        text = self._template([{"role": "user", "content": "q"}, {"role": "assistant", "content": probe}], False)
        tail = text.split(probe, 1)[1] if probe in text else ""
        for stop in stops:
            if stop and tail.startswith(stop):
                return stop
        if not self.tok.eos_token:
            raise ValueError("cannot tell the end-of-turn token: the tokenizer has no eos_token")
        return self.tok.eos_token

    def stop_ids(self) -> list[int]:
        """The token ids a server stops at: generation_config's eos ids and the tokenizer's eos (vLLM's rule)."""
        ids = list(self.eos_ids)
        if self.tok.eos_token_id is not None and self.tok.eos_token_id not in ids:
            ids.append(self.tok.eos_token_id)
        return ids

    def prompt_text(self, messages: list[dict]) -> str:
        """The text a chat request for `messages` becomes: the template with the generation prompt."""
        return self._template(messages, True)

    def _template(self, messages, add_generation_prompt: bool, **kw) -> str:
        return self.tok.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kw
        )

    def _encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def completion_text(self, prompt: str, message: dict, ended: bool = True) -> str:
        """What the model emitted after `prompt` to produce `message` (reasoning put back inline)."""
        content, reasoning = message.get("content"), message.get("reasoning")
        text = content or ""
        if reasoning is not None:
            opened = prompt.rstrip().endswith(self.think_open)  # templates that open the thinking themselves
            closed = content is not None  # content None: the model stopped before closing its thinking
            text = ("" if opened else self.think_open) + reasoning + (self.think_close if closed else "") + text
        return text + (self.eos_text if ended else "")

    def render(self, messages: list[dict], max_len: int, ended: list[bool] | None = None,
               template_kwargs: dict | None = None) -> list[Sample]:
        """Samples for one conversation, each cut to max_len tokens (never wrapped).

        messages: [{"role", "content", "reasoning"?}]; ended[i] False for an assistant turn that
        stopped on the token limit (no end-of-turn token was emitted); template_kwargs: the
        chat_template_kwargs the generating client sent (e.g. enable_thinking).
        """
        samples, ids, mask, text = [], [], [], ""
        history = []
        n_assistant = 0
        for message in messages:
            if message["role"] != "assistant":
                history.append({"role": message["role"], "content": message.get("content") or ""})
                continue
            prompt = self._template(history, True, **(template_kwargs or {}))
            if text and prompt.startswith(text):
                new = self._encode(prompt[len(text):])
            else:
                if ids:
                    samples.append(Sample(ids[:max_len], mask[:max_len]))
                ids, mask, new = [], [], self._encode(prompt)
            completion = self.completion_text(prompt, message, ended[n_assistant] if ended else True)
            out = self._encode(completion)
            ids += new + out
            mask += [0] * len(new) + [1] * len(out)
            text = prompt + completion
            history.append({"role": "assistant", "content": message.get("content") or ""})
            n_assistant += 1
        if ids:
            samples.append(Sample(ids[:max_len], mask[:max_len]))
        return samples


# ---------------------------------------------------------------- records


def normalise(record: dict) -> list[dict]:
    """The record's messages as [{"role", "content", "reasoning"?}]; raises ValueError if it has none
    to train on. The shapes read are generate's (remote/conversations.py: one reader for both)."""
    messages = conversation(record)
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("no assistant message")
    return messages


def turns_ended(record: dict) -> list[bool] | None:
    """Per assistant turn: did it end on the model's own stop token (not on max_tokens)?"""
    turns = record.get("turns")
    if not isinstance(turns, list):
        return None
    return [not isinstance(t, dict) or t.get("finish_reason") != "length" for t in turns]


def template_kwargs(record: dict) -> dict:
    """The chat_template_kwargs generate sent with the row (its `params`), if any."""
    params = record.get("params")
    kwargs = params.get("chat_template_kwargs") if isinstance(params, dict) else None
    return kwargs if isinstance(kwargs, dict) else {}


def is_truncated(record: dict) -> bool:
    ended = turns_ended(record)
    return bool(record.get("truncated")) or (ended is not None and not all(ended))


def render_records(renderer: ChatRenderer, paths: list[str], max_len: int, include_truncated: bool, stats: dict):
    """Yields every trainable Sample of the data files, in file order: the one definition of what is trained on.

    Skips rows cut by max_tokens unless include_truncated, and malformed rows (the first one is
    reported on stderr); drops samples with nothing to predict. Counts rows in `stats`.
    """
    for key in ("rows", "truncated_skipped", "bad_rows"):
        stats.setdefault(key, 0)
    for path, line, record in read_records(paths):
        stats["rows"] += 1
        try:
            messages = normalise(record)
        except ValueError as e:
            stats["bad_rows"] += 1
            if stats["bad_rows"] == 1:
                print(f"skipping {path}:{line}: {e} (further bad rows only counted)", file=sys.stderr)
            continue
        if is_truncated(record) and not include_truncated:
            stats["truncated_skipped"] += 1
            continue
        ended = turns_ended(record)
        if ended is not None and len(ended) != sum(m["role"] == "assistant" for m in messages):
            ended = None  # turns do not line up with the messages: assume every turn ended
        for sample in renderer.render(messages, max_len, ended, template_kwargs(record)):
            if sum(sample.mask[2:]) > 0:  # the draft predicts token t+2 onwards
                sample.row = stats["rows"] - 1
                yield sample


def load_samples(renderer: ChatRenderer, paths: list[str], max_len: int, include_truncated: bool):
    """Every trainable sample as (ids int32, mask bool) tensors (~5 bytes a token); returns (samples, stats).
    The trainer's samples, and the extractor's: both cut exactly the same tokens."""
    import torch

    samples, stats = [], {}
    last = time.monotonic()
    for sample in render_records(renderer, paths, max_len, include_truncated, stats):
        samples.append(Sample(torch.tensor(sample.ids, dtype=torch.int32), torch.tensor(sample.mask, dtype=torch.bool),
                              sample.row))
        if time.monotonic() - last > PROGRESS_EVERY_S:
            last = time.monotonic()
            progress(stage="render", rows=stats["rows"], samples=len(samples))
    stats["samples"] = len(samples)
    stats["tokens"] = sum(len(s.ids) for s in samples)
    stats["loss_tokens"] = sum(int(s.mask.sum()) for s in samples)
    return samples, stats


def data_files(paths: list[str]) -> list[str]:
    """FILE or DIR (-> DIR/data.jsonl, else every *.jsonl in DIR, sorted)."""
    files = []
    for path in paths:
        if os.path.isdir(path):
            main = os.path.join(path, layout.ROWS)
            found = [main] if os.path.exists(main) else sorted(
                os.path.join(path, f) for f in os.listdir(path) if f.endswith(".jsonl"))
            if not found:
                raise ValueError(f"{path}: no {layout.ROWS} or *.jsonl inside")
            files += found
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise ValueError(f"{path}: no such file or directory")
    return files


def read_records(paths: list[str]):
    """Yields (file, line number, record) for every complete json line; a torn last line is skipped."""
    for path in data_files(paths):
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield path, n, json.loads(line)
                except json.JSONDecodeError:
                    if line.endswith("\n"):
                        raise ValueError(f"{path}:{n}: not valid JSON") from None
