"""A character-level language model trained on a short text shipped with the examples.

    python examples/char_lm.py                 # 300 steps of AdamW, then a generated sample
    python examples/char_lm.py --mode auto     # op by op for 3 steps, then compiled

27 symbols (a-z and space). The model reads the previous 8 characters, looks
each one up in a 27x16 embedding table (a one-hot matmul: the IR indexes only
affinely), concatenates the 8 embeddings into 128 features, applies a tanh
layer of 64 units and a linear head to 27 logits. The training step (forward,
backward, AdamW update) is one routine batch; a second plan with batch 1
shares the trained parameters to generate text.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from polyjit import tensor as pt
from polyjit.demo.char_lm import CONTEXT, TEXT, VOCAB, CharModel
from polyjit.demo.datasets import context_windows, decode_text, encode_text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--mode", choices=["compiled", "dynamic", "auto"], default="compiled")
    p.add_argument("--device", default="cpu", help="a device name, e.g. cpu or cpu:1")
    p.add_argument("--sample", type=int, default=200, help="characters to generate")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    codes = encode_text(TEXT.read_text())
    contexts, targets = context_windows(codes, CONTEXT)
    print(f"{TEXT.name}: {len(codes)} symbols, {len(contexts)} training windows")

    model = CharModel()
    ctx = pt.input("context", (args.batch, CONTEXT), "int32")
    nxt = pt.input("next", (args.batch,), "int32")
    train = pt.compile(loss=pt.cross_entropy(model(ctx), nxt), optimizer=pt.AdamW(lr=args.lr),
                       device=args.device, mode=args.mode, name="char_lm")
    one = pt.input("prompt", (1, CONTEXT), "int32")
    generate = pt.compile({"probs": pt.softmax(model(one))}, share=train, name="char_lm_sample")

    rng = np.random.default_rng(args.seed)
    first = last = 0.0
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        idx = rng.integers(0, len(contexts), args.batch)
        last = train.step(context=contexts[idx], next=targets[idx])
        if step == 1:  # the first step compiles and links: time the others
            first, t0 = last, time.perf_counter()
        elif step % 50 == 0 or step == args.steps:
            rate = (step - 1) * args.batch / (time.perf_counter() - t0)
            print(f"step {step:4d}  loss {last:.3f}  {rate:8.0f} samples/s")
    print(f"loss {first:.3f} -> {last:.3f} (uniform guessing: {np.log(VOCAB):.3f})")

    window = list(codes[:CONTEXT])
    out = []
    for _ in range(args.sample):
        probs = generate.run(prompt=np.array([window[-CONTEXT:]], np.int32))["probs"][0].astype(np.float64)
        c = int(rng.choice(VOCAB, p=probs / probs.sum()))
        out.append(c)
        window.append(c)
    print("sample:", decode_text(np.array(codes[:CONTEXT])) + "|" + decode_text(np.array(out)))
    generate.close()
    train.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
