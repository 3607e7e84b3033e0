"""``RNGState``: the random number generators, as a Stateful, so resumed runs are bit-identical."""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["RNGState"]


class RNGState:
    """Captures and restores Python's ``random``, numpy's global RNG, torch's CPU RNG and every CUDA RNG.

    Put it in the state (``state["rng"] = ckpt.RNGState()``); values are tensors
    and JSON, never pickle. CUDA states are restored only when the device count
    matches the saved one (otherwise skipped with the others restored).
    """

    def state_dict(self) -> dict[str, Any]:
        """The generators' states now: Python's, numpy's global, torch's CPU and every CUDA device's."""
        version, internal, gauss = random.getstate()
        sd: dict[str, Any] = {
            "python": {"version": version, "state": list(internal), "gauss": gauss},
            "torch": torch.get_rng_state(),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        try:
            import numpy as np
        except ImportError:
            return sd
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        sd["numpy"] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Set every generator to the state ``sd`` (from :meth:`state_dict`) records."""
        py = sd["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
        torch.set_rng_state(sd["torch"].cpu())
        cuda = sd.get("cuda")
        if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([t.cpu() for t in cuda])
        if "numpy" in sd:
            import numpy as np

            n = sd["numpy"]
            np.random.set_state((n["kind"], n["keys"].cpu().numpy(), n["pos"], n["has_gauss"], n["cached"]))
