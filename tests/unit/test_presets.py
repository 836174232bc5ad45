"""The model presets (issue 41): each ships its public architecture, and the loss ddptrain trains a preset's model
on is the loss that model defines (transformers' own forward with labels), chunked head or not."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ddptrain.data import IGNORE_INDEX
from ddptrain.model import CausalLMLoss
from tests.conftest import compose_config
from tests.presets import CONF_MODEL, COVERED_ELSEWHERE, PRESETS, asset_config, write_narrowed


def test_every_preset_is_tested() -> None:
    shipped = {path.stem for path in CONF_MODEL.glob("*.yaml")}
    assert shipped == set(PRESETS) | set(COVERED_ELSEWHERE), "a preset without a family here is trained by no test"


@pytest.mark.parametrize("preset", PRESETS)
def test_a_preset_builds_its_public_model_at_full_size(preset: str) -> None:
    """Counted on the meta device: the shipped config.json builds the published model's parameters, to the one."""
    config = AutoConfig.for_model(**asset_config(preset))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == PRESETS[preset][1]


@pytest.mark.parametrize("preset", PRESETS)
def test_the_trained_loss_is_the_models_own(preset: str, tmp_path) -> None:
    """ddptrain's head loss (chunked, and plain) against the model's own forward with labels, in fp32: the same loss
    and, chunked, the same gradient of every weight. Gemma 2 caps its logits (30·tanh(z/30)): a head loss without
    the cap trains another objective."""
    cfg = compose_config([f"model={preset}", "model.init=random"]).model
    config = AutoConfig.from_pretrained(write_narrowed(preset, tmp_path))
    if getattr(config, "final_logit_softcapping", None) is not None:
        config.final_logit_softcapping = 0.1  # the narrow model's logits stay under 1: a cap of 30 would not show
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=cfg.attn_implementation.value).float()
    ids = torch.randint(0, config.vocab_size, (2, 24))
    labels = ids.clone()
    labels[:, :9] = IGNORE_INDEX  # a prompt: its positions are no targets
    own = model(input_ids=ids, labels=labels).loss
    (own_grads := torch.autograd.grad(own, list(model.parameters())))
    for chunk in (0, 5):
        module = CausalLMLoss(model, loss_chunk_tokens=chunk)
        with torch.no_grad():  # evaluation's path
            evaluated, _, evaluated_count = module.eval_sums(ids, labels)
        assert abs(evaluated.item() / evaluated_count - own.item()) <= 1e-5 * own.item(), f"eval, chunk {chunk}"
        total, count = module(ids, labels)
        assert abs(total.item() / count.item() - own.item()) <= 1e-5 * own.item(), f"chunk {chunk}"
        if module.softcap is not None:  # the check can tell: without the cap the loss is another
            module.softcap = None
            with torch.no_grad():
                uncapped, uncapped_count = module(ids, labels)
            assert abs(uncapped.item() / uncapped_count.item() - own.item()) > 1e-3 * own.item()
            module.softcap = config.final_logit_softcapping
        grads = torch.autograd.grad(total / count, list(model.parameters()), allow_unused=True)
        for (name, _), got, expected in zip(model.named_parameters(), grads, own_grads):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6, msg=f"chunk {chunk}: {name}")
