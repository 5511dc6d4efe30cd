"""The training side: runs in the training process(es) (rank 0 and, under ``torchrun``, every other rank).

Takes scored groups off the worker's queue, packs samples into prefix-trie rows, forwards them with
tree attention, computes log-probs and the GRPO loss, and spreads rows over ranks.
"""
