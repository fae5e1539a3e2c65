"""An ordinary PyTorch training loop; the three lines marked `# offload` turn offloading on.

    python examples/train_with_flags.py --steps 20                                  # plain (everything in hbm)
    python examples/train_with_flags.py --offload-param nvme --nvme-path /tmp/swap  # weights + states on NVMe
    python examples/train_with_flags.py --offload-optimizer cpu                     # ZeRO-Offload: states in dram

The engine replaces `optimizer.zero_grad(); loss.backward(); optimizer.step()`: the optimizer (CPU Adam over
fp32 master weights) lives inside it, so the loop creates none. `--precision` defaults to auto: bf16 where the
device runs it natively, fp32 on other CPUs; the engine's memory plan says which it chose and why.
"""

import argparse

import torch
from torch import nn
from torch.nn import functional as F

import offload


class CharLM(nn.Module):
    """A small next-character model: embedding, a stack of MLP blocks, a head."""

    def __init__(self, vocab: int = 256, d: int = 128, n_blocks: int = 4, context: int = 8):
        super().__init__()
        self.context = context
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(context * d if i == 0 else d, d), nn.GELU())
                                    for i in range(n_blocks))
        self.head = nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.embed(x).flatten(1)                       # [B, context * d]
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).float(), y)


def batches(text: bytes, batch_size: int, context: int, seed: int):
    data = torch.tensor(list(text), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=g)
        x = torch.stack([data[s:s + context] for s in starts])
        yield x, data[starts + context]


def main(argv=None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    offload.add_arguments(parser)                                          # offload (1 of 3): the flags
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = CharLM()
    engine = offload.initialize(model, offload.config_from_args(args))      # offload (2 of 3): the engine
    text = open(__file__, "rb").read() * 20
    loss = None
    for step, (x, y) in zip(range(args.steps), batches(text, args.batch_size, model.context, args.seed)):
        loss = engine(x.to(engine.device), y.to(engine.device))
        engine.backward(loss); engine.step()                                # offload (3 of 3): backward, step
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step + 1:4d}  loss {loss.item():.4f}", flush=True)
    engine.close()
    return loss.item()


if __name__ == "__main__":
    main()
