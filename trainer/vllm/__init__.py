"""The vLLM server, seen from the trainer: its async client (:mod:`.client`, used by the rollout
worker), its control client (:mod:`.admin`, used by the trainer's process for weight syncs) and
what it can do (:mod:`.server_info`, read once at start)."""
