"""Small host values to the device without waiting for it."""

from __future__ import annotations

import numpy as np
import torch


def upload(values: list | np.ndarray | torch.Tensor, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """`values` (host data) as a tensor on `device`, copied from pinned host memory: a copy from pageable memory
    (`torch.tensor(values, device=...)`) waits for the GPU to finish the work queued before it, so the host could not
    prepare what follows (the next kernels, the next step) while a forward runs."""
    host, device = torch.as_tensor(values, dtype=dtype), torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)
