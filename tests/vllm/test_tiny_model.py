"""The tiny reasoning model: its tokenizer and template, its build, and vLLM serving it."""
import importlib.util
import json

import pytest

from tests.helpers.fixtures_vllm import MAKER


def load_maker():
    spec = importlib.util.spec_from_file_location("make_tiny_model", MAKER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(tiny_model)


def test_think_tags_are_single_non_special_tokens(tokenizer):
    for tag in ("<think>", "</think>"):
        assert len(tokenizer.encode(tag, add_special_tokens=False)) == 1
        assert tag not in tokenizer.all_special_tokens
    # vLLM detokenizes with skip_special_tokens: the tags must survive it, <|im_end|> must not.
    ids = tokenizer.encode("<think>\nx\n</think>\n\ny<|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>\nx\n</think>\n\ny"
    assert tokenizer.eos_token == "<|im_end|>"


def test_chat_template_renders_like_qwen3(tokenizer):
    chat = [{"role": "system", "content": "S"},
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1", "reasoning": "R1"},
            {"role": "user", "content": "Q2"},
            {"role": "assistant", "content": "A2", "reasoning_content": "R2"}]
    # As in Qwen3, thinking before the last user turn is dropped.
    assert tokenizer.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ1<|im_end|>\n"
        "<|im_start|>assistant\nA1<|im_end|>\n<|im_start|>user\nQ2<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nR2\n</think>\n\nA2<|im_end|>\n")
    prompt = chat[1:2]
    assert tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.apply_chat_template(
        prompt, tokenize=False, add_generation_prompt=True, enable_thinking=False,
    ).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_build_is_deterministic_in_tokenizer_and_data(tiny_model):
    """Rebuilding the data and tokenizer (not the weights) reproduces the cached model's."""
    maker = load_maker()
    samples, tok = maker.build_data(seed=0, n_samples=20000)
    again, _ = maker.build_data(seed=0, n_samples=20000)
    assert samples == again
    built = json.loads((tiny_model / "tokenizer.json").read_text())
    fresh = json.loads(tok.backend_tokenizer.to_str())
    assert fresh["model"]["vocab"] == built["model"]["vocab"]
    assert fresh["model"]["merges"] == built["model"]["merges"]
    assert fresh["added_tokens"] == built["added_tokens"]


def test_prompt_file_rows_are_deterministic_and_perfectblend_shaped():
    maker = load_maker()
    rows = list(maker.prompt_rows(50, seed=1))
    assert rows == list(maker.prompt_rows(50, seed=1))
    assert rows != list(maker.prompt_rows(50, seed=2))
    for row in rows:
        assert row.keys() == {"id", "source", "conversations"}
        assert {turn["from"] for turn in row["conversations"]} <= {"system", "human", "gpt"}
        assert all("<think>" not in turn["value"] for turn in row["conversations"])


def reasoning_of(message):
    extra = message.model_extra or {}
    return extra.get("reasoning") or extra.get("reasoning_content")


@pytest.mark.parametrize("question", ["What is 12 + 30?", "Reverse the word 'apple'.",
                                      "Is 17 even or odd?"])
def test_vllm_returns_reasoning_and_content(vllm_server, question):
    from openai import OpenAI

    client = OpenAI(base_url=vllm_server.base_url + "/v1", api_key="unused")
    choice = client.chat.completions.create(
        model=vllm_server.model, messages=[{"role": "user", "content": question}],
        max_tokens=256, temperature=0,
    ).choices[0]
    assert (reasoning_of(choice.message) or "").strip(), choice.message
    assert (choice.message.content or "").strip(), choice.message
    assert "<think>" not in choice.message.content and "</think>" not in choice.message.content
    assert choice.finish_reason == "stop"


def test_vllm_without_thinking_answers_in_content(vllm_server):
    from openai import OpenAI

    client = OpenAI(base_url=vllm_server.base_url + "/v1", api_key="unused")
    choice = client.chat.completions.create(
        model=vllm_server.model, messages=[{"role": "user", "content": "What is 3 * 4?"}],
        max_tokens=256, temperature=0,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    ).choices[0]
    assert not reasoning_of(choice.message)
    assert (choice.message.content or "").strip()
    assert choice.finish_reason == "stop"
