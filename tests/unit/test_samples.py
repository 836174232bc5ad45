"""The eval samples are greedy, whatever the model's own generation_config says, and a batch of left-padded prompts
completes each prompt exactly as a plain greedy loop over that prompt alone does."""

from __future__ import annotations

import pytest
import torch

from ddptrain.evaluation.samples import complete
from ddptrain.model import build_model, build_tokenizer
from tests.conftest import compose_config

CPU = torch.device("cpu")
NEW_TOKENS = 24  # long enough that greedy decoding of the random tiny model repeats a token
# The greedy choice of each step is compared across computations that round differently (a batch against one row,
# a cache against none): a tie within rounding could go either way on another CPU. The test's prompts are chosen by
# design so that every step's best token leads the next by far more than fp32 rounding of a logit (~1e-6 here).
MARGIN = 1e-3


@pytest.fixture(scope="module")
def generator():
    cfg = compose_config([]).model
    tokenizer = build_tokenizer(cfg)
    model = build_model(cfg, 0, CPU, tokenizer).model.eval()
    # Qwen2.5-Instruct ships repetition_penalty=1.05; a strong one makes any leak of it show within NEW_TOKENS.
    model.get_base_model().generation_config.repetition_penalty = 50.0
    return model, tokenizer


def plain_greedy(model, ids: list[int], stop_ids: list[int]) -> tuple[list[int], float]:
    """Greedy decoding written out: the whole sequence through the model at every step, no cache, no padding, the
    argmax of the last position. Returns the tokens and the smallest lead of the chosen token over the next."""
    tokens, smallest_lead = list(ids), float("inf")
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.tensor([tokens])).logits[0, -1].float()
            top = logits.topk(2).values
            smallest_lead = min(smallest_lead, float(top[0] - top[1]))
            tokens.append(int(logits.argmax()))
            if tokens[-1] in stop_ids:
                break
    return tokens[len(ids) :], smallest_lead


def test_batched_left_padded_samples_are_the_greedy_completion_of_each_prompt_alone(generator) -> None:
    model, tokenizer = generator
    stop_ids = [tokenizer.eos_token_id]
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(10, 4000, (n,), generator=g).tolist() for n in (5, 11, 3, 8, 14)]  # uneven: padding
    expected = [plain_greedy(model, p, stop_ids) for p in prompts]
    assert min(lead for _, lead in expected) > MARGIN, "a near tie: pick other prompts (see MARGIN)"
    batched = complete(model, prompts, NEW_TOKENS, stop_ids, tokenizer.pad_token_id, CPU, batch_size=4)
    one_at_a_time = complete(model, prompts, NEW_TOKENS, stop_ids, tokenizer.pad_token_id, CPU, batch_size=1)
    assert batched == one_at_a_time == [tokens for tokens, _ in expected]
    # The model's own generation_config is set aside, not changed, and it would have changed the samples.
    assert model.get_base_model().generation_config.repetition_penalty == 50.0
    with torch.no_grad():
        shipped = [
            model.generate(input_ids=torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]
    assert shipped != [tokens for tokens, _ in expected], "the penalty must show, or the test proves nothing"
