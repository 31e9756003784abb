"""What :func:`fk.hf.apply` did to a model, readable by a user."""

from __future__ import annotations

import logging

LOG = logging.getLogger("fk.hf")


class PatchReport(dict[str, int]):
    """How many modules each switch patched (the mapping itself: ``{"rms_norm": 5, ...}``, one key
    per switch), and, per block type (class name), what fk did with it:

    - :attr:`patched`: the block types fk patched, each with its switch;
    - :attr:`stock`: the candidate block types fk left stock, each with the switch it would have
      fallen under and why (``"rope: probe mismatch 3e-02"``). Modules that are no candidate of
      any switch (attention softmax, embeddings, routed experts) are not listed.
    """

    def __init__(self, counts: dict[str, int], patched: dict[str, str], stock: dict[str, str]) -> None:
        super().__init__(counts)
        self.patched = patched
        self.stock = stock

    def __str__(self) -> str:
        lines = [f"fk.hf patched {sum(self.values())} modules: "
                 + ", ".join(f"{k} {v}" for k, v in self.items() if v)]  # fmt: skip
        lines += [f"  {name}: {kind}" for name, kind in sorted(self.patched.items())]
        if self.stock:
            lines.append("left stock:")
            lines += [f"  {name}: {why}" for name, why in sorted(self.stock.items())]
        return "\n".join(lines)

    def log(self) -> None:
        LOG.info("%s", self)
