"""Small host tensors on the model's device without making the host wait for the device.

On CUDA a blocking copy from pageable host memory (`tensor.to("cuda")`, `torch.tensor(values, device="cuda")`)
waits for every kernel queued before it: on a launch-bound GPU, where the host runs ahead of the device, each such
copy drains the queue the host had filled (a host sync in all but name). The loop's per-round host tensors (index
columns, position ids, attention masks, lengths) go through `to_device` instead: a pinned staging copy (torch's
caching host allocator keeps it alive until the transfer is done) and a non-blocking transfer. Elsewhere (the CPU,
or a tensor already on the device) it is a plain `.to`.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` on `device`: the same tensor where it is there already; from the host to CUDA without blocking."""
    device = torch.device(device)
    if tensor.device == device:
        return tensor
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def tensor_on(values: list[int], device: torch.device | str) -> torch.Tensor:
    """`torch.tensor(values)` (long) on `device`, without blocking (see `to_device`)."""
    return to_device(torch.tensor(values, dtype=torch.long), device)
