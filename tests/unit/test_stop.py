"""A stop request (SIGTERM, Ctrl-C) in one process: the ranks' vote is read one step late, so a request in
the second-to-last step must not turn a finished run into a stopped one."""

from __future__ import annotations

import pytest

from ddptrain import parallel
from ddptrain.process import signals
from ddptrain.trainer import Trainer
from tests.conftest import compose_config

TINY = ["parallel=single", "data.max_rows=200", "data.eval_fraction=0", "trainer.progress_bar=false"]


@pytest.mark.parametrize(("request_in_step", "stops"), [(1, True), (3, False)])
def test_a_stop_vote_read_after_the_last_step_lets_the_run_finish(tmp_path, request_in_step, stops) -> None:
    cfg = compose_config([*TINY, "trainer.max_steps=4", f"trainer.output_dir={tmp_path}"])
    env = parallel.init_distributed(cfg.parallel, cfg.trainer.device)
    try:
        trainer = Trainer(cfg, env, tmp_path)
        real_step = trainer.train_step

        def step_with_request(micro_batches, stop_requested=False):
            return real_step(micro_batches, stop_requested=trainer.step + 1 == request_in_step)

        trainer.train_step = step_with_request
        result = trainer.fit()
    finally:
        parallel.teardown()
    if stops:  # the vote of step 1 is read after step 2: stop there, checkpoint, no final adapter
        assert result[signals.STOPPED_AT_STEP] == 2 and trainer.step == 2
        assert (tmp_path / "checkpoints" / "step-00000002").is_dir() and not (tmp_path / "adapter").exists()
    else:  # the vote of step 3 is read after step 4, the last: the run is complete
        assert signals.STOPPED_BY not in result and trainer.step == 4
        assert (tmp_path / "adapter" / "adapter_model.safetensors").is_file()
