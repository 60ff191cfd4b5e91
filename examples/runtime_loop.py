"""Keep your own loop: the Runtime does devices, processes, sampling, sync and checkpoints.

    trainscale run -n 2 examples/runtime_loop.py
    python examples/runtime_loop.py                   # one process, the same code
"""

import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from trainscale import Runtime
from trainscale.data import load_mnist5k
from trainscale.models import ConvNet


def main(epochs: int = 1, accumulate: int = 2) -> None:
    rt = Runtime()  # devices="auto": as many processes as the launcher started
    torch.manual_seed(0)
    model, optimizer = rt.setup(ConvNet(), lambda params: torch.optim.AdamW(params, lr=2e-3))
    train_set, _ = load_mnist5k()
    loader = rt.setup_dataloader(DataLoader(train_set, batch_size=64, shuffle=True))
    for epoch in range(epochs):
        rt.set_epoch(loader, epoch)
        total = torch.zeros(2)
        for i, batch in enumerate(loader):
            x, y = rt.to_device(batch)
            boundary = (i + 1) % accumulate == 0 or i + 1 == len(loader)
            with rt.no_backward_sync(model, enabled=not boundary):  # all-reduce only on the boundary
                with rt.autocast():
                    loss = F.cross_entropy(model(x), y)
                rt.backward(loss / accumulate)
            if boundary:
                rt.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
            total += torch.stack([loss.detach() * len(y), torch.tensor(float(len(y)))])
        total = rt.all_reduce(total)
        rt.print(f"epoch {epoch}: mean train loss {total[0] / total[1]:.4f} over {int(total[1])} samples")
    rt.save("runs/runtime_loop.pt", {"model": model, "optimizer": optimizer, "epoch": epochs})
    rt.teardown()


if __name__ == "__main__":
    main()
