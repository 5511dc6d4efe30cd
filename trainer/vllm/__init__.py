"""The vLLM server, seen from the trainer: its async client (:mod:`.client`, used by the rollout
worker), its control client (:mod:`.admin`, used by the trainer's process for weight syncs), what it
is and can do (:mod:`.server_info`, read once at start and passed to whoever needs it; several
servers read and checked to agree, :mod:`.servers`) and its ``/metrics`` (:mod:`.prometheus`)."""
