"""The tiny-model kit: offline models for tests and the demo (no hub is reachable here).

``tiny_model`` builds a tokenizer, a tool-calling chat template and a small model from local text;
``warm_start`` fine-tunes it on synthetic transcripts so an RL run has something to learn from.
"""
