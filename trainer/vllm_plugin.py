"""vLLM plugin entry point (filled in with the CPU weight-transfer backend)."""


def register() -> None:
    """Called by vLLM in every process that loads general plugins."""
