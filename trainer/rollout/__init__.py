"""The rollout side: runs in the spawned rollout worker process (``CUDA_VISIBLE_DEVICES=""``, asyncio).

Turns dataset rows into scored groups: renders chat templates, samples through the vLLM server,
runs tools and environments, reconciles turns into samples, scores them and queues them for the trainer.
"""
