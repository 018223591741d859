"""The rows training never sees, and what serving will generate for them.

The acceptance length vLLM measures is a property of the target's own greedy text on prompts the
draft never trained on. The held-out rows (batching.held_out_rows) give the prompts; with the
target at hand (online training) the prediction replays exactly what serving will do at
temperature 0: the target's greedy continuation of each prompt, up to the same max_tokens and
stop tokens as eval.py's request, loops and all, and then a few tokens more, what the target says
past its stop. vLLM scores a draft against those too (its scheduler counts acceptances before it
trims the output at the stop), so each answer's last draft is accepted there only where it guesses
the target's own continuation (often the end-of-turn token again, then less certain things). On the
demo's draft, counting them all as accepted put the prediction 0.011 above vLLM's figure, all of it
at the third draft position, with the first two within 0.001; scored, it equals vLLM's to 4 digits.
A row's recorded answer (sampled, or cut by max_tokens, or re-rendered from a reasoning parser's
split) is only an approximation of it: sampled tokens break chains serving would not break.
"""
import hashlib
import json
import os

import torch

from chat_render import Sample, read_records
from datasets_io import first_prompt


def records(data, rows: set[int]) -> tuple[list[dict], set[int]]:
    """The data rows numbered `rows` (file order over all files, as load_samples numbers them), and
    the numbers of every row that asks the same first prompt as one of them (those rows included):
    a duplicate prompt left in training would teach the draft the very text it is judged on."""
    held, keys, key_of = [], set(), []
    for n, (_, _, record) in enumerate(read_records(data)):
        prompt = first_prompt(record)
        key = None if prompt is None else hashlib.sha1(json.dumps(prompt, sort_keys=True).encode()).digest()
        key_of.append(key)
        if n in rows:
            held.append(record)
            keys.add(key)
    keys.discard(None)
    return held, rows | {n for n, key in enumerate(key_of) if key in keys}


def write_rows(rows: list[dict], path: str) -> None:
    """The held-out rows as jsonl: eval.py's --prompts (it sends the first N rows' first_prompt)."""
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    os.replace(tmp, path)


@torch.no_grad()
def greedy_samples(model, renderer, rows: list[dict], n: int, max_new_tokens: int, max_len: int,
                   device, past_stop: int = 0) -> list[Sample]:
    """The target's greedy continuation of the first n rows' first prompts, as Samples (mask on the
    continuation, cut to max_len like every sample): the token stream eval.py's greedy requests will
    produce, then `past_stop` greedy tokens more (the Sample's tail, masked too: scored, never part
    of the answer). One prompt at a time, so no padding changes a logit."""
    eos = renderer.stop_ids()
    out = []
    for row in rows:
        messages = first_prompt(row)
        if messages is None:
            continue
        prompt = renderer.tok(renderer.prompt_text(messages), add_special_tokens=False)["input_ids"]
        ids = torch.tensor([prompt], device=device)
        generated = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                   do_sample=False, temperature=None, top_p=None, top_k=None,
                                   eos_token_id=eos, pad_token_id=eos[0])[0, len(prompt):].tolist()
        answer = prompt + generated
        ids = (answer + greedy_tokens(model, answer, past_stop, device))[:max_len]
        mask = ([0] * len(prompt) + [1] * (len(generated) + past_stop))[:max_len]
        out.append(Sample(torch.tensor(ids, dtype=torch.int32), torch.tensor(mask, dtype=torch.bool),
                          tail=max(0, len(ids) - len(answer))))
        if len(out) == n:
            break
    return out


@torch.no_grad()
def greedy_tokens(model, ids: list[int], n: int, device) -> list[int]:
    """The n argmax tokens that follow ids, stop tokens or not (generate() would stop at them)."""
    out, past, step = [], None, torch.tensor([ids], device=device)
    for _ in range(n):
        result = model(input_ids=step, past_key_values=past, use_cache=True)
        past, step = result.past_key_values, result.logits[:, -1:].argmax(-1)
        out.append(int(step))
    return out
