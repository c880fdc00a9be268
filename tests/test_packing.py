"""Sequence packing: grids of rows, no attention across sequences, padding that trains nothing, equal
micro-batch counts per rank; prefix trees that give each item's logprobs and gradients."""

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from molt_train.actor.policy import token_logprobs
from molt_train.packing import TrainItem, deal, pack, trees


def _item(ids, advantage=1.0, age=0):
    mask = [0] + [1] * (len(ids) - 1)
    return TrainItem(token_ids=ids, mask=mask, logprobs=[None] + [-1.0] * (len(ids) - 1),
                     ages=[0] + [age] * (len(ids) - 1), advantage=advantage)


@pytest.mark.parametrize("rows", [True, False])
def test_packed_logprobs_equal_each_sequence_alone(moe_dir, rows):
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    items = [_item(torch.randint(3, 1000, (n,), generator=generator).tolist()) for n in (9, 17, 5)]
    (packed,) = pack(items, token_budget=100, rows=rows)
    # rows: 17 | 9 + 5 + 3 of padding; one row: the items in order, no padding
    assert (packed.num_tokens, packed.rows) == ((34, 2) if rows else (31, 1))
    with torch.no_grad():
        together, _ = token_logprobs(model, packed)
        found = 0
        for item in items:
            (alone,) = pack([item], token_budget=100)
            single, _ = token_logprobs(model, alone)
            for index in packed.sequence.unique():
                where = packed.sequence == index
                if packed.input_ids[where].tolist() == item.token_ids:
                    assert torch.allclose(together[where], single, atol=1e-5)
                    found += 1
        assert found == len(items)


def test_budget_rows_and_dealing():
    items = [_item(list(range(3, 3 + n))) for n in (10, 10, 10, 25, 4)]
    batches = pack(items, token_budget=24)
    # longest first: 25 alone (over the budget); rows of 10: two per micro-batch, the 4 padded to 10
    assert [(mb.num_tokens, mb.rows) for mb in batches] == [(25, 1), (20, 2), (20, 2)]
    assert sum(mb.mask.sum().item() for mb in batches) == sum(sum(i.mask) for i in items)
    assert all(mb.position_ids.view(mb.rows, -1)[:, 0].eq(0).all() for mb in batches)  # a row starts a sequence
    shares = deal(batches, world_size=2)
    assert [len(share) for share in shares] == [2, 2]  # padded with an empty micro-batch
    assert sum(mb.mask.sum().item() for share in shares for mb in share) == sum(sum(i.mask) for i in items)


def test_micro_batch_carries_each_token_age_and_advantage():
    (mb,) = pack([_item([5, 6, 7], advantage=0.5, age=0), _item([8, 9], advantage=-1.0, age=2)], token_budget=10)
    assert (mb.width, mb.rows) == (3, 2)  # the second row: [8, 9] and one token of padding
    assert mb.position_ids.tolist() == [0, 1, 2, 0, 1, 0]
    assert mb.ages.tolist() == [0, 0, 0, 0, 2, 0]
    assert mb.mask.tolist() == [0, 1, 1, 0, 1, 0] and mb.sequence.tolist() == [0, 0, 0, 1, 1, 2]
    assert mb.advantages.tolist() == [0.5, 0.5, 0.5, -1.0, -1.0, 0.0]
    assert mb.engine_logprobs.tolist() == [0.0, -1.0, -1.0, 0.0, -1.0, 0.0]  # 0 where the engine sampled nothing


def test_rows_take_the_width_that_pads_least():
    # a 5-token item and four of 3: rows as wide as the longest pad each 3 with 2; rows of 6 take two 3s each
    items = [_item(list(range(3, 3 + n))) for n in (5, 3, 3, 3, 3)]
    (narrow,) = pack(items, token_budget=64)
    assert (narrow.num_tokens, narrow.rows, narrow.width) == (25, 5, 5)
    (wide,) = pack(items, token_budget=64, max_width=6)
    assert (wide.num_tokens, wide.rows, wide.width) == (18, 3, 6)
    assert wide.mask.sum() == narrow.mask.sum() == sum(sum(item.mask) for item in items)
    assert wide.position_ids.view(3, 6)[:, 0].eq(0).all() and wide.item.tolist().count(-1) == 1  # one pad
    # one row of 5 + 3 beats two rows of 5, unless attention's cost, which grows with the square of a row's
    # width, outweighs the padding it saves
    assert [(mb.num_tokens, mb.rows) for mb in pack(items[:2], token_budget=64, max_width=8)] == [(8, 1)]
    assert [(mb.num_tokens, mb.rows) for mb in pack(items[:2], token_budget=64, max_width=8, attention=1.0)] == [
        (10, 2)]


def _reply(head, reply, advantage=1.0):
    ids = head + reply
    return TrainItem(token_ids=ids, mask=[0] * len(head) + [1] * len(reply),
                     logprobs=[None] * len(head) + [-1.0] * len(reply), ages=[0] * len(ids), advantage=advantage)


