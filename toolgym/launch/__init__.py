"""Launchers: start, wait for and stop the servers a run needs, as child processes of the caller.

``vllm_server`` runs ``vllm serve`` with the trainer's flags (used by ``toolgym vllm``, ``toolgym
train --launch_vllm``, the demo and the tests).
"""
