#!/usr/bin/env python3
"""Build a tiny Qwen3-shaped reasoning model from nothing, for tests and the local demo.

    python remote/make_tiny_model.py OUT_DIR [--seed 0] [--steps 600]
    python remote/make_tiny_model.py --write-prompts examples/prompts.jsonl --n-prompts 300

Nothing comes from a model hub: the script invents a small chat domain (arithmetic,
word games, comparisons), trains a byte-level BPE tokenizer on it, and trains a
2-layer Qwen3ForCausalLM to answer like Qwen3 does:
`<think>\\n...steps...\\n</think>\\n\\nanswer<|im_end|>`. Served by vLLM with
`--reasoning-parser qwen3` it returns `message.reasoning` and `message.content` and
stops at EOS, like a real reasoning model, in 1.7 MB.

Deterministic: the same seed and steps give the same files (fp32, fixed thread count).
`--write-prompts` writes open-perfectblend-shaped rows of the same domain, whose "gpt"
answers are the dataset's own wording (no thinking), from a separate seed stream.
"""
import argparse
import json
import math
import os
import random
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
THINK_TOKENS = ["<think>", "</think>"]  # added, NOT special: vLLM's qwen3 parser needs them in the text
VOCAB_SIZE = 512  # BPE vocab incl. specials, plus the two think tokens

# Qwen3's chat template (Qwen/Qwen3-8B) without the tool-calling parts, and accepting
# `reasoning` as well as `reasoning_content` on assistant messages. As in Qwen3, only
# assistant turns after the last user message keep their thinking.
CHAT_TEMPLATE = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}
        {%- set ns.last_query_index = (messages|length - 1) - loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif message.reasoning is string %}
            {%- set reasoning_content = message.reasoning %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}
