"""Seed 004's eager polynomial fit: y = a + bx + cx^2 + dx^3 fitted to sin(x) by SGD.

The user's OneFlow script with `import oneflow as flow` replaced by
`import flowgen as flow`; nothing else changes. Expected: the loss falls to
about 9 by step 1999 and the fit is close to y = 0.84x - 0.091x^3.
"""
import math

import numpy as np

import flowgen as flow


def main(steps: int = 2000, log_every: int = 100, verbose: bool = True):
    device = flow.device("cuda" if flow.cuda.is_available() else "cpu")
    dtype = flow.float32

    # Create Tensors to hold input and outputs.
    x = flow.tensor(np.linspace(-math.pi, math.pi, 2000), device=device, dtype=dtype)
    y = flow.tensor(np.sin(x), device=device, dtype=dtype)

    # The output y is a linear function of (x, x^2, x^3): a one-layer linear model.
    xx = flow.cat(
        [x.unsqueeze(-1).pow(1), x.unsqueeze(-1).pow(2), x.unsqueeze(-1).pow(3)], dim=1
    )
    model = flow.nn.Sequential(flow.nn.Linear(3, 1), flow.nn.Flatten(0, 1))
    model.to(device)

    loss_fn = flow.nn.MSELoss(reduction="sum")
    loss_fn.to(device)

    optimizer = flow.optim.SGD(model.parameters(), lr=1e-6)

    losses = []
    for t in range(steps):
        y_pred = model(xx)
        loss = loss_fn(y_pred, y)
        if t % log_every == log_every - 1:
            losses.append((t, float(loss.numpy())))
            if verbose:
                print(t, loss.numpy())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    linear_layer = model[0]
    if verbose:
        print(
            f"Result: y = {linear_layer.bias.numpy()[0]} + {linear_layer.weight[:, 0].numpy()[0]}*x + "
            f"{linear_layer.weight[:, 1].numpy()[0]}*x^2 + {linear_layer.weight[:, 2].numpy()[0]}*x^3"
        )
    return losses, model


if __name__ == "__main__":
    main()
