"""The loss module against a plain reference, packing, gradient checkpointing and LoRA setup."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from ddptrain.config import Attention, DataConfig, DType, ModelConfig, ModelInit
from ddptrain.data import IGNORE_INDEX, Collator, RowEncoder
from ddptrain.model import (
    CausalLMLoss,
    apply_gradient_checkpointing,
    build_base_model,
    build_model,
    build_tokenizer,
    check_tokenizer_fits,
)
from ddptrain.model.head_loss import ChunkedHeadLoss
from tests.conftest import QWEN2_TOKENIZER, REPO, compose_config, requires_shared
from tests.numerics import reordered_sum_tolerance

CPU = torch.device("cpu")
TINY_CONFIG = json.loads((REPO / "ddptrain" / "assets" / "tiny_qwen2" / "config.json").read_text())
TINY_VOCAB, TINY_LAYERS = TINY_CONFIG["vocab_size"], TINY_CONFIG["num_hidden_layers"]
# The head's backward sums over the vocabulary, the longest reduction here; a LoRA gradient then crosses every decoder
# layer (tests/numerics.py). About 1.6e-5 for a loss, 4.7e-5 for a gradient.
LOSS_TOL = reordered_sum_tolerance(TINY_VOCAB)
GRAD_TOL = reordered_sum_tolerance(TINY_VOCAB, depth=TINY_LAYERS + 1)
TINY_INSTRUCT = REPO / "ddptrain" / "assets" / "tiny_instruct.jsonl"


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny() -> ModelConfig:
    return compose_config([]).model


@pytest.fixture(scope="module")
def samples(tiny) -> list[dict[str, list[int]]]:
    """Four real rows of the bundled data, tokenized with their prompts masked."""
    tokenizer = build_tokenizer(tiny)
    encoder = RowEncoder(DataConfig(path=str(TINY_INSTRUCT)), tokenizer)
    with open(TINY_INSTRUCT) as f:
        rows = [json.loads(next(f)) for _ in range(4)]
    encoded = encoder.encode_turns([encoder.turns(row) for row in rows])
    return [{"input_ids": ids, "labels": labels} for ids, labels, _ in encoded]


def lora_params(module: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return {name: p for name, p in module.named_parameters() if "lora_" in name}


def randomize_lora_b(module: torch.nn.Module, seed: int = 1) -> None:
    """LoRA B starts at zero, which would leave lora_A without gradient; give it values."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in lora_params(module).items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in lora_params(module).items()}


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_same_grads(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], tol: float) -> None:
    assert got.keys() == expected.keys() and got
    worst = max(expected, key=lambda name: rel_diff(got[name], expected[name]))
    assert rel_diff(got[worst], expected[worst]) <= tol, worst


def make_model(cfg: ModelConfig, seed: int = 0) -> CausalLMLoss:
    model = build_model(cfg, seed, CPU)
    randomize_lora_b(model)
    return model.train()


