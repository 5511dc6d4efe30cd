"""A Wordle-like word game: find a hidden five-letter word in six guesses.

Each guess gets letter-by-letter feedback (``G`` right letter in the right place, ``Y`` in the word
elsewhere, ``_`` not in the word, with Wordle's handling of repeated letters); the reward is 1.0
when the word is found. A dataset row may fix the word with a ``word`` column.
"""

from __future__ import annotations

import collections
import random

from sdk.environment import Environment

WORDS: tuple[str, ...] = (
    "apple", "brave", "crane", "drink", "eagle", "flame", "grape", "house", "input", "joker",
    "knife", "lemon", "mango", "night", "ocean", "piano", "queen", "river", "stone", "tiger",
    "under", "vivid", "water", "xenon", "yacht", "zebra", "bread", "chair", "dance", "earth",
    "field", "ghost", "heart", "light", "money", "north", "plant", "quiet", "round", "smile",
    "table", "unity", "voice", "world", "young", "sugar", "train", "cloud", "sheep", "spoon",
)
WORD_LENGTH = 5


def feedback(guess: str, secret: str) -> str:
    """Wordle feedback for ``guess`` against ``secret``: one of ``G``, ``Y``, ``_`` per letter."""
    marks = ["_"] * len(guess)
    unmatched = collections.Counter(s for g, s in zip(guess, secret, strict=False) if g != s)
    for i, (g, s) in enumerate(zip(guess, secret, strict=False)):
        if g == s:
            marks[i] = "G"
        elif unmatched[g] > 0:
            marks[i] = "Y"
            unmatched[g] -= 1
    return "".join(marks)


class WordGuessEnv(Environment):
    """Guess the hidden five-letter word; the reward is 1.0 when found within ``max_guesses``."""

    def __init__(self, max_guesses: int = 6, seed: int | None = None) -> None:
        self.max_guesses = max_guesses
        self._rng = random.Random(seed)
        self.secret = ""
        self.guesses: list[str] = []
        self.solved = False

    def reset(self, word: str | None = None, seed: int | None = None, **kwargs: object) -> str:
        """Start a game; returns the rules as the prompt.

        Args:
            word: The hidden word (five letters); sampled from ``WORDS`` when not given.
            seed: Reseeds the sampling first: the same seed gives the same word.
            **kwargs: Other dataset columns, ignored.
        """
        if seed is not None:
            self._rng.seed(seed)
        secret = (word or self._rng.choice(WORDS)).strip().lower()
        if len(secret) != WORD_LENGTH or not secret.isalpha():
            raise ValueError(f"the hidden word must be {WORD_LENGTH} letters, got {secret!r}")
        self.secret, self.guesses, self.solved = secret, [], False
        return (f"Find the hidden {WORD_LENGTH}-letter word in at most {self.max_guesses} guesses. "
                "Call guess(word) for each try. Feedback per letter: G = right letter, right place; "
                "Y = in the word, elsewhere; _ = not in the word.")

    def guess(self, word: str) -> str:
        """Guess the hidden word.

        Args:
            word: A five-letter word.

        Returns:
            The feedback per letter (G, Y or _), the guesses left, and whether the word is found.
        """
        if self.solved or len(self.guesses) >= self.max_guesses:
            raise RuntimeError("the game is over; no more guesses")
        word = word.strip().lower()
        if len(word) != WORD_LENGTH or not word.isalpha():
            raise ValueError(f"a guess must be exactly {WORD_LENGTH} letters, got {word!r}")
        self.guesses.append(word)
        marks = feedback(word, self.secret)
        self.solved = word == self.secret
        left = self.max_guesses - len(self.guesses)
        if self.solved:
            return f"{word.upper()} {marks}: solved in {len(self.guesses)} guesses!"
        suffix = f"{left} guesses left." if left else f"no guesses left; the word was {self.secret.upper()}."
        return f"{word.upper()} {marks}: {suffix}"

    def get_reward(self) -> float:
        """1.0 when the word was found, else 0.0."""
        return 1.0 if self.solved else 0.0