"""

# ---------------------------------------------------------------------------------------
# The synthetic domain. Each task returns (question, thinking steps, answer, dataset answer):
# the answer is what the model learns to say; the dataset answer is a different wording,
# as a human-written dataset would have it.

WORDS = """apple banana cherry garden river stone cloud pencil window rocket tiger lemon orange
silver planet forest candle bridge yellow guitar winter summer dragon castle butter cactus
mirror number simple little house light green water music paper table chair horse zebra mango
grape melon ocean storm train plane bread cheese pizza basket bottle button carpet doctor
engine family finger flower hammer island jacket kitten ladder marble needle pepper pillow
rabbit saddle school spider sugar tomato turtle valley wallet yogurt""".split()

SYSTEM_PROMPTS = [
    "You are a helpful assistant.",
    "You are a careful tutor. Think step by step.",
    "Answer briefly.",
    "You are Tiny, a small reasoning model.",
]


def plural(n, word):
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def task_add(rng):
    a, b = rng.randint(1, 99), rng.randint(1, 99)
    q = rng.choice(["What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} plus {b}.",
                    "What is the sum of {a} and {b}?"]).format(a=a, b=b)
    ones = a % 10 + b % 10
    steps = [f"Add the ones: {a % 10} + {b % 10} = {ones}."]
    if a >= 10 or b >= 10 or ones >= 10:
        carry = ones // 10
        steps.append(f"Add the tens: {a // 10} + {b // 10} + {carry} = {a // 10 + b // 10 + carry}.")
    steps.append(f"So {a} + {b} = {a + b}.")
    return q, steps, f"{a} + {b} = {a + b}.", f"The sum is {a + b}."


def task_subtract(rng):
    a, b = sorted((rng.randint(1, 99), rng.randint(1, 99)), reverse=True)
    q = rng.choice(["What is {a} - {b}?", "Subtract {b} from {a}.",
                    "What is {a} minus {b}?"]).format(a=a, b=b)
    steps = [f"Start from {a} and take away {b}.", f"{a} - {b} = {a - b}.",
             f"Check: {a - b} + {b} = {a}."]
    return q, steps, f"{a} - {b} = {a - b}.", f"{a - b}"


def task_multiply(rng):
    a, b = rng.randint(2, 12), rng.randint(2, 12)
    q = rng.choice(["What is {a} times {b}?", "What is {a} * {b}?",
                    "Multiply {a} by {b}."]).format(a=a, b=b)
    steps = [f"{a} * {b} is {a} groups of {b}.", f"{a} * {b} = {a * b}."]
    return q, steps, f"{a} * {b} = {a * b}.", f"The product is {a * b}."


def task_reverse(rng):
    w = rng.choice(WORDS)
    q = rng.choice(["Reverse the word '{w}'.", "Spell '{w}' backwards.",
                    "What is '{w}' written backwards?"]).format(w=w)
    steps = [f"The letters of '{w}' are {', '.join(w)}.",
             f"Backwards they are {', '.join(w[::-1])}.", f"Joined: {w[::-1]}."]
    return q, steps, f"The reverse of '{w}' is '{w[::-1]}'.", w[::-1]


def task_upper(rng):
    w = rng.choice(WORDS)
    q = rng.choice(["Write '{w}' in capital letters.", "Convert '{w}' to upper case.",
                    "What is '{w}' in uppercase?"]).format(w=w)
    steps = ["Each letter becomes its capital.", f"{' '.join(w)} -> {' '.join(w.upper())}."]
    return q, steps, w.upper(), f"Sure: {w.upper()}"


def task_count_letter(rng):
    w = rng.choice(WORDS)
    c = rng.choice(w) if rng.random() < 0.8 else rng.choice("abcdefghijklmnopqrstuvwxyz")
    k = w.count(c)
    q = rng.choice(["How many times does the letter '{c}' appear in '{w}'?",
                    "Count the letter '{c}' in '{w}'."]).format(c=c, w=w)
    where = [str(i + 1) for i, x in enumerate(w) if x == c]
    found = f"'{c}' is at position {', '.join(where)}." if where else f"'{c}' does not appear."
    steps = [f"Spell it: {', '.join(w)}.", found, f"That makes {k}."]
    return q, steps, f"The letter '{c}' appears {plural(k, 'time')} in '{w}'.", f"{k}"


def task_length(rng):
    w = rng.choice(WORDS)
    q = rng.choice(["How many letters are in '{w}'?", "How long is the word '{w}'?"]).format(w=w)
    steps = [f"Spell it: {', '.join(w)}.", f"Counting them gives {len(w)}."]
    return q, steps, f"'{w}' has {len(w)} letters.", f"{len(w)} letters."


def task_compare(rng):
    a, b = rng.sample(range(1, 100), 2)
    big, small = max(a, b), min(a, b)
    q = rng.choice(["Which is larger, {a} or {b}?", "Which number is bigger: {a} or {b}?",
                    "Is {a} greater than {b}?"]).format(a=a, b=b)
    steps = [f"Compare {a} and {b}.", f"{big} - {small} = {big - small}, which is positive.",
             f"So {big} is larger."]
    return q, steps, f"{big} is larger than {small}.", f"{big}"


def task_parity(rng):
    n = rng.randint(1, 999)
    parity = "even" if n % 2 == 0 else "odd"
    q = rng.choice(["Is {n} even or odd?", "Is the number {n} odd or even?"]).format(n=n)
    d = n % 10
    steps = [f"The last digit of {n} is {d}.", f"{d} is {parity}, so {n} is {parity}."]
    return q, steps, f"{n} is {parity}.", f"It is {parity}."


def task_next(rng):
    n = rng.randint(1, 998)
    q = rng.choice(["What number comes after {n}?", "What is the next number after {n}?",
                    "Count one up from {n}."]).format(n=n)
    steps = [f"The next number is one more than {n}.", f"{n} + 1 = {n + 1}."]
    return q, steps, f"{n + 1} comes after {n}.", f"{n + 1}"


TASKS = [task_add, task_subtract, task_multiply, task_reverse, task_upper, task_count_letter,
         task_length, task_compare, task_parity, task_next]


def make_conversation(rng, p_system, p_multi_turn):
    """A chat of 1-3 user turns, sometimes with a system message.

    Returns (system or None, [(question, steps, answer, dataset_answer), ...]).
    """
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < p_system else None
    turns = rng.randint(2, 3) if rng.random() < p_multi_turn else 1
    return system, [rng.choice(TASKS)(rng) for _ in range(turns)]


# ---------------------------------------------------------------------------------------
# Training samples: a prompt rendered by the chat template exactly as vLLM would render it
# for the last turn, and the completion the model should produce.

def training_sample(rng, render):
    """(prompt text, completion text) for one conversation's last assistant turn.

    Earlier assistant turns are what a regenerating client sends back: content only,
    sometimes with the leading "\\n\\n" vLLM's qwen3 parser leaves in it.
    """
    system, turns = make_conversation(rng, p_system=0.15, p_multi_turn=0.15)
    messages = [{"role": "system", "content": system}] if system else []
    for question, _, answer, _ in turns[:-1]:
        lead = "\n\n" if rng.random() < 0.5 else ""
        messages += [{"role": "user", "content": question},
                     {"role": "assistant", "content": lead + answer}]
    question, steps, answer, _ = turns[-1]
    messages.append({"role": "user", "content": question})
    thinking = rng.random() >= 0.1
    prompt = render(messages, add_generation_prompt=True, enable_thinking=thinking)
    if not thinking:
        return prompt, answer + "<|im_end|>"
    full = render(messages + [{"role": "assistant", "content": answer,
                               "reasoning_content": "\n".join(steps)}])
    assert full.startswith(prompt) and full.endswith("<|im_end|>\n"), "template drift"
    return prompt, full[len(prompt):-1]


def make_tokenizer(texts):
    """Byte-level BPE trained on `texts`, with ChatML specials and non-special think tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    markers = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + THINK_TOKENS))
    pieces = (piece for text in texts for piece in markers.split(text) if piece)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(THINK_TOKENS), special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(pieces, trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return tok


def hf_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False, model_max_length=2048)
    hf.chat_template = CHAT_TEMPLATE
    hf.init_kwargs["tokenizer_class"] = "PreTrainedTokenizerFast"  # the name every transformers knows
    return hf


