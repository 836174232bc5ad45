"""TRL's ``DPOTrainer`` and ddptrain side by side on the same pairs: the loss of each step, and the time a step takes.

    python -m ddptrain.bench.dpo_parity [--model small] [--steps 10] [--pairs 8] [--loss-type sigmoid]
        [extra overrides ...]

Both train one process on the CPU, from the same LoRA model (``model.build_model``: the same random base, the same
adapter start), on the same token ids in the same batches: the first ``--steps x --pairs`` pairs of the bundled
preference set, in order, ``--pairs`` a step. β 0.1, AdamW at a constant learning rate without warm-up, clipping
at 1, no dropout, fp32. ddptrain steps its real ``Trainer.train_step`` (a 1-rank process group, through
``launch``); TRL gets the pairs as ids (the prompt's, then each reply's from its first trained token), so that its
own tokenizing and truncation do not enter. trl is a development dependency (``pip install -e '.[dev]'``).

``--model``: ``tiny`` (the bundled 2-layer model, what CI compares), ``small`` (the bundled model made 6 layers
of 512 wide: 20M parameters), ``qwen2_5_0_5b`` (Qwen2.5-0.5B's shape, 503M parameters with LoRA's, random fp32
weights, the bundled tokenizer). Prints each step's two losses and their difference, and each framework's median
seconds per step after the first (its warm-up), as markdown for ``bench/README.md``. TRL runs on as many threads as
ddptrain's rank did.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from ddptrain.config import RunConfig
from ddptrain.preview import compose_run_config

SMALL = {"num_hidden_layers": 6, "hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8}
MODELS = {
    "tiny": [],
    "qwen2_5_0_5b": [  # fp32 weights, as the smaller ones: both sides compute the same arithmetic
        "model=qwen2_5_0_5b_lora",
        "model.init=random",
        "model.tokenizer=${asset:tiny_tokenizer}",
        "model.dtype=fp32",
    ],
}
OPTIM = ["optim.scheduler=constant", "optim.warmup_steps=0", "optim.weight_decay=0", "optim.max_grad_norm=1.0"]


def run_config(steps: int, pairs: int, loss_type: str, lr: float, extra: list[str], out: Path) -> RunConfig:
    """The ddptrain run both sides train: 1 process, the first ``steps x pairs`` pairs, no evaluation."""
    overrides = ["objective=dpo", "data=tiny_preference", "data.eval_fraction=0", f"data.max_rows={steps * pairs}"]
    overrides += ["parallel.nproc_per_node=1", "trainer.device=cpu", "trainer.precision=fp32", *OPTIM]
    overrides += ["model.lora_dropout=0.0"]  # dropout draws other masks in each framework
    overrides += [f"optim.lr={lr}", f"objective.loss_type={loss_type}", f"trainer.output_dir={out}", *extra]
    return compose_run_config(overrides, None, "train")


def ddptrain_steps(cfg: RunConfig, run_dir: Path, steps: int, pairs: int) -> dict[str, list[float]]:
    """ddptrain's loss and seconds of each step, ``pairs`` pairs at a time in dataset order (``train_in_order``)."""
    from ddptrain.launch import launch

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "order.json").write_text(json.dumps({"steps": steps, "pairs": pairs}))
    launch(cfg, run_dir, entrypoint=train_in_order)
    return json.loads((run_dir / "steps.json").read_text())


def train_in_order(cfg: RunConfig, run_dir: str, store_port: int | None) -> None:
    """The worker: the real Trainer's steps on the training pairs in dataset order (``order.json``)."""
    from ddptrain import parallel
    from ddptrain.data import Collator, RowsDataset
    from ddptrain.trainer import Trainer

    order = json.loads((Path(run_dir) / "order.json").read_text())
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device, store_port)
    try:
        trainer = Trainer(cfg, env, Path(run_dir))
        rows, collate = RowsDataset(trainer.data.train), Collator(trainer.tokenizer.pad_token_id)
        losses, seconds = [], []
        for step in range(order["steps"]):
            first = step * order["pairs"]
            started = time.perf_counter()  # collating included, as TRL's step includes its collator's
            batch = collate([rows[(i,)] for i in range(first, first + order["pairs"])])
            result = trainer.train_step([batch])
            losses.append(float(result.loss_sum) / float(result.target_tokens))  # a host read: the step is done
            seconds.append(time.perf_counter() - started)
            trainer.step += 1
        record = {"losses": losses, "seconds": seconds, "threads": torch.get_num_threads()}
        (Path(run_dir) / "steps.json").write_text(json.dumps(record))
    finally:
        parallel.teardown()


