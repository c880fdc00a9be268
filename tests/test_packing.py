"""Sequence packing: grids of rows, no attention across sequences, padding that trains nothing, equal
micro-batch counts per rank."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from molt_train.actor.policy import token_logprobs
from molt_train.packing import TrainItem, deal, pack


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