def build_data(seed, n_samples):
    """Training texts and the tokenizer trained on them (cheap; no model involved)."""
    # The template renders with the tokenizer's own Jinja environment (as vLLM does), so a
    # throwaway tokenizer provides it before the real one exists.
    from tokenizers import Tokenizer, models
    renderer = hf_tokenizer(Tokenizer(models.BPE()))

    def render(messages, **kw):
        return renderer.apply_chat_template(messages, tokenize=False, **kw)

    rng = random.Random(f"train:{seed}")
    samples = [training_sample(rng, render) for _ in range(n_samples)]
    tok = hf_tokenizer(make_tokenizer(p + c for p, c in samples))
    return samples, tok


# ---------------------------------------------------------------------------------------
# The model.

def model_config(tok):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tok), hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id, dtype="float32")


def encode(tok, samples):
    """Token ids and a mask that is 1 on completion tokens (the only ones with a loss).

    Prompt and completion are encoded separately, as vLLM encodes the prompt alone.
    """
    prompts = tok([p for p, _ in samples], add_special_tokens=False)["input_ids"]
    completions = tok([c for _, c in samples], add_special_tokens=False)["input_ids"]
    return [(p + c, [0] * len(p) + [1] * len(c)) for p, c in zip(prompts, completions)]


def batch(encoded, idx, pad_id):
    import torch

    width = max(len(encoded[i][0]) for i in idx)
    ids = torch.full((len(idx), width), pad_id)
    labels = torch.full((len(idx), width), -100)
    for row, i in enumerate(idx):
        seq, mask = encoded[i]
        ids[row, :len(seq)] = torch.tensor(seq)
        labels[row, :len(seq)] = torch.tensor([t if m else -100 for t, m in zip(seq, mask)])
    return ids, labels


def corrupt(ids, labels, plain_ids, p, gen):
    """Swap a fraction `p` of the completion's input tokens for random plain tokens, labels
    unchanged: the model learns to get back on track after a wrong token (its own sampling
    mistakes) instead of looping or ending inside the thinking."""
    import torch

    pick = ((labels != -100) & torch.isin(ids, plain_ids)
            & (torch.rand(ids.shape, generator=gen) < p))
    noise = plain_ids[torch.randint(len(plain_ids), ids.shape, generator=gen)]
    return torch.where(pick, noise, ids)


def progress(**fields):
    print("specops-progress " + json.dumps(fields, separators=(",", ":")), flush=True)


def train(model, encoded, pad_id, plain_ids, *, steps, batch_size, lr, seed, noise=0.05):
    import torch

    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)

    def lr_at(step):  # linear warmup, cosine decay to 10%
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    start = last = time.monotonic()
    for step in range(steps):
        idx = torch.randint(len(encoded), (batch_size,), generator=gen).tolist()
        ids, labels = batch(encoded, idx, pad_id)
        ids = corrupt(ids, labels, plain_ids, noise, gen)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        now = time.monotonic()
        if now - last > 5 or step == steps - 1:
            last = now
            progress(stage="train", step=step + 1, steps=steps, loss=round(loss.item(), 4),
                     elapsed_s=round(now - start, 1))
    model.eval()


def format_check(model, tok, seed, n=24):
    """Fraction of held-out prompts answered as `<think>...</think>\\n\\nanswer<|im_end|>`,
    sampling as vLLM would with generation_config.json's defaults."""
    import torch

    rng = random.Random(f"check:{seed}")
    torch.manual_seed(seed)
    ok = 0
    for _ in range(n):
        question = rng.choice(TASKS)(rng)[0]
        prompt = tok.apply_chat_template([{"role": "user", "content": question}],
                                         tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=200, do_sample=True, temperature=0.6,
                                 top_p=0.95, top_k=20, eos_token_id=tok.eos_token_id,
                                 pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1]:])
        ok += bool(re.fullmatch(r"<think>\n.+\n</think>\n\n.+<\|im_end\|>", text, re.S))
    return ok / n


