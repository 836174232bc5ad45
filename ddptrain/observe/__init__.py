"""What a run shows and leaves behind for the user to read.

- console: logging setup (rank 0 INFO, other ranks warnings), the console, the progress bar, RANK_ZERO_ONLY
- window: the metrics window: each step's result, this rank's share of a log window, its reduction over ranks
- metrics: metrics.jsonl on rank 0, each record handed to the chosen loggers
- loggers: TensorBoard, W&B, MLflow
- run_files: the run folder's small files on rank 0: config.yaml, the torchrun restart marker, the run report
- timing: where each step's time and memory go (the step clock)
- flops: model FLOPs per micro-batch and the device's peak (tflops, mfu)
- profiling: torch.profiler traces and CUDA memory snapshots (trainer.profile_steps)

Ranks other than 0 hold null objects with the same methods, so the loop never asks which rank it is on.
"""
