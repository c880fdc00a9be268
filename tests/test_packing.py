"""Sequence packing: no padding, no attention across sequences, equal micro-batch counts per rank."""

import torch
from transformers import AutoModelForCausalLM

from molt_train.actor.policy import token_logprobs
from molt_train.packing import TrainItem, deal, pack


def _item(ids, advantage=1.0, age=0):
    mask = [0] + [1] * (len(ids) - 1)
    return TrainItem(token_ids=ids, mask=mask, logprobs=[None] + [-1.0] * (len(ids) - 1),
                     ages=[0] + [age] * (len(ids) - 1), advantage=advantage)


def test_packed_logprobs_equal_each_sequence_alone(moe_dir):
    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    generator = torch.Generator().manual_seed(0)
    items = [_item(torch.randint(3, 1000, (n,), generator=generator).tolist()) for n in (9, 17, 5)]
    (packed,) = pack(items, token_budget=100)
    assert packed.num_tokens == 31  # no padding
    with torch.no_grad():
        together, _ = token_logprobs(model, packed)
        offset = 0
        for item in items:
            (alone,) = pack([item], token_budget=100)
            single, _ = token_logprobs(model, alone)
            n = len(item.token_ids)
            assert torch.allclose(together[offset:offset + n], single, atol=1e-5)
            offset += n


def test_budget_and_dealing():
    items = [_item(list(range(3, 3 + n))) for n in (10, 10, 10, 25, 4)]
    batches = pack(items, token_budget=24)
    assert [mb.num_tokens for mb in batches] == [20, 10, 25, 4]  # a long one gets its own
    shares = deal(batches, world_size=3)
    assert [len(share) for share in shares] == [2, 2, 2]  # padded with an empty micro-batch
    assert sum(mb.mask.sum().item() for share in shares for mb in share) == sum(sum(i.mask) for i in items)


def test_micro_batch_carries_each_token_age_and_advantage():
    (mb,) = pack([_item([5, 6, 7], advantage=0.5, age=0), _item([8, 9], advantage=-1.0, age=2)], token_budget=10)
    assert mb.ages.tolist() == [0, 0, 0, 0, 2]
    assert mb.mask.tolist() == [0, 1, 1, 0, 1] and mb.sequence.tolist() == [0, 0, 0, 1, 1]
    assert mb.advantages.tolist() == [0.5, 0.5, 0.5, -1.0, -1.0]
    assert mb.engine_logprobs.tolist() == [0.0, -1.0, -1.0, 0.0, -1.0]  # 0 where the engine sampled nothing