def build(out_dir, *, seed, steps, batch_size=32, lr=3e-3, n_samples=20000):
    # Idle OpenMP threads sleep instead of spinning: on a shared, busy machine spinning
    # threads slowed training up to 5x. Set before torch loads its OpenMP runtime.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch
    from transformers import GenerationConfig, Qwen3ForCausalLM

    torch.set_num_threads(2)  # fixed, so the float reductions (and the weights) are reproducible
    torch.use_deterministic_algorithms(True)
    t0 = time.monotonic()
    samples, tok = build_data(seed, n_samples)
    encoded = encode(tok, samples)
    progress(stage="data", samples=len(samples), vocab=len(tok),
             mean_tokens=round(sum(len(s) for s, _ in encoded) / len(encoded), 1),
             elapsed_s=round(time.monotonic() - t0, 1))

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(model_config(tok))
    structural = set(tok.all_special_ids) | set(tok.convert_tokens_to_ids(THINK_TOKENS))
    plain_ids = torch.tensor([i for i in range(len(tok)) if i not in structural])
    train(model, encoded, tok.pad_token_id, plain_ids,
          steps=steps, batch_size=batch_size, lr=lr, seed=seed)
    model.generation_config = GenerationConfig(  # Qwen3's recommended thinking-mode sampling
        bos_token_id=model.config.bos_token_id, pad_token_id=tok.pad_token_id,
        eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")],
        do_sample=True, temperature=0.6, top_p=0.95, top_k=20)
    ok = format_check(model, tok, seed)
    if ok < 0.75:  # never hand out a model that does not think-then-answer
        print(f"make_tiny_model: only {ok:.0%} of the check answers had the "
              "<think>...</think> answer<|im_end|> shape; try more --steps", file=sys.stderr)
        return 1

    # Write next to OUT_DIR and rename, so a reader never sees a half-built model.
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    config_path = tmp / "tokenizer_config.json"  # keep the template in the config too, as Qwen3 does
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (tmp / "chat_template.jinja").unlink(missing_ok=True)
    for path in [tmp, *tmp.iterdir()]:  # mkdtemp's 0700 would hide the model from other users
        path.chmod(0o755 if path.is_dir() else 0o644)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    progress(stage="done", out=str(out_dir), format_ok=ok, vocab=len(tok),
             params=sum(p.numel() for p in model.parameters()),
             elapsed_s=round(time.monotonic() - t0, 1))
    return 0


# ---------------------------------------------------------------------------------------
# The prompt file: open-perfectblend-shaped rows with the dataset's own answers.

def prompt_rows(n, seed):
    rng = random.Random(f"prompts:{seed}")
    for i in range(n):
        system, turns = make_conversation(rng, p_system=0.05, p_multi_turn=0.1)
        conversations = [{"from": "system", "value": system}] if system else []
        for question, _, _, dataset_answer in turns:
            conversations += [{"from": "human", "value": question},
                              {"from": "gpt", "value": dataset_answer}]
        yield {"id": f"tiny-{seed}-{i:05d}", "source": "specops/tiny-domain",
               "conversations": conversations}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", nargs="?", help="where to write the model (HF directory)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the training data and weights")
    ap.add_argument("--steps", type=int, default=600, help="training steps (batch 32)")
    ap.add_argument("--write-prompts", metavar="FILE", help="also write a prompt file (jsonl)")
    ap.add_argument("--n-prompts", type=int, default=300, help="rows in the prompt file")
    ap.add_argument("--prompts-seed", type=int, default=1,
                    help="seed of the prompt file (its own stream: held out from training)")
    args = ap.parse_args(argv)
    if not args.out_dir and not args.write_prompts:
        ap.error("give OUT_DIR, --write-prompts FILE, or both")
    if args.steps < 1 or args.n_prompts < 1:
        ap.error("--steps and --n-prompts must be positive")
    out = Path(args.out_dir) if args.out_dir else None
    if out and out.exists() and not (out / "config.json").exists() and (
            not out.is_dir() or any(out.iterdir())):
        print(f"make_tiny_model: {out} exists and is not a model directory; "
              "refusing to replace it", file=sys.stderr)
        return 2

    if args.write_prompts:
        path = Path(args.write_prompts)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            for row in prompt_rows(args.n_prompts, args.prompts_seed):
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        print(f"wrote {args.n_prompts} rows to {path}", flush=True)
    if out:
        return build(out, seed=args.seed, steps=args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
