"""Sweeps: several jobs of one multirun, compared, resumable, and run side by side.

``jobs`` runs each job and keeps its record (``job.json``: skip what finished, resume what did not); ``report``
writes the sweep report from the job folders; ``callback`` refreshes it as jobs end (a Hydra callback);
``devices`` slices GPUs and cores between jobs that run at once; ``launcher`` runs them at once
(``hydra/launcher=parallel``, whose plugin class lives in ``hydra_plugins/ddptrain_launcher``).
"""
