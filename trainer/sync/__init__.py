"""Weight synchronisation: the trainer's rank 0 pushes the policy into the vLLM server.

``weight_sync`` and ``lora_sync`` run in the training process; ``vllm_plugin`` is loaded by vLLM
inside the server process (an entry point of ``vllm.general_plugins``) and imports nothing else of ours.
"""