def test_prefix_tree_layout():
    items = [_reply([5, 6, 7], [8, 9], 0.5), _reply([5, 6, 7], [10], -1.0), _reply([4, 6, 7], [11], 2.0)]
    (mb,) = pack(items, token_budget=100, tree_tokens=100)
    # the tree [5 6 7 | 8 9 | 10] (6 tokens) is one row, [4 6 7 11] and 2 tokens of padding the other
    assert (mb.width, mb.rows) == (6, 2)
    assert mb.input_ids.tolist() == [5, 6, 7, 8, 9, 10, 4, 6, 7, 11, 0, 0]
    assert mb.position_ids.tolist() == [0, 1, 2, 3, 4, 3, 0, 1, 2, 3, 0, 1]
    assert mb.predecessor.tolist() == [-1, 0, 1, 2, 3, 2, -1, 6, 7, 8, -1, 10]  # 10 is predicted from 7
    assert mb.branch.tolist() == [0, 0, 0, 1, 1, 2, 0, 0, 0, 0, 0, 0]
    assert mb.sequence.tolist() == [0, 0, 0, 0, 0, 1, 2, 2, 2, 2, 3, 3]
    assert mb.mask.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 0, 0]
    assert mb.advantages.tolist() == [0, 0, 0, 0.5, 0.5, -1.0, 2.0, 2.0, 2.0, 2.0, 0, 0]
    # without sharing, as before: each item whole
    assert sum(mb.num_tokens for mb in pack(items, token_budget=100)) == 3 * 5


def test_prefix_trees_split_at_the_budget_and_at_different_routes():
    import numpy as np

    head = list(range(3, 13))
    items = [_reply(head, [20 + i] * 4) for i in range(5)]
    sizes = [len(unit) for unit in trees(items, max_tokens=10 + 3 * 4)]
    assert sizes == [3, 2]  # the head (10) and three replies of 4 fit 22 tokens; the rest is a second tree
    routed = [replace(item, routes=np.zeros((14, 1, 2), np.int16)) for item in items[:3]]
    routed[2].routes[1] = 1  # the engine routed this item's prompt differently: it cannot share that head
    assert [len(unit) for unit in trees(routed, max_tokens=100)] == [2, 1]


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_prefix_tree_logprobs_and_gradients_equal_the_items_alone(dense_dir, attention):
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32, attn_implementation=attention)
    generator = torch.Generator().manual_seed(0)

    def tokens(n):
        return torch.randint(3, 1000, (n,), generator=generator).tolist()

    prompts = [tokens(9), tokens(5)]
    items = ([_reply(prompts[0], tokens(n), a) for n, a in ((3, 1.0), (1, -0.5), (6, 0.25), (2, 2.0))]
             + [_reply(prompts[1], tokens(n), a) for n, a in ((4, -1.0), (2, 1.5))] + [_reply(tokens(7), tokens(3))])

    def loss_and_grads(micro_batches):
        model.zero_grad()
        values = []
        for mb in micro_batches:
            logprobs, _ = token_logprobs(model, mb)
            (logprobs * mb.advantages * mb.mask).sum().backward()
            values += [(tuple(mb.input_ids[mb.sequence == s].tolist()), logprobs[mb.sequence == s][mb.mask[
                mb.sequence == s] > 0]) for s in mb.sequence.unique()]
        return values, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    shared = pack(items, token_budget=64, tree_tokens=64)
    plain = pack(items, token_budget=64)
    assert any(mb.branch is not None for mb in shared)
    assert sum(mb.num_tokens for mb in shared) < sum(mb.num_tokens for mb in plain)
    shared_values, shared_grads = loss_and_grads(shared)
    plain_values, plain_grads = loss_and_grads(plain)
    # each item's trained logprobs: in the tree its tokens follow the shared head (or one branch), so
    # compare by the trained tokens' values, item by item
    alone = {tuple(item.token_ids): token_logprobs(model, pack([item], 100)[0])[0].detach() for item in items}
    found = 0
    for item in items:
        expected = alone[tuple(item.token_ids)][torch.tensor(item.mask, dtype=torch.bool)]
        for _, values in shared_values:
            if len(values) == len(expected) and torch.allclose(values.detach(), expected, atol=1e-5):
                found += 1
                break
    assert found == len(items)
    assert plain_grads.keys() == shared_grads.keys()
    for name, grad in plain_grads.items():
        assert torch.allclose(shared_grads[name], grad, atol=1e-5, rtol=1e-4), name


@pytest.mark.parametrize("layout", ["rows", "one row", "trees"])
def test_every_trained_token_names_its_item_and_position(layout):
    """`MicroBatch.item` with `position_ids` is the way back from a packed token to the item it came from."""
    generator = torch.Generator().manual_seed(1)
    head = [7, 8, 9, 10]  # a group's shared prompt, for the trees
    items = [_item(head + torch.randint(3, 1000, (n,), generator=generator).tolist()) for n in (6, 3, 11, 2, 8)]
    for item in items:
        item.mask[:len(head)] = [0] * len(head)
    batches = pack(items, token_budget=24, rows=layout != "one row", tree_tokens=40 if layout == "trees" else 0)
    assert (layout == "trees") == any(mb.branch is not None for mb in batches)
    seen = set()
    for mb in deal(batches, world_size=2)[0] + deal(batches, world_size=2)[1]:
        for token, item, position, trained in zip(mb.input_ids.tolist(), mb.item.tolist(), mb.position_ids.tolist(),
                                                  mb.mask.tolist()):
            if trained:
                assert items[item].token_ids[position] == token and items[item].mask[position] == 1
                seen.add((item, position))
            elif item == -1:  # padding
                assert token == 0
    assert seen == {(i, p) for i, item in enumerate(items) for p, m in enumerate(item.mask) if m}
