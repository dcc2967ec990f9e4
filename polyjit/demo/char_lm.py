"""The character-level language model of ``examples/char_lm.py`` and its text, in the package
so that ``polyjit bench tensor`` and ``polyjit gpucheck`` run it from an installed wheel."""

from __future__ import annotations

from pathlib import Path

from polyjit import tensor as pt

CONTEXT, VOCAB, EMBED, HIDDEN = 8, 27, 16, 64
TEXT = Path(__file__).with_name("data") / "lighthouse.txt"  # 27 symbols: a-z and space


class CharModel:
    def __init__(self) -> None:
        self.table = pt.param("embed", (VOCAB, EMBED), init=lambda rng, s: rng.normal(0, 0.3, s))
        self.hidden = pt.Linear("hidden", CONTEXT * EMBED, HIDDEN)
        self.head = pt.Linear("head", HIDDEN, VOCAB)

    def __call__(self, context: pt.Tensor) -> pt.Tensor:
        batch = context.shape[0]
        emb = pt.embedding(context, self.table)            # (batch, 8, 16)
        feats = emb.reshape(batch, CONTEXT * EMBED)          # the 8 embeddings side by side
        return self.head(pt.tanh(self.hidden(feats)))        # (batch, 27) logits