def reference_loss_sum(loss_module: CausalLMLoss, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Full logits from the plain transformers call, then cross-entropy over the shifted labels."""
    logits = loss_module.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(),
        batch["labels"][:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


# ----------------------------------------------------------------------------- loss


@pytest.mark.parametrize("chunk", [0, 4, 2048], ids=["plain-autograd", "chunks-of-4", "one-chunk"])
def test_target_only_head_matches_full_logits_loss_and_grads(tiny, chunk):
    model = make_model(replace(tiny, loss_chunk_tokens=chunk))
    torch.manual_seed(0)
    rows = []
    for length, n_prompt in ((12, 5), (7, 3), (4, 1)):  # uneven real lengths, so the batch has padding
        ids = torch.randint(0, 4000, (length,)).tolist()
        rows.append([{"input_ids": ids, "labels": [IGNORE_INDEX] * n_prompt + ids[n_prompt:]}])
    batch = Collator(pad_id=0, pad_to_multiple_of=8)(rows)
    assert batch["attention_mask"].eq(0).any()

    loss_sum, n_tokens = model(**batch)
    loss_sum.backward()
    got = grads(model)
    model.zero_grad(set_to_none=True)

    expected = reference_loss_sum(model, batch)
    expected.backward()
    assert n_tokens.item() == (12 - 5) + (7 - 3) + (4 - 1)
    assert rel_diff(loss_sum.detach(), expected.detach()) <= LOSS_TOL
    assert_same_grads(got, grads(model), tol=GRAD_TOL)
    assert all(g.abs().sum() > 0 for g in got.values()), "every LoRA matrix, lora_A included, gets a gradient"


@pytest.mark.parametrize("chunk", [0, 5], ids=["plain-autograd", "chunked"])
def test_full_fine_tune_head_gradients_match_the_reference(tiny, chunk):
    """Full fine-tune: the (tied) head weight trains too, so the chunked loss must form its gradient."""
    model = build_model(replace(tiny, lora=False, loss_chunk_tokens=chunk), 0, CPU).train()
    torch.manual_seed(1)
    ids = torch.randint(0, 4000, (2, 9))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    batch["labels"][0, :3] = IGNORE_INDEX
    loss_sum, _ = model(**batch)
    loss_sum.backward()
    got = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    expected = reference_loss_sum(model, batch)
    expected.backward()
    assert rel_diff(loss_sum.detach(), expected.detach()) <= LOSS_TOL
    for name, p in model.named_parameters():
        assert rel_diff(got[name], p.grad) <= GRAD_TOL, name


class HeadGemms(TorchDispatchMode):
    """Records every matrix product that touches the vocabulary: its operand dtypes and its output shape."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab = vocab
        self.products: list[tuple[tuple[torch.dtype, ...], tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
            matrices = [a for a in args if isinstance(a, torch.Tensor) and a.dim() >= 2]
            if any(self.vocab in m.shape for m in [*matrices, out]):
                self.products.append((tuple(m.dtype for m in matrices), tuple(out.shape)))
        return out

    def largest_logits_rows(self) -> int:
        """Rows of the largest (rows x vocab) product: the logits the head built at once."""
        return max(rows for _, (*rows_dims, cols) in self.products if cols == self.vocab for rows in [rows_dims[-1]])


def test_chunked_head_runs_its_gemms_in_the_autocast_dtype_and_the_softmax_in_fp32():
    """fp32 hidden and weight under bf16 autocast: the logits, grad_hidden and grad_weight products run in
    bf16 (as F.linear would), the loss and gradients match autocast's plain head, whose cross-entropy is fp32."""
    generator = torch.Generator().manual_seed(0)
    vocab, chunk = 1000, 16
    hidden = torch.randn(50, 32, generator=generator).requires_grad_()
    weight = (torch.randn(vocab, 32, generator=generator) * 0.3).requires_grad_()
    targets = torch.randint(0, vocab, (50,), generator=generator)

    recorder = HeadGemms(vocab)
    with recorder, torch.autocast("cpu", dtype=torch.bfloat16):
        loss = ChunkedHeadLoss.apply(hidden, weight, targets, chunk, None)
    grad_hidden, grad_weight = torch.autograd.grad(loss, (hidden, weight))
    dtypes = {d for operands, _ in recorder.products for d in operands}
    shapes = {shape for _, shape in recorder.products}
    assert dtypes == {torch.bfloat16}, dtypes
    assert {(chunk, vocab), (chunk, 32), (vocab, 32)} <= shapes, "logits, grad_hidden and grad_weight products"
    assert loss.dtype == grad_hidden.dtype == grad_weight.dtype == torch.float32

    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = F.linear(hidden, weight)
    expected = F.cross_entropy(logits.float(), targets, reduction="sum")
    expected_hidden, expected_weight = torch.autograd.grad(expected, (hidden, weight))
    assert rel_diff(loss.detach(), expected.detach()) <= LOSS_TOL  # log-sum-exp in fp32 over the same bf16 logits
    assert rel_diff(grad_hidden, expected_hidden) <= 1e-2  # bf16 products: one bf16 rounding (2^-8) apart
    assert rel_diff(grad_weight, expected_weight) <= 1e-2


def test_chunked_head_scales_the_gradient_in_fp32_before_casting_to_bf16():
    """The trainer backpropagates loss_sum * world_size / n_tokens: 2/3 rounded to bf16 is 0.2% off."""
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(24, 16, generator=generator).to(torch.bfloat16).requires_grad_()
    weight = torch.randn(300, 16, generator=generator).to(torch.bfloat16)
    targets = torch.randint(0, 300, (24,), generator=generator)
    scale = torch.tensor(2 / 3)
    assert scale.to(torch.bfloat16).item() != scale.item()

    (unscaled,) = torch.autograd.grad(ChunkedHeadLoss.apply(hidden, weight, targets, 8, None), hidden)
    (scaled,) = torch.autograd.grad(ChunkedHeadLoss.apply(hidden, weight, targets, 8, None), hidden, grad_outputs=scale)
    assert scaled.dtype == torch.bfloat16
    assert torch.equal(scaled, (unscaled.float() * scale).to(torch.bfloat16)), "one rounding, after the fp32 product"


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_evaluation_runs_the_head_in_chunks_and_gives_the_plain_loss(tiny, precision):
    """Under no_grad the head must not build the (targets x vocab) logits: 8 x 1024 tokens x 152k vocab is
    ~2.5 GB of logits, more with fp32 copies."""
    chunk = 4
    model = make_model(replace(tiny, loss_chunk_tokens=chunk)).eval()
    ids = torch.randint(0, 4000, (3, 11), generator=torch.Generator().manual_seed(5))
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    batch["labels"][:, :2] = IGNORE_INDEX
    recorder = HeadGemms(model.lm_head.weight.shape[0])
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
        with recorder:
            loss_sum, n_tokens = model(**batch)
        expected = reference_loss_sum(model, batch)
    assert n_tokens.item() == 3 * 9  # labels 2..10 of each row
    assert recorder.largest_logits_rows() == chunk
    if precision == "fp32":
        assert rel_diff(loss_sum, expected) <= LOSS_TOL
    else:
        assert {d for operands, _ in recorder.products for d in operands} == {torch.bfloat16}
        assert rel_diff(loss_sum, expected) <= 1e-3


@pytest.mark.parametrize("collated", [True, False], ids=["collator-target-index", "no-target-index"])
def test_a_new_target_count_does_not_recompile_the_compiled_model(tiny, collated):
    """trainer.compile=true: every micro-batch has its own number of target tokens (and, from the collator, a
    target_index of its own length); the head stays eager so that dynamo compiles the decoder once (a compiled
    head recompiled per count until the recompile limit)."""
    from torch._dynamo.utils import counters

    from ddptrain.model import mark_shapes_dynamic

    model = make_model(replace(tiny, loss_chunk_tokens=8))
    compiled = torch.compile(model, backend="eager")  # dynamo's guards and recompiles, without codegen time
    ids = torch.randint(0, 4000, (2, 16), generator=torch.Generator().manual_seed(6))
    torch._dynamo.reset()
    counters.clear()
    try:
        graphs = []
        for n_prompt in (3, 6, 10):
            labels = ids.clone()
            labels[:, :n_prompt] = IGNORE_INDEX
            batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
            if collated:  # what the trainer passes
                rows = [[{"input_ids": ids[r].tolist(), "labels": labels[r].tolist()}] for r in range(2)]
                batch = mark_shapes_dynamic(Collator(pad_id=0, pad_to_multiple_of=1)(rows))
            loss_sum, n_tokens = compiled(**batch)
            loss_sum.backward()
            assert n_tokens.item() == 2 * (15 - n_prompt + 1)
            with torch.no_grad():
                assert rel_diff(loss_sum.detach(), model(**batch)[0]) <= 1e-6
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()
        counters.clear()
    assert graphs == [1, 1, 1], f"graphs compiled after each step: {graphs}"


def test_a_new_micro_batch_shape_does_not_recompile_the_compiled_model(tiny):
    """trainer.compile=true: micro-batches differ in length (and in number of targets). The trainer marks those
    dimensions dynamic as it moves a batch to the device, so dynamo compiles once; unmarked, it specialised on the
    first micro-batch and compiled again at the second (a second full compile of the forward and backward)."""
    from torch._dynamo.utils import counters

    from ddptrain.model import batch_to_device

    compiled = torch.compile(make_model(tiny), backend="eager")
    generator = torch.Generator().manual_seed(7)
    torch._dynamo.reset()
    counters.clear()
    try:
        graphs = []
        for length in (16, 24, 9):
            rows = [[{"input_ids": torch.randint(0, 4000, (length,), generator=generator).tolist()}] for _ in range(2)]
            for row in rows:
                row[0]["labels"] = [IGNORE_INDEX] * 2 + row[0]["input_ids"][2:]
            batch = batch_to_device(Collator(pad_id=0, pad_to_multiple_of=1)(rows), torch.device("cpu"), compiled=True)
            assert batch["input_ids"].shape == (2, length)
            loss_sum, _ = compiled(**batch)
            loss_sum.backward()
            graphs.append(counters["stats"]["unique_graphs"])
    finally:
        torch._dynamo.reset()
        counters.clear()
    assert graphs == [1, 1, 1], f"graphs compiled after each micro-batch: {graphs}"


def test_full_logits_match_the_transformers_logits(tiny):
    model = make_model(tiny).eval()
    input_ids = torch.randint(0, 4000, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.model(input_ids=input_ids).logits.float()
        assert torch.allclose(model.full_logits(input_ids), expected, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- packing


def per_sample_losses(model: CausalLMLoss, batch: dict[str, torch.Tensor], spans) -> list[torch.Tensor]:
    """Loss sum of each sample: the same batch with every other sample's labels masked."""
    losses = []
    for row, start, end in spans:
        labels = torch.full_like(batch["labels"], IGNORE_INDEX)
        labels[row, start:end] = batch["labels"][row, start:end]
        losses.append(model(**{**batch, "labels": labels, "target_index": None})[0])
    return losses


@pytest.mark.parametrize("attn", [Attention.sdpa, Attention.eager])
def test_packed_row_equals_samples_alone_and_padded(tiny, samples, attn):
    model = make_model(replace(tiny, attn_implementation=attn))
    packed = Collator(pad_id=0, packed=True)([samples])
    padded = Collator(pad_id=0, pad_to_multiple_of=8)([[s] for s in samples])
    lengths = [len(s["input_ids"]) for s in samples]
    assert len(set(lengths)) > 1, "uneven lengths, so padding is exercised"
    starts = [sum(lengths[:i]) for i in range(len(samples))]

    with torch.no_grad():
        alone = [
            model(input_ids=torch.tensor([s["input_ids"]]), labels=torch.tensor([s["labels"]]))[0] for s in samples
        ]
        from_packed = per_sample_losses(model, packed, [(0, a, a + n) for a, n in zip(starts, lengths)])
        from_padded = per_sample_losses(model, padded, [(i, 0, n) for i, n in enumerate(lengths)])
    for single, p, q in zip(alone, from_packed, from_padded):
        assert rel_diff(p, single) <= LOSS_TOL
        assert rel_diff(q, single) <= LOSS_TOL

    model.zero_grad(set_to_none=True)
    packed_sum, packed_tokens = model(**packed)
    packed_sum.backward()
    packed_grads = grads(model)
    model.zero_grad(set_to_none=True)
    padded_sum, padded_tokens = model(**padded)
    padded_sum.backward()
    assert packed_tokens.item() == padded_tokens.item()
    assert rel_diff(packed_sum.detach(), padded_sum.detach()) <= LOSS_TOL
    assert_same_grads(packed_grads, grads(model), tol=GRAD_TOL)

    # The comparison is sensitive: positions that run on across samples let attention cross them.
    run_on = {**packed, "position_ids": torch.arange(sum(lengths)).unsqueeze(0)}
    with torch.no_grad():
        leaked = per_sample_losses(model, run_on, [(0, a, a + n) for a, n in zip(starts, lengths)])
    assert rel_diff(leaked[1], alone[1]) > 1e-3


# ----------------------------------------------------------------------------- gradient checkpointing


def test_gradient_checkpointing_gives_the_same_loss_and_grads(tiny, samples):
    batch = Collator(pad_id=0)([[s] for s in samples])
    results = []
    for checkpointing in (False, True):
        model = make_model(replace(tiny, gradient_checkpointing=checkpointing))
        calls = []
        first_op = model.decoder.layers[0].input_layernorm
        handle = first_op.register_forward_hook(lambda *_, calls=calls: calls.append(1))
        loss_sum, _ = model(**batch)
        loss_sum.backward()
        handle.remove()
        results.append((loss_sum.detach(), grads(model), len(calls)))
    (plain_loss, plain_grads, plain_calls), (ckpt_loss, ckpt_grads, ckpt_calls) = results
    assert (plain_calls, ckpt_calls) == (1, 2), "checkpointing re-runs each layer's forward in backward"
    assert rel_diff(ckpt_loss, plain_loss) <= 1e-6
    assert_same_grads(ckpt_grads, plain_grads, tol=1e-6)


def test_gradient_checkpointing_trains_every_lora_weight_from_step_one(tiny, samples):
    model = build_model(replace(tiny, gradient_checkpointing=True), 0, CPU).train()
    params = lora_params(model)
    assert params and all(p.requires_grad for p in params.values())
    assert all(p.abs().sum() == 0 for name, p in params.items() if "lora_B" in name), "peft starts lora_B at zero"
    loss_sum, _ = model(**Collator(pad_id=0)([[s] for s in samples[:2]]))
    loss_sum.backward()
    assert all(p.grad is not None for p in params.values())
    b_grads = [p.grad for name, p in params.items() if "lora_B" in name]
    assert b_grads and all(g.abs().sum() > 0 for g in b_grads)


def test_gradient_checkpointing_uses_no_deprecated_api(tiny):
    """transformers 5.x deprecates gradient_checkpointing_enable / is_gradient_checkpointing (FutureWarning)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = build_model(replace(tiny, gradient_checkpointing=True), 0, CPU)
    future = [str(w.message) for w in caught if issubclass(w.category, FutureWarning)]
    assert not future
    layers = model.decoder.layers
    assert layers and all(layer.gradient_checkpointing for layer in layers)


class RecordingModel:
    """Just the checkpointing methods of a transformers model, recording how they were called."""

    def __init__(self, modern: bool):
        self.calls: list[tuple[str, dict]] = []
        if modern:
            self.activation_checkpointing_enable = lambda **kw: self.calls.append(("activation", kw))

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.calls.append(("gradient", kwargs))

    def enable_input_require_grads(self) -> None:
        self.calls.append(("input_grads", {}))


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_calls_the_current_api_and_falls_back_on_transformers_4(reentrant):
    modern, old = RecordingModel(modern=True), RecordingModel(modern=False)
    apply_gradient_checkpointing(modern, reentrant)
    apply_gradient_checkpointing(old, reentrant)
    kwargs = {"use_reentrant": reentrant}
    assert modern.calls == [("activation", {"activation_checkpointing_kwargs": kwargs}), ("input_grads", {})]
    assert old.calls == [("gradient", {"gradient_checkpointing_kwargs": kwargs}), ("input_grads", {})]


# ----------------------------------------------------------------------------- tokenizer vs model


class FakeTokenizer(SimpleNamespace):
    def __len__(self) -> int:
        return self.size


def embedding_of(rows: int) -> SimpleNamespace:
    return SimpleNamespace(get_input_embeddings=lambda: torch.nn.Embedding(rows, 2))


@requires_shared
def test_a_tokenizer_larger_than_the_embedding_is_refused_with_both_sizes_and_the_fix(tiny):
    cfg = replace(tiny, tokenizer=str(QWEN2_TOKENIZER))
    tokenizer = build_tokenizer(cfg)
    model = build_base_model(cfg, 0)
    rows = model.get_input_embeddings().num_embeddings
    assert len(tokenizer) > rows  # the real pair from the issue: Qwen2's 151,646 tokens, the tiny model's 4,352
    with pytest.raises(ValueError) as info:
        check_tokenizer_fits(tokenizer, model, cfg)
    message = str(info.value)
    assert f"model.tokenizer={QWEN2_TOKENIZER} has {len(tokenizer):,} tokens" in message
    assert f"model.name_or_path={tiny.name_or_path} embeds only {rows:,} token ids" in message
    assert "Use the model's own tokenizer" in message
    assert f"pick a model whose vocabulary covers this tokenizer (at least {len(tokenizer):,} embeddings)" in message
    assert "\n" not in message, "the self-launcher shows the last line of a rank's error"


@requires_shared
def test_build_model_checks_the_tokenizer_before_training(tiny):
    cfg = replace(tiny, tokenizer=str(QWEN2_TOKENIZER))
    with pytest.raises(ValueError, match="Use the model's own tokenizer"):
        build_model(cfg, 0, CPU, build_tokenizer(cfg))


def test_the_bundled_tokenizer_fits_the_tiny_model(tiny):
    tokenizer = build_tokenizer(tiny)
    model = build_model(tiny, 0, CPU, tokenizer)
    assert len(tokenizer) <= model.decoder.get_input_embeddings().num_embeddings


@pytest.mark.parametrize(
    ("size", "pad", "eos", "fits"),
    [
        (8, 7, 7, True),  # every id, 0..7, has a row
        (9, 0, 1, False),  # one token too many
        (8, None, 8, False),  # EOS id past the last row (an added token counted elsewhere)
        (8, 8, 1, False),  # pad id past the last row
    ],
)
def test_every_id_the_data_can_hold_must_have_an_embedding_row(tiny, size, pad, eos, fits):
    tokenizer = FakeTokenizer(size=size, pad_token_id=pad, eos_token_id=eos)
    if fits:
        check_tokenizer_fits(tokenizer, embedding_of(8), tiny)
        return
    with pytest.raises(ValueError, match=r"embeds only 8 token ids.* \(at least 9 embeddings\)"):
        check_tokenizer_fits(tokenizer, embedding_of(8), tiny)


def test_refusal_names_the_keys_the_model_and_tokenizer_came_from(tiny):
    tokenizer = FakeTokenizer(size=20, pad_token_id=19, eos_token_id=19)
    random_cfg = replace(tiny, init=ModelInit.random, config_path="/configs/small", tokenizer=None)
    with pytest.raises(ValueError) as info:
        check_tokenizer_fits(tokenizer, embedding_of(8), random_cfg)
    message = str(info.value)
    assert message.startswith("model.tokenizer=null (the tokenizer of model.name_or_path) has 20 tokens")
    assert "(pad id 19, EOS id 19) but model.config_path=/configs/small embeds only 8 token ids" in message


# ----------------------------------------------------------------------------- build_model


@pytest.mark.parametrize("dtype", [DType.fp32, DType.bf16])
def test_only_lora_weights_train_and_they_stay_fp32(tiny, dtype):
    model = build_model(replace(tiny, dtype=dtype), 0, CPU)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and trainable == set(lora_params(model))
    # all-linear: the adapters sit on every attention and MLP projection of both layers.
    for projection in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert sum(projection in name for name in trainable) == 2 * 2  # A and B, two layers
    assert all(p.dtype == torch.float32 for p in lora_params(model).values())
    base_dtype = {DType.fp32: torch.float32, DType.bf16: torch.bfloat16}[dtype]
    frozen = [p for name, p in model.named_parameters() if not p.requires_grad]
    assert frozen and all(p.dtype == base_dtype for p in frozen)


def test_full_fine_tune_trains_every_weight(tiny):
    model = build_model(replace(tiny, lora=False), 0, CPU)
    assert all(p.requires_grad for p in model.parameters())
    assert not lora_params(model)


def test_random_init_depends_only_on_the_seed(tiny):
    def weights(seed):
        return {name: p.detach().clone() for name, p in build_model(tiny, seed, CPU).named_parameters()}

    first, again, other = weights(7), weights(7), weights(8)
    assert first.keys() == again.keys() == other.keys()
    assert all(torch.equal(first[name], again[name]) for name in first)
    base = [name for name in first if "lora_" not in name and first[name].ndim == 2]
    assert base and all(not torch.equal(first[name], other[name]) for name in base)


def test_tokenizer_has_eos_and_pad(tiny):
    tokenizer = build_tokenizer(tiny)
    assert tokenizer.eos_token_id is not None and tokenizer.pad_token_id is not None
    assert tokenizer.decode([tokenizer.eos_token_id]) == tokenizer.eos_token


def _fake_liger(monkeypatch, patch_fn=None, broken_import: str | None = None) -> None:
    """liger-kernel is an optional CUDA extra, absent here: stand in its registry module."""
    import sys
    import types

    if broken_import is not None:

        class BrokenFinder:
            def find_spec(self, name, path=None, target=None):
                if name == "liger_kernel" or name.startswith("liger_kernel."):
                    raise ModuleNotFoundError(f"No module named '{broken_import}'", name=broken_import)
                return None

        monkeypatch.setattr(sys, "meta_path", [BrokenFinder(), *sys.meta_path])
        return
    package = types.ModuleType("liger_kernel")
    transformers_pkg = types.ModuleType("liger_kernel.transformers")
    registry = types.ModuleType("liger_kernel.transformers.monkey_patch")
    registry.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen2": patch_fn}
    for name, module in (
        ("liger_kernel", package),
        ("liger_kernel.transformers", transformers_pkg),
        ("liger_kernel.transformers.monkey_patch", registry),
    ):
        monkeypatch.setitem(sys.modules, name, module)


def test_liger_passes_each_family_only_the_kernels_its_patch_takes(monkeypatch) -> None:
    from ddptrain.model import apply_liger_kernel
    from tests.conftest import compose_config

    calls = []

    def gemma_style_patch(rope=True, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True, geglu=True):
        calls.append(dict(rope=rope, cross_entropy=cross_entropy, fused=fused_linear_cross_entropy, geglu=geglu))

    _fake_liger(monkeypatch, gemma_style_patch)
    apply_liger_kernel(compose_config([]).model, torch.device("cuda"))
    assert calls == [dict(rope=True, cross_entropy=False, fused=False, geglu=True)]


def test_liger_shows_a_real_import_error_not_not_installed(monkeypatch) -> None:
    from ddptrain.model import apply_liger_kernel
    from tests.conftest import compose_config

    _fake_liger(monkeypatch, broken_import="triton")
    with pytest.raises(ModuleNotFoundError, match="triton"):
        apply_liger_kernel(compose_config([]).model, torch.device("cuda"))
    _fake_liger(monkeypatch, broken_import="liger_kernel")
    with pytest.raises(RuntimeError, match="liger-kernel is not installed"):
        apply_liger_kernel(compose_config([]).model, torch.device("cuda"))


def test_fsdp2_reads_rows_only_from_files_that_hold_every_weight_under_its_own_name(tmp_path, caplog) -> None:
    """An FSDP2 run builds a pretrained model on the meta device only when its safetensors files hold every weight
    under the model's own name and shape (each rank then reads its rows of them). Files transformers would have to
    convert as it loads them (here a key under another name, as older checkpoints name it) or a checkpoint without
    safetensors files load whole on the host instead, with a warning that says why: the run still starts."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from ddptrain.model import build_base_model, build_model

    base = build_base_model(compose_config([]).model, seed=0)
    folders = {name: tmp_path / name for name in ("own_names", "renamed", "bin_only")}
    base.save_pretrained(folders["own_names"])
    base.save_pretrained(folders["renamed"])
    tensors = load_file(folders["renamed"] / "model.safetensors")
    tensors["model.final_norm.weight"] = tensors.pop("model.norm.weight")
    save_file(tensors, folders["renamed"] / "model.safetensors", metadata={"format": "pt"})
    base.config.save_pretrained(folders["bin_only"])  # and the weights as torch.save wrote them before safetensors
    torch.save(base.state_dict(), folders["bin_only"] / "pytorch_model.bin")
    assert AutoModelForCausalLM.from_pretrained(folders["bin_only"]) is not None  # a checkpoint transformers loads
    built = {}
    for name, folder in folders.items():
        cfg = compose_config(["model.init=pretrained", f"model.name_or_path={folder}", f"model.tokenizer={folder}"])
        caplog.clear()
        loss_module = build_model(cfg.model, 0, torch.device("cpu"), load_on=torch.device("meta"))
        built[name] = ({p.is_meta for p in loss_module.parameters()}, caplog.text)
    assert built["own_names"] == ({True}, "")
    assert built["renamed"][0] == {False} and "model.norm.weight" in built["renamed"][1], built["renamed"]
    assert built["bin_only"][0] == {False} and "no safetensors files" in built["bin_only"][1], built["bin_only"]
