"""remote/acceptance.py: the predicted acceptance length comes from each anchor's chain of hits."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "remote"))
import acceptance  # noqa: E402
from train import simulated_acceptance  # noqa: E402


def test_correlated_misses_are_not_multiplied_as_if_independent():
    # Half the anchors hit every step, half miss every step: acc_i = 0.5 at each of 3 steps.
    hits = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    valid = torch.ones_like(hits)
    chain = acceptance.expected_length(acceptance.chain_lengths(hits, valid))
    assert chain == 2.5  # (4 + 4 + 1 + 1) / 4
    assert abs(simulated_acceptance([0.5, 0.5, 0.5]) - 1.875) < 1e-9  # what the old figure said


def test_a_chain_stops_at_its_first_miss_and_partial_anchors_are_left_out():
    hits = torch.tensor([[1, 0, 1], [0, 1, 1], [1, 1, 1]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    lengths = acceptance.chain_lengths(hits, valid)
    assert lengths.tolist() == [2.0, 1.0]  # anchor 0: hit, miss -> 1 + 1; anchor 1: miss first; anchor 2 out


def test_a_step_fed_a_token_serving_would_not_feed_ends_the_chain():
    # Data token t+2 (fed to step 1) differs from the target's argmax at t+1: serving never sees that context.
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    target_top = torch.tensor([[6, 7, 99, 9, 10, 11]])  # argmax at position 2 predicts 99, data says 8
    follows = acceptance.follows_target(input_ids, target_top, 3)
    assert follows[0].all()
    assert follows[1, 0, :4].tolist() == [True, False, True, True]  # slot 1: data token 3 vs argmax at 2
    assert follows[2, 0, :3].tolist() == [False, True, True]  # slot 0: data token 3 vs argmax at 2


def test_the_prediction_walks_each_answer_as_vllm_does():
    # One answer at slots 2..9 (token 2 from the prefill). Chains by anchor: easy (4) except at 5 (a miss).
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
    lengths = torch.tensor([[1, 4, 4, 4, 4, 1, 4, 4, 4, 4, 1, 1]])
    # drafts at 1 (4 tokens: 3..6), 5 (a miss: 1 token, 7), 6 (4 tokens: 8..11, past the end): 9 tokens, 3 drafts
    assert acceptance.walk(lengths, mask) == (9, 3)
    # every anchor counted alike says (7 * 4 + 1) / 8 = 3.625 for the same answer; the walk 3.0
    two = torch.cat([mask, torch.tensor([[1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0]])])  # a row whose answer starts at 0
    assert acceptance.walk(torch.cat([lengths, lengths]), two) == (9, 3)  # no slot before it: no draft counted


def test_a_chain_reaching_the_answer_end_counts_full_as_vllm_counts_it():
    # vLLM counts a draft's tokens past the stop token as accepted (before check_stop trims them), so a
    # chain that hits every step up to the answer's end counts all k; one that misses before it does not.
    from types import SimpleNamespace

    k, mask = 3, torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])  # the answer: slots 2..7 (token 2 from the prefill)
    input_ids = torch.arange(10, 18).view(1, 8)
    target_top = torch.cat([input_ids[:, 1:], torch.tensor([[0]])], 1)  # the data is the target's greedy path
    valid = {i: torch.zeros(1, 8, dtype=torch.bool) for i in range(k)}
    for i in range(k):
        for t in range(8 - 2 - i):
            valid[i][0, t] = bool(mask[0, t + 2 + i])

    def chains(hits):
        objective = SimpleNamespace(hit_maps=hits, valid_maps=valid, target_top=target_top)
        return acceptance.batch_chains(objective, input_ids, mask, k)[2:]

    # anchor 1 drafts 3..5 (all hit: 4 tokens), anchor 5 drafts 7 (the last) then past the end: 4 counted
    assert chains({i: valid[i].clone() for i in range(k)}) == (8.0, 2.0)
    missed = {i: valid[i].clone() for i in range(k)}
    missed[0][0, 5] = False  # the last token missed: the chain ends there, nothing past the end counts
    assert chains(missed) == (5.0, 2.0)


def test_past_the_stop_the_last_draft_is_scored_against_what_the_target_says_there():
    # The replay carries what the target says after its stop (the sample's tail): vLLM accepts a draft's
    # tokens there only where they match it, so a miss past the stop ends the chain as any miss does.
    from types import SimpleNamespace

    k = 3
    loss = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1]])  # answer: slots 2..7; tail (past the stop): 8..9
    answer = acceptance.answer_mask(loss, [10], [2])
    assert answer.tolist() == [[0, 0, 1, 1, 1, 1, 1, 1, 0, 0]]
    input_ids = torch.arange(10, 20).view(1, 10)
    target_top = torch.cat([input_ids[:, 1:], torch.tensor([[0]])], 1)
    valid = {i: torch.zeros(1, 10, dtype=torch.bool) for i in range(k)}
    for i in range(k):
        valid[i][0, : 10 - 2 - i] = loss[0, 2 + i :].bool()

    def chains(hits):
        objective = SimpleNamespace(hit_maps=hits, valid_maps=valid, target_top=target_top)
        return acceptance.batch_chains(objective, input_ids, loss, k, answer)[2:]

    # anchor 1 drafts 3..5 (4 tokens), anchor 5 drafts 7 (the last), 8 and 9 (past the stop)
    assert chains({i: valid[i].clone() for i in range(k)}) == (8.0, 2.0)
    missed = {i: valid[i].clone() for i in range(k)}
    missed[2][0, 5] = False  # its third token, the target's second past the stop, guessed wrong
    assert chains(missed) == (7.0, 2.0)  # where counting past the stop as accepted would say 8


def test_hits_are_split_by_how_sure_the_target_is_of_the_token_guessed():
    """Slot t's first draft guesses the target's argmax at t+1: its certainty is read there, not at t."""
    hits = torch.tensor([[True, False, True, False, True]])
    scored = torch.tensor([[True, True, True, True, False]])
    top_p = torch.tensor([[0.2, 0.95, 0.5, 0.9, 0.99]])  # sure at positions 1, 3, 4: slots 0, 2, 3
    assert acceptance.hits_by_certainty(hits, scored, top_p) == (2.0, 3.0, 0.0, 1.0)