def trl_steps(cfg: RunConfig, steps: int, pairs: int, out: Path) -> dict[str, list[float]]:
    """TRL's DPOTrainer on the pairs ddptrain trains, from the same LoRA model: each step's loss and seconds (from
    one step's end to the next's: its collator, its step; it logs once, at the end)."""
    import trl
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import TrainerCallback

    from ddptrain.data import IGNORE_INDEX, build_datasets
    from ddptrain.model import build_model, build_tokenizer

    tokenizer = build_tokenizer(cfg.model)
    rows = build_datasets(cfg.data, tokenizer, cfg.trainer.seed).train.select(range(steps * pairs))

    def as_ids(row: dict[str, Any]) -> dict[str, list[int]]:  # the prompt, then each reply from its first target on
        first = next(i for i, label in enumerate(row["labels"]) if label != IGNORE_INDEX)
        return {
            "prompt_ids": row["input_ids"][:first],
            "chosen_ids": row["input_ids"][first:],
            "rejected_ids": row["rejected_input_ids"][first:],
        }

    model = build_model(cfg.model, cfg.trainer.seed, torch.device("cpu"), tokenizer).model  # ddptrain's start
    losses: list[float] = []
    ended: list[float] = []

    class InOrder(trl.DPOTrainer):
        def _prepare_dataset(self, dataset, *args, **kwargs):  # already ids
            return dataset

        def _get_train_sampler(self, *args, **kwargs):
            return SequentialSampler(self.train_dataset)

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            losses.append(float((loss[0] if isinstance(loss, tuple) else loss).detach()))
            return loss

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            if not ended:  # the first step's start: its time is the first entry
                ended.append(time.perf_counter())

        def on_step_end(self, *args, **kwargs):
            ended.append(time.perf_counter())

    args = trl.DPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=pairs,
        max_steps=steps,
        learning_rate=cfg.optim.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=cfg.objective.beta,
        loss_type=cfg.objective.loss_type.value,
        max_length=None,
        gradient_checkpointing=False,
        use_cpu=True,
        bf16=False,  # fp32, as ddptrain on a CPU
        report_to=[],
        logging_steps=steps,
        save_strategy="no",
        remove_unused_columns=False,
        dataloader_drop_last=True,
        disable_tqdm=True,
    )
    dataset = Dataset.from_list([as_ids(row) for row in rows])
    parameters = sum(p.numel() for p in model.parameters())
    InOrder(model=model, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[Clock()]).train()
    return {"losses": losses, "seconds": [b - a for a, b in itertools.pairwise(ended)], "parameters": parameters}


def small_model(folder: Path) -> list[str]:
    """The bundled tiny model's config made ``SMALL``, written to ``folder``: the overrides that build it."""
    tiny = Path(compose_run_config([], None, "train").model.name_or_path)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(json.loads((tiny / "config.json").read_text()) | SMALL))
    return [f"model.config_path={folder}"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m ddptrain.bench.dpo_parity", description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=["tiny", "small", "qwen2_5_0_5b"], default="small")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=8, help="pairs per step")
    parser.add_argument("--loss-type", default="sigmoid", choices=["sigmoid", "ipo", "hinge"])
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("extra", nargs="*", help="more overrides for the ddptrain run (and the model both start from)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddptrain-bench-dpo-parity-") as tmp:
        out = Path(tmp)
        model = small_model(out / "small") if args.model == "small" else MODELS[args.model]
        cfg = run_config(args.steps, args.pairs, args.loss_type, args.lr, [*model, *args.extra], out)
        ours = ddptrain_steps(cfg, out / "ddptrain", args.steps, args.pairs)
        threads = torch.get_num_threads()
        torch.set_num_threads(ours["threads"])  # TRL on as many threads as ddptrain's rank had
        theirs = trl_steps(cfg, args.steps, args.pairs, out)
        torch.set_num_threads(threads)
    print("| step | ddptrain loss | TRL loss | difference |")
    print("|---:|---:|---:|---:|")
    for step, (a, b) in enumerate(zip(ours["losses"], theirs["losses"], strict=True), start=1):
        print(f"| {step} | {a:.6f} | {b:.6f} | {abs(a - b):.1e} |")
    worst = max(abs(a - b) for a, b in zip(ours["losses"], theirs["losses"]))
    ours_s, theirs_s = (statistics.median(run["seconds"][1:] or run["seconds"]) for run in (ours, theirs))
    print(f"\nlargest difference {worst:.1e}; s/step after the first: ddptrain {ours_s:.4f}, TRL {theirs_s:.4f} "
          f"(TRL / ddptrain {theirs_s / ours_s:.2f}); {theirs['parameters']:,} parameters, {ours['threads']} "
          "thread(s) each")  # fmt: skip


if __name__ == "__main__":
    main()
