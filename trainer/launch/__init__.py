"""Launchers: start, wait for and stop the servers a run needs, as child processes of the caller.

``vllm_server`` runs ``vllm serve`` with the trainer's flags, ``envserver`` an env server
(``python -m envserver.cli``), both waiting on one readiness poll (``readiness``); ``threads`` is
the CPU thread policy of a trainer beside a local vLLM CPU server. ``for_run`` starts what
``launch_vllm`` / ``launch_envserver`` ask for around ``AsyncGRPOTrainer.train()`` (and so
``toolgym train``) and stops it on every way out. The demo, ``toolgym vllm``, ``toolgym eval``, the
benchmarks and the tests use the same launchers.

This layer imports only the trainer's top modules, ``trainer.sync`` (the weight-transfer backends a
server is started with) and ``sdk``; never ``envserver`` (an env server is a child process here).
"""
